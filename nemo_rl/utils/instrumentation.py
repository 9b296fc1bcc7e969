"""Instrumentation hooks: no-ops unless a hook module named by `NRL_INSTRUMENTATION` is installed.

The library calls these hooks at fixed points (the worker's HTTP app, per-call cost, capture
timing, staging counters, every Gym server's command). Without the variable each hook does
nothing: no middleware, no thread, no file, no import. It is an environment variable, not a
recipe key, because it must reach processes nobody configures directly, and it changes nothing
a run computes. A hook module that cannot be imported or lacks a hook of `Hooks` is an
`InstrumentationError` naming the variable, never a silent no-op.
See docs/design-docs/distributed.md, "Instrumentation hooks".
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any, Protocol

from nemo_rl.data.errors import FatalError

ENV_MODULE = "NRL_INSTRUMENTATION"


class InstrumentationError(FatalError, RuntimeError):
    """`NRL_INSTRUMENTATION` names a module that cannot be imported or lacks a hook."""


class Hooks(Protocol):
    """What a hook module defines (as module-level functions)."""

    def add_call_cost(self, part: str, seconds: float) -> None: ...
    def set_call_fact(self, name: str, value: float) -> None: ...
    def add_counter(self, name: str, value: float) -> None: ...
    def active(self) -> bool: ...
    def aiohttp_middlewares(self, role: str = "worker") -> list[Callable[..., Any]]: ...
    def time_capture_calls(self, service: Any) -> None: ...
    def server_module_argv(self, module: str) -> list[str]: ...


# The hooks a module must define, in the order `Hooks` declares them.
HOOK_NAMES = tuple(name for name in vars(Hooks) if not name.startswith("_"))


class NoHooks:
    """The hooks when no module is installed: each does nothing."""

    def add_call_cost(self, part: str, seconds: float) -> None:
        return None

    def set_call_fact(self, name: str, value: float) -> None:
        return None

    def add_counter(self, name: str, value: float) -> None:
        return None

    def active(self) -> bool:
        return False

    def aiohttp_middlewares(self, role: str = "worker") -> list[Callable[..., Any]]:
        return []

    def time_capture_calls(self, service: Any) -> None:
        return None

    def server_module_argv(self, module: str) -> list[str]:
        return [module]


NO_HOOKS = NoHooks()
_installed: Hooks | None = None


def load_hooks(module_name: str | None) -> Hooks:
    """The hook module `module_name` names (checked for every hook), or `NO_HOOKS` when unset/empty."""
    if not module_name:
        return NO_HOOKS
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise InstrumentationError(
            f"{ENV_MODULE}={module_name!r} cannot be imported ({e}); fix: put the hook module on the "
            f"PYTHONPATH of every process, or unset {ENV_MODULE}"
        ) from e
    missing = [name for name in HOOK_NAMES if not callable(getattr(module, name, None))]
    if missing:
        raise InstrumentationError(
            f"{ENV_MODULE}={module_name!r} lacks the hook(s) {missing}; a hook module defines {list(HOOK_NAMES)}"
        )
    return module  # type: ignore[return-value]  # a module with these functions satisfies Hooks


def hooks() -> Hooks:
    """This process's hooks (loaded from the environment on first use)."""
    global _installed
    if _installed is None:
        _installed = load_hooks(os.environ.get(ENV_MODULE))
    return _installed


def add_call_cost(part: str, seconds: float) -> None:
    hooks().add_call_cost(part, seconds)


def set_call_fact(name: str, value: float) -> None:
    hooks().set_call_fact(name, value)


def add_counter(name: str, value: float) -> None:
    hooks().add_counter(name, value)


def active() -> bool:
    return hooks().active()


def aiohttp_middlewares(role: str = "worker") -> list[Callable[..., Any]]:
    return hooks().aiohttp_middlewares(role)


def time_capture_calls(service: Any) -> None:
    hooks().time_capture_calls(service)


def server_module_argv(module: str) -> list[str]:
    return hooks().server_module_argv(module)
