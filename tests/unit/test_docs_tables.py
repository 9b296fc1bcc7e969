"""The docs' metric, reason and knob tables are true to the code: each set is derived FROM the code.

Contract (model: test_error_taxonomy.py's errors.md check):
- Each set is compared with its doc table both ways; a failure names the doc, the section and the
  missing (in the code, not the doc) and stale (in the doc, not the code) entries.
- Placeholder reasons: `PlaceholderReason`'s values (token-capture.md's list, receipts' table and
  the capture-health classes, which must hold exactly `CaptureHealthThresholds`' reasons).
- Finalize metrics: the keys `finalize_metrics` emits, called on real records holding every reason
  and every terminal-selection method (judge.py's, read with ast); the per-reason/per-method
  families are patterns whose expansions must be those values. The table's two rows from the
  policy's train step are checked against `ReplayStats.metrics()`, their source.
- Async metrics: `async/*` keys of the pure builders (called) plus the ones the loop in
  grpo_async.py writes itself (its string literals, read with ast); the guide's table is exact,
  its other rows and the design doc's (partial) table only must not be stale.
- Knob tables: each key is a field of the recipe's models with exactly the documented default (the
  first backticked value; `<...>`: derived when null); the worker's deadline table in seconds.
  `token_capture.*`, `grpo.async_rollouts.*`, `loss_fn.*` and `checkpointing.*` are documented
  whole; the GPU, multi-node and env tables are subsets. `model.tiny.*` (the example's) is skipped.
- Tests the docs name: every backticked test file (and `::test`) in docs/ and the README exists, and
  every health signal in token-capture.md names at least one.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import typing
from collections.abc import Iterable
from pathlib import Path

import yaml
from pydantic import BaseModel

from nemo_rl.algorithms.async_config import AsyncRolloutsConfig
from nemo_rl.algorithms.grpo_config import MasterConfig
from nemo_rl.algorithms.grpo_single_controller import engine_step_metrics
from nemo_rl.data.rows import (
    CallLineage, GroupResult, KeptRollout, Placeholder, PlaceholderReason, RolloutYield, RowOrigin, TrainRow,
)
from nemo_rl.experience.prompt_queue import PromptLedger
from nemo_rl.experience.staleness import age_histogram_metrics, trajectory_age_metrics
from nemo_rl.models.policy.config import LossConfig
from nemo_rl.models.policy.router_replay import ReplayStats
from nemo_rl.token_capture import judge
from nemo_rl.token_capture.capture_health import CaptureHealthThresholds
from nemo_rl.token_capture.config import TokenCaptureConfig
from nemo_rl.token_capture.metrics import finalize_metrics
from nemo_rl.utils.checkpoint import CheckpointingConfig

REPO = Path(__file__).resolve().parents[2]
PACKAGE_ROOT = REPO / "nemo_rl"
GUIDE = REPO / "docs" / "guides" / "token-capture.md"
RECEIPTS = REPO / "docs" / "design-docs" / "token-capture-receipts.md"
ASYNC_GUIDE = REPO / "docs" / "guides" / "async-grpo.md"
ASYNC_DESIGN = REPO / "docs" / "design-docs" / "async-grpo.md"
OFF_POLICY = REPO / "docs" / "guides" / "off-policy-correction.md"
RELIABILITY = REPO / "docs" / "design-docs" / "token-capture-reliability.md"
LAUNCHING = REPO / "docs" / "guides" / "launching.md"
GPU_RECIPE = REPO / "examples" / "configs" / "grpo_capture_gpu.yaml"
REASONS = {reason.value for reason in PlaceholderReason}


# --- markdown: a section, its first table, the backticked names of a cell -------------------------

def section(text: str, start: str) -> str:
    """The lines after the line `start` up to the next heading of its level or higher (any heading
    when `start` is not one); fenced code is skipped, so a `# comment` there is no heading."""
    lines = text.splitlines()
    assert start in lines, f"no line {start!r}"
    level = len(start) - len(start.lstrip("#")) or 6
    body, fenced = [], False
    for line in lines[lines.index(start) + 1:]:
        fenced ^= line.startswith("```")
        heading = re.match(r"(#+) ", line)
        if heading and not fenced and len(heading[1]) <= level:
            break
        body.append(line)
    return "\n".join(body)


def table(text: str) -> list[list[str]]:
    """The cells of the first markdown table in `text`, its header and separator rows excluded."""
    rows: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    assert len(rows) > 2, "no table with a row"
    return rows[2:]


def names(cell: str) -> list[str]:
    """The backticked names of `cell`, one `{a,b}` alternation expanded."""
    found = []
    for name in re.findall(r"`([^`]+)`", cell):
        alt = re.search(r"\{([^}]*)\}", name)
        found += [name[: alt.start()] + part + name[alt.end():] for part in alt[1].split(",")] if alt else [name]
    return found


def difference(doc: Path, where: str, code: Iterable[str], documented: Iterable[str]) -> str | None:
    """None when the two sets are equal, else a message naming the doc, the section and the entries."""
    code, documented = set(code), set(documented)
    missing, stale = sorted(code - documented), sorted(documented - code)
    if not (missing or stale):
        return None
    return (f"{doc.relative_to(REPO)}, {where!r}: missing (in the code, not the doc): {missing}; "
            f"stale (in the doc, not the code): {stale}")


def assert_same(doc: Path, where: str, code: Iterable[str], documented: Iterable[str]) -> None:
    message = difference(doc, where, code, documented)
    assert message is None, message


def first_column(doc: Path, start: str) -> set[str]:
    return {name for row in table(section(doc.read_text(), start)) for name in names(row[0])}


# --- 1. placeholder reasons --------------------------------------------------------------------------

def guide_reasons(text: str) -> set[str]:
    """The reasons listed in token-capture.md's prose list (asides in parentheses are not items)."""
    listed = re.sub(r"\([^()]*\)", "", section(text, "## Placeholder reasons").split("Each is counted as")[0])
    return {name for name in names(listed) if re.fullmatch(r"[a-z][a-z_]*", name)}


