"""The error taxonomy (docs/design-docs/errors.md): one project base, one recoverable/fatal split.

Contract:
- Every exception class defined in `nemo_rl` derives, directly or through its bases, from
  exactly one of `RecoverableError` and `FatalError`, and so from `NemoRLError`
  (`nemo_rl.data.errors`). Modules are parsed with `ast`, never imported: the vLLM worker's
  modules import vllm, which the unit venv does not have.
- A class is an exception class when a base is a builtin exception, another exception class of
  `nemo_rl`, or an unknown name that reads like one (`...Error`, `...Exception`); base names are
  matched by their last dotted part, so exception class names must be unique in `nemo_rl`.
- The checker itself fails on planted counter-examples (an unrooted class, a class on both sides).
- `errors.md`'s per-package tables list exactly these classes, each with its side, and its count
  ("**N now**") is theirs, so the doc cannot drift from the code.
- A caller acts on the split: a dead vLLM worker (recoverable) reaches the driver as a
  `WorkerError`, a worker that declared itself failed (fatal) as its own `WorkerFailedError`.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import re
from collections.abc import Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE_ROOT = REPO / "nemo_rl"
BASE = "NemoRLError"
SIDES = ("RecoverableError", "FatalError")


def _is_builtin_exception(name: str) -> bool:
    value = getattr(builtins, name, None)
    return isinstance(value, type) and issubclass(value, BaseException)


def exception_classes(sources: Mapping[str, str]) -> dict[str, tuple[list[str], set[str]]]:
    """Every exception class of `sources` (module name -> source), the three bases excluded: its
    definitions (`module:line`) and its ancestors by name (itself included)."""
    classes: dict[str, list[tuple[str, int, list[str]]]] = {}
    for module, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
                classes.setdefault(node.name, []).append((module, node.lineno, bases))

    def bases_of(name: str) -> list[str]:
        return [b for _, _, bases in classes.get(name, []) for b in bases]

    def is_exception(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name in seen:
            return False
        if name not in classes:
            return _is_builtin_exception(name) or name.endswith(("Error", "Exception"))
        return any(is_exception(b, seen | {name}) for b in bases_of(name))

    def ancestors(name: str, seen: frozenset[str] = frozenset()) -> set[str]:
        found = {name}
        for base in bases_of(name):
            if base not in seen:
                found |= ancestors(base, seen | {name})
        return found

    return {
        name: ([f"{module}:{line}" for module, line, _ in definitions], ancestors(name))
        for name, definitions in sorted(classes.items())
        if name not in (BASE, *SIDES) and any(is_exception(b) for _, _, bases in definitions for b in bases)
    }


def taxonomy_problems(sources: Mapping[str, str]) -> tuple[list[str], int]:
    """Every exception class of `sources` (module name -> source) that breaks the contract, and
    how many exception classes were checked."""
    problems, checked = [], 0
    for name, (definitions, above) in exception_classes(sources).items():
        checked += len(definitions)
        where = ", ".join(definitions)
        if len(definitions) > 1:
            problems.append(f"{name} ({where}): defined {len(definitions)} times; exception class names are unique")
            continue
        sides = [side for side in SIDES if side in above]
        if len(sides) != 1 or BASE not in above:
            problems.append(
                f"{name} ({where}) derives from {sides or 'neither'} of {list(SIDES)}: derive it from exactly one "
                f"(nemo_rl.data.errors; see docs/design-docs/errors.md), beside any builtin base callers rely on"
            )
    return problems, checked


def package_sources() -> dict[str, str]:
    return {
        ".".join(path.relative_to(REPO).with_suffix("").parts): path.read_text()
        for path in sorted(PACKAGE_ROOT.rglob("*.py"))
    }


BASES_SOURCE = """
class NemoRLError(Exception): ...
class RecoverableError(NemoRLError): ...
class FatalError(NemoRLError): ...
"""


def test_every_exception_class_in_nemo_rl_is_on_exactly_one_side() -> None:
    problems, checked = taxonomy_problems(package_sources())
    assert problems == []
    assert checked > 0  # the exact count is errors.md's (test_errors_md_lists_every_class_with_its_side_and_the_count)


ERRORS_DOC = REPO / "docs" / "design-docs" / "errors.md"
_SIDE_NAMES = {"RecoverableError": "recoverable", "FatalError": "fatal"}


def test_errors_md_lists_every_class_with_its_side_and_the_count() -> None:
    doc = ERRORS_DOC.read_text()
    # A class row: | `Name` (`module`)...| bases | side | caught by name in |
    rows = {m[0]: m[1] for m in re.findall(r"^\| `(\w+)` \(`[\w.]+`\)[^|]*\|[^|]*\| (recoverable|fatal) \|", doc, re.M)}
    classes = exception_classes(package_sources())
    expected = {name: next(_SIDE_NAMES[s] for s in SIDES if s in above) for name, (_, above) in classes.items()}
    assert rows == expected
    assert f"**{len(classes)} now**" in doc, f"errors.md's count is not {len(classes)}"


def test_the_checker_fails_on_an_unrooted_class() -> None:
    problems, checked = taxonomy_problems({"bases": BASES_SOURCE, "planted": "class Oops(RuntimeError):\n    pass\n"})
    assert checked == 1 and len(problems) == 1 and problems[0].startswith("Oops (planted:1) derives from neither")


def test_the_checker_fails_on_a_class_on_both_sides_even_through_its_bases() -> None:
    planted = (
        "from bases import FatalError, RecoverableError\n"
        "class Both(RecoverableError, FatalError): ...\n"
        "class Late(FatalError, ValueError): ...\n"
        "class Later(Late, errors.RecoverableError): ...\n"
        "class Fine(Late): ...\n"
    )
    problems, checked = taxonomy_problems({"bases": BASES_SOURCE, "planted": planted})
    assert checked == 4
    assert [p.split(" (")[0] for p in problems] == ["Both", "Later"]
    assert "derives from ['RecoverableError', 'FatalError']" in problems[0]


def test_the_checker_fails_on_a_side_without_the_project_base_and_on_foreign_exceptions() -> None:
    planted = (
        "class RecoverableError(Exception): ...\n"  # a look-alike, not under NemoRLError
        "class Mine(RecoverableError): ...\n"
        "class Wrapped(ray.exceptions.RayError): ...\n"
        "class NotAnError: ...\n"
    )
    problems, _ = taxonomy_problems({"planted": planted})
    assert [p.split(" (")[0] for p in problems] == ["Mine", "Wrapped"]


def test_the_project_base_has_exactly_the_two_sides() -> None:
    from nemo_rl.data import errors

    assert set(errors.NemoRLError.__subclasses__()) == {errors.RecoverableError, errors.FatalError}
    assert not issubclass(errors.RecoverableError, errors.FatalError)
    assert not issubclass(errors.FatalError, errors.RecoverableError)


def test_actor_call_verdicts_are_the_split() -> None:
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    from nemo_rl.data.errors import FatalError, RecoverableError
    from nemo_rl.distributed.actor_call import ActorCallError, classify

    cases = {
        GetTimeoutError(): RecoverableError,
        RayActorError(): RecoverableError,
        RayTaskError("f", "traceback", ValueError("boom")).as_instanceof_cause(): FatalError,
    }
    for cause, side in cases.items():
        failure = classify(cause, actor="a", op="f", timeout_s=1.0)
        assert isinstance(failure, ActorCallError) and isinstance(failure, side)
        assert failure.recoverable is (side is RecoverableError)


class _Remote:
    def __init__(self, fn) -> None:
        self._fn = fn

    def remote(self, *args):
        return self._fn(*args)


class _FailingWorker:
    """Answers `take_served.remote(ids)` with an awaitable that raises `error` (an ObjectRef's way)."""

    def __init__(self, error: Exception) -> None:
        async def take(ids):
            raise error

        self.take_served = _Remote(take)


def test_a_dead_worker_is_recoverable_and_a_failed_worker_fatal_for_the_driver() -> None:
    from ray.exceptions import RayActorError, RayTaskError

    from nemo_rl.data.errors import FatalError, RecoverableError
    from nemo_rl.models.generation.vllm.client import WorkerGroup
    from nemo_rl.models.generation.vllm.errors import WorkerError, WorkerFailedError

    def group(error: Exception) -> WorkerGroup:
        return WorkerGroup(handles=[_FailingWorker(error)], base_urls=[], call_timeout_s=5.0)

    # The actor is gone: the served report is unavailable, the rollout manager records that.
    with pytest.raises(WorkerError, match="vLLM worker died during take_served") as died:
        asyncio.run(group(RayActorError()).served.take_served_async(["r1"]))
    assert isinstance(died.value, RecoverableError) and not isinstance(died.value, FatalError)

    # The worker refused the call (terminal failed state): its own fatal error reaches the driver.
    refused = WorkerFailedError("vLLM worker 0 is failed, take_served refused: engine died")
    with pytest.raises(WorkerFailedError, match="take_served refused") as failed:
        raised = RayTaskError("take_served", f"WorkerFailedError: {refused}", refused).as_instanceof_cause()
        asyncio.run(group(raised).served.take_served_async(["r1"]))
    assert isinstance(failed.value, FatalError) and not isinstance(failed.value, WorkerError)