def expand(documented: Iterable[str], values: set[str]) -> set[str]:
    """`legacy_*` stands for the values it matches (itself, stale, when none)."""
    return {hit for name in documented for hit in (fnmatch.filter(values, name) if "*" in name else []) or [name]}


def test_the_guide_lists_exactly_the_placeholder_reasons() -> None:
    assert_same(GUIDE, "## Placeholder reasons", REASONS, guide_reasons(GUIDE.read_text()))


def test_the_receipts_doc_says_when_each_placeholder_reason_fires() -> None:
    documented = expand(first_column(RECEIPTS, "## Reason codes"), REASONS)
    assert_same(RECEIPTS, "## Reason codes", REASONS, documented)


UNVERIFIABLE_EXTRAS = {judge.SERVED_NOT_STAGED, judge.STAGED_NOT_COMMITTED, judge.EXCLUDED_BY_BRANCH_POLICY}


def test_the_receipts_doc_names_the_unverifiable_reasons_beyond_the_placeholder_ones() -> None:
    text = section(RECEIPTS.read_text(), "## Reason codes").split("Unverifiable generated tokens")[1]
    plus = text.split("plus:")[1].split("An abandoned retry")[0]
    documented = {name for name in names(plus) if re.fullmatch(r"[a-z][a-z_]*", name)}
    assert_same(RECEIPTS, "## Reason codes (unverifiable)", UNVERIFIABLE_EXTRAS, documented)


# --- 2. finalize metrics -----------------------------------------------------------------------------

def selection_methods() -> set[str]:
    """Every `terminal_selection` judge.py can name: its method map's values and TerminalChoice's literals."""
    tree = ast.parse((PACKAGE_ROOT / "token_capture" / "judge.py").read_text())
    literals = {node.args[1].value for node in ast.walk(tree)
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "TerminalChoice"
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value}
    return literals | set(judge._METHOD_TO_SELECTION.values())


def _row(rid: str, sample: int, versions: tuple[int, ...] = (0,)) -> TrainRow:
    return TrainRow(rollout_id=rid, group_index=0, sample_index=sample, token_ids=(1, 2, 3),
                    token_mask=(0.0, 1.0, 1.0), generation_logprobs=(0.0, -0.5, -0.5), reward=1.0, prompt_len=1,
                    model_call_ids=tuple(f"{rid}c{k}" for k in range(len(versions))), weight_versions=versions,
                    token_in_calls=len(versions) - 1, text_root_calls=1, terminal_selection="response_id",
                    origin=RowOrigin.CAPTURE, call_spans=tuple((0, 3) for _ in versions))


def every_kind_of_group() -> GroupResult:
    """One kept rollout losing tokens to every unverifiable reason, one placeholder per reason, every
    terminal-selection method on some rollout."""
    lost = tuple((reason, 1) for reason in sorted(REASONS | UNVERIFIABLE_EXTRAS))
    kept = KeptRollout("r0", 0, 0, (_row("r0", 0),), 1.0, "response_id",
                       RolloutYield(100, 2, lost, 1, lineage=CallLineage(1, 0, 0)))
    methods = sorted(selection_methods())
    placeholders = tuple(
        Placeholder(f"r{i}", 0, i, reason, "planted", 0.0, methods[i % len(methods)],
                    RolloutYield(2, 0, ((reason.value, 2),), 1))
        for i, reason in enumerate(PlaceholderReason, start=1)
    )
    return GroupResult(0, (kept, *placeholders))


FAMILIES = {"finalize/placeholders/": "<reason>", "finalize/terminal_selection/": "<method>",
            "finalize/unverifiable_generated_tokens/": "<reason>"}


def collapse(keys: Iterable[str]) -> tuple[set[str], dict[str, set[str]]]:
    """Keys with a family's key collapsed to its pattern, and each family's expansions."""
    patterns, expansions = set(), {prefix: set() for prefix in FAMILIES}
    for key in keys:
        prefix = next((p for p in FAMILIES if key.startswith(p)), None)
        patterns.add(prefix + FAMILIES[prefix] if prefix else key)
        if prefix:
            expansions[prefix].add(key[len(prefix):])
    return patterns, expansions


def test_every_finalize_metric_is_in_the_table_and_every_row_is_emitted() -> None:
    patterns, expansions = collapse(finalize_metrics([every_kind_of_group()], [1.0]))
    assert expansions == {"finalize/placeholders/": REASONS, "finalize/terminal_selection/": selection_methods(),
                          "finalize/unverifiable_generated_tokens/": REASONS | UNVERIFIABLE_EXTRAS}
    code = patterns | set(ReplayStats().metrics())  # the policy train step's rows, from their own source
    start = "### Every finalize metric (`nemo_rl/token_capture/metrics.py`)"
    assert_same(GUIDE, start, code, first_column(GUIDE, start))


def test_the_receipts_doc_names_every_terminal_selection_method() -> None:
    text = section(RECEIPTS.read_text(), "## Terminal precedence")
    found = re.search(r"`finalize/terminal_selection/<([^>]+)>`", text)
    assert found, "docs/design-docs/token-capture-receipts.md, '## Terminal precedence': no terminal_selection/<a|b>"
    assert_same(RECEIPTS, "## Terminal precedence", selection_methods(), found[1].split("|"))


# --- 3. async metrics --------------------------------------------------------------------------------

def _timing(clock_s: float) -> dict[str, float]:
    return {"clock_s": clock_s, "idle_s": 0.0, "refit_pause_s": 0.0, "refit_drained_calls": 0, "refits_aborted": 0}


def async_loop_metrics() -> set[str]:
    """Keys of the pure builders (called on real inputs) and the string literals of grpo_async.py."""
    group = GroupResult(0, (KeptRollout("a", 0, 0, (_row("a", 0, (3,)),), 1.0, "response_id"),))
    keys = {*trajectory_age_metrics([group], 4), *age_histogram_metrics([group], 4, 2),
            *PromptLedger(1).take_step_metrics(), *engine_step_metrics([_timing(0.0)] * 2, [_timing(1.0)] * 2)}
    tree = ast.parse((PACKAGE_ROOT / "algorithms" / "grpo_async.py").read_text())
    keys |= {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and re.fullmatch(r"[a-z_]+/[\w/]+", node.value)}
    return {re.sub(r"/hist/\d+$", "/hist/<a>", re.sub(r"^async/worker_\d+/", "async/worker_<i>/", key)) for key in keys}


ASYNC_METRICS = "## The metrics (one line per step in `metrics.jsonl`)"


def test_the_async_guide_lists_exactly_the_async_metrics() -> None:
    emitted, documented = async_loop_metrics(), first_column(ASYNC_GUIDE, ASYNC_METRICS)
    is_async = lambda key: key.startswith("async/")  # noqa: E731
    assert_same(ASYNC_GUIDE, ASYNC_METRICS, filter(is_async, emitted), filter(is_async, documented))
    # its other rows (refit/*, retention/*) and the design doc's table (a subset) must not be stale
    assert_same(ASYNC_GUIDE, ASYNC_METRICS, set(), documented - emitted)
    design = first_column(ASYNC_DESIGN, "**Metrics, each measured from the thing itself:**")
    assert_same(ASYNC_DESIGN, "Metrics, each measured from the thing itself", set(), design - emitted)


# --- 4. knob tables ----------------------------------------------------------------------------------

def _model_in(annotation: object) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next(filter(None, map(_model_in, typing.get_args(annotation))), None)


def field_info(key: str):
    """The pydantic field of the dotted recipe key `key` in `MasterConfig` (through nested models)."""
    model: type[BaseModel] | None = MasterConfig
    *parents, last = key.split(".")
    for part in parents:
        assert model is not None and part in model.model_fields, f"{key}: no section {part!r}"
        info = model.model_fields[part]
        model = _model_in(info.annotation)
    assert model is not None and last in model.model_fields, f"{key}: {last!r} is no field of {model}"
    return model.model_fields[last]


def field_default(key: str) -> object:
    return field_info(key).get_default(call_default_factory=True)


def literal_values(annotation: object) -> set[str]:
    """The string values a `Literal[...]` field (or an optional one) accepts; empty for any other type."""
    if typing.get_origin(annotation) is typing.Literal:
        return {v for v in typing.get_args(annotation) if isinstance(v, str)}
    return {v for arg in typing.get_args(annotation) for v in literal_values(arg)}


def documented_default(cell: str, index: int = 0) -> str:
    """The `index`-th backticked value of `cell` (else its first word)."""
    spans = re.findall(r"`([^`]+)`", cell) or cell.split()[:1]
    return spans[index] if index < len(spans) else "<none documented>"


def same_default(code: object, text: str) -> bool:
    """Whether the doc's `text` is the code's default: a string verbatim, `null` or `<...>` (derived when
    null) for None, else the value YAML reads (a bool only as a bool)."""
    if code is None:
        return text == "null" or text.startswith("<")
    if isinstance(code, str):
        return text == code
    value = yaml.safe_load(text)
    return value == code and isinstance(value, bool) == isinstance(code, bool)


def default_problems(doc: Path, start: str, prefix: str = "", column: int = 1) -> list[str]:
    """One line per key of the knob table under `start` whose field or default is not the code's (a row
    of several keys gives their defaults in the same order)."""
    problems = []
    for row in table(section(doc.read_text(), start)):
        for index, name in enumerate(names(row[0])):
            if name.endswith(".*"):
                continue  # model.tiny.*: the example's own model, not the recipe's
            code, text = field_default(prefix + name), documented_default(row[column], index)
            if not same_default(code, text):
                problems.append(f"{doc.relative_to(REPO)}, {start!r}: {prefix + name} documented default {text!r}, "
                                f"the code's {code!r}")
    return problems


KNOB_TABLES = [
    (GUIDE, "## Yield knobs (`token_capture.*`)", "token_capture."),
    (GUIDE, "## Every other capture knob (`token_capture.*`)", "token_capture."),
    (ASYNC_GUIDE, "## The knobs (`grpo.async_rollouts`)", "grpo.async_rollouts."),
    (OFF_POLICY, "## Knobs (`loss_fn:`)", "loss_fn."),
    (GUIDE, "## Bring your own Gym environment, dataset and model", ""),
    (GUIDE, "## GPU configuration", "", 2),
    (LAUNCHING, "## Multi-node", ""),
    (GUIDE, "## Checkpoint and resume", "checkpointing."),
]


def test_every_knob_table_has_the_codes_keys_and_defaults() -> None:
    problems = [p for doc, start, prefix, *column in KNOB_TABLES for p in default_problems(doc, start, prefix, *column)]
    assert problems == [], "\n".join(problems)


def choice_problems(doc: Path, start: str, prefix: str = "", *_: int) -> list[str]:
    """Rows of the knob table under `start` whose key takes one of several strings (a `Literal`) and
    that do not name every one of them."""
    problems = []
    for row in table(section(doc.read_text(), start)):
        for name in names(row[0]):
            if name.endswith(".*"):
                continue
            values = literal_values(field_info(prefix + name).annotation)
            missing = sorted(values - {n for cell in row[1:] for n in names(cell)})
            if len(values) > 1 and missing:
                problems.append(f"{doc.relative_to(REPO)}, {start!r}: {prefix + name} does not name {missing}")
    return problems


def test_every_knob_of_several_choices_names_them_all() -> None:
    problems = [p for doc, start, prefix, *column in KNOB_TABLES for p in choice_problems(doc, start, prefix)]
    assert problems == [], "\n".join(problems)


def test_whole_sections_are_documented_whole() -> None:
    for model, prefix in ((TokenCaptureConfig, "token_capture."), (AsyncRolloutsConfig, "grpo.async_rollouts."),
                          (LossConfig, "loss_fn."), (CheckpointingConfig, "checkpointing.")):
        tables = [(doc, start) for doc, start, p, *_ in KNOB_TABLES if p == prefix]
        documented = {prefix + name for doc, start in tables for row in table(section(doc.read_text(), start))
                      for name in names(row[0])}
        code = {prefix + field for field in model.model_fields}
        assert_same(tables[0][0], " + ".join(start for _, start in tables), code, documented)


DEADLINES = "## Deadlines inside the worker"


def deadline_problems(text: str) -> list[str]:
    """Rows of the worker's deadline table whose knob (`a.b.c` or `a.b.c + d`: a sum of siblings) is not
    the code's or whose "(N s" is not its default (in seconds)."""
    problems = []
    for row in table(section(text, DEADLINES)):
        first, *rest = names(row[1])[0].split(" + ")
        keys = [first, *(first.rsplit(".", 1)[0] + "." + term for term in rest)]
        code = sum(field_default(key) for key in keys)
        documented = re.search(r"\((\d+(?:\.\d+)?) s\b", row[1])
        if documented is None or float(documented[1]) != code:
            problems.append(f"{RELIABILITY.relative_to(REPO)}, {DEADLINES!r}: {' + '.join(keys)} documented as "
                            f"{row[1]!r}, the code's default {code:g} s")
    return problems


def test_the_worker_deadline_table_has_the_codes_knobs_and_defaults() -> None:
    problems = deadline_problems(RELIABILITY.read_text())
    assert problems == [], "\n".join(problems)


THRESHOLDS_SECTION = "#### Why each threshold sits where it does (`CaptureHealthThresholds`)"


def test_the_threshold_tables_are_capture_health_thresholds() -> None:
    text = section(GUIDE.read_text(), THRESHOLDS_SECTION)
    defaults = {name: info.default for name, info in CaptureHealthThresholds.model_fields.items()}
    documented: dict[str, object] = {}
    for row in table(text):  # | `zero_reasons` | `max_transport_rate` = 0.01 ... | ... `reason` ... |
        documented[names(row[0])[0]] = frozenset(names(row[2]))
        documented.update((m[0], float(m[1])) for m in re.findall(r"`(\w+)` = ([\d.]+)", row[1]))
    for row in table(text[text.index("| threshold |"):]):
        documented[names(row[0])[0]] = yaml.safe_load(row[1])
    assert_same(GUIDE, THRESHOLDS_SECTION, defaults, documented)
    for name, value in documented.items():
        if isinstance(value, frozenset):  # a class: exactly its reasons
            assert_same(GUIDE, f"{THRESHOLDS_SECTION} {name}", defaults[name], value)
        assert value == defaults[name], f"{GUIDE.relative_to(REPO)}, {THRESHOLDS_SECTION!r}: {name} documented as " \
            f"{value!r}, the code's {defaults[name]!r}"


def test_the_component_failure_table_has_every_value_and_the_default() -> None:
    start, field = "### When a component dies", TokenCaptureConfig.model_fields["on_component_failure"]
    rows = table(section(GUIDE.read_text(), start))
    assert_same(GUIDE, start, typing.get_args(field.annotation), {names(row[0])[0] for row in rows})
    assert [names(row[0])[0] for row in rows if "(default)" in row[0]] == [field.default], \
        f"{GUIDE.relative_to(REPO)}, {start!r}: the one row marked (default) must be `{field.default}`"


ABSENT = "-"


def recipe_value(recipe: dict, key: str) -> object:
    node: object = recipe
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return ABSENT
        node = node[part]
    return node


def test_the_gpu_recipe_column_is_the_recipe() -> None:
    recipe = yaml.safe_load(GPU_RECIPE.read_text())
    for row in table(section(GUIDE.read_text(), "## GPU configuration")):
        key, cell = names(row[0])[0], row[1]
        documented = ABSENT if cell == ABSENT else yaml.safe_load(documented_default(cell))
        assert documented == recipe_value(recipe, key), (
            f"docs/guides/token-capture.md, '## GPU configuration': {key} in the recipe column is {cell!r}, "
            f"{GPU_RECIPE.relative_to(REPO)} has {recipe_value(recipe, key)!r}")


# --- 5. the health table's tests ----------------------------------------------------------------------

TESTS = REPO / "tests"


def defines(file: Path, name: str) -> bool:
    return re.search(rf"^(async )?def {re.escape(name)}\(", file.read_text(), re.M) is not None


def named_test_problem(ref: str) -> str | None:
    """None when `ref` (`<path>.py[::test_name]`, the path from the repo root or any tail of it) names
    exactly one test file under tests/ (with `::`, exactly one that defines that test); else why not."""
    path, _, name = ref.partition("::")
    files = [f for f in sorted(TESTS.rglob(Path(path).name)) if f.relative_to(REPO).as_posix().endswith(path)]
    if not files:
        return f"{ref}: no file {path!r} under tests/"
    if name:
        files = [f for f in files if defines(f, name)]
        if not files:
            return f"{ref}: no test {name!r} in {path!r}"
    if len(files) > 1:
        return f"{ref}: {len(files)} files match {path!r}; name it by a longer path"
    return None


def doc_test_refs(text: str) -> list[str]:
    """The backticked references to test files (`tests/...py`, `test_*.py`, with or without `::test`)."""
    return [ref for ref in re.findall(r"`([^`\s]+\.py(?:::\w+)?)`", text)
            if ref.startswith("tests/") or re.match(r"(\S*/)?test_\w+\.py", ref)]


def test_every_health_signal_names_tests_that_exist() -> None:
    start = "## Confirm capture is engaged"
    rows = table(section(GUIDE.read_text(), start))
    unnamed = [row[0] for row in rows if not doc_test_refs(row[-1])]
    assert unnamed == [], f"{GUIDE.relative_to(REPO)}, {start!r}: signals that name no test: {unnamed}"


def test_every_test_the_docs_name_exists() -> None:
    docs = [*sorted((REPO / "docs").rglob("*.md")), REPO / "README.md"]
    problems = [f"{doc.relative_to(REPO)}: {problem}" for doc in docs
                for ref in doc_test_refs(doc.read_text()) if (problem := named_test_problem(ref))]
    assert problems == [], "\n".join(problems)


def test_every_metric_a_capture_step_writes_is_documented() -> None:
    from tests.integration.metrics_contract import undocumented_keys  # noqa: PLC0415 (it imports this module)

    line = {"step": 1, **finalize_metrics([every_kind_of_group()], [1.0])}
    assert undocumented_keys([line]) == set()
    planted = {**line, "planted/metric": 1.0, "finalize/placeholders/planted_reason": 1.0}
    # a per-reason key matches the documented `finalize/placeholders/<reason>` family
    assert undocumented_keys([planted]) == {"planted/metric"}


# --- the checkers fail on planted entries ------------------------------------------------------------

def test_the_comparison_names_the_doc_the_section_and_both_directions() -> None:
    message = difference(GUIDE, "## Placeholder reasons", {"a", "b"}, {"b", "planted"})
    assert message == ("docs/guides/token-capture.md, '## Placeholder reasons': missing (in the code, not the doc): "
                       "['a']; stale (in the doc, not the code): ['planted']")


def test_the_parsers_read_a_planted_doc() -> None:
    doc = ("## Placeholder reasons\n\n`run_failed` (`not_one`), `planted`. Each is counted as `x`.\n"
           "## Next\n```\n# not a heading\n```\n| key | default |\n|---|---|\n| `a_{x,y}` | `0.5` (half) |\n")
    assert guide_reasons(doc) == {"run_failed", "planted"}
    assert table(section(doc, "## Next")) == [["`a_{x,y}`", "`0.5` (half)"]]
    assert names("`a_{x,y}`") == ["a_x", "a_y"] and documented_default("`0.5`, `1` (half, one)", 1) == "1"
    assert same_default(0.5, "0.5") and same_default("off", "off") and same_default(None, "<log_dir>/weights")
    assert not same_default(True, "1") and not same_default(0.5, "0.25") and not same_default(None, "0")
    assert named_test_problem("test_docs_tables.py::test_the_parsers_read_a_planted_doc") is None
    assert named_test_problem("unit/test_docs_tables.py::test_planted") == (
        "unit/test_docs_tables.py::test_planted: no test 'test_planted' in 'unit/test_docs_tables.py'")
    assert named_test_problem("test_planted.py") == "test_planted.py: no file 'test_planted.py' under tests/"
    assert named_test_problem("test_setup.py") == "test_setup.py: 2 files match 'test_setup.py'; name it by a longer path"
    assert doc_test_refs("`tests/a.py`, `x/test_b.py::test_c`, `nemo_rl/d.py`, `test_e.py`") == [
        "tests/a.py", "x/test_b.py::test_c", "test_e.py"]
    assert expand(["legacy_*", "nope_*"], REASONS) == {"legacy_token_echo_missing", "legacy_invalid_echo",
                                                      "legacy_noncontiguous", "nope_*"}
