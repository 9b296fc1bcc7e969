"""The instrumentation seam: no-ops without NRL_INSTRUMENTATION, the named module's hooks with it."""

from __future__ import annotations

import sys
import types

import pytest

from nemo_rl.utils import instrumentation


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch):
    """No hooks loaded yet in this process (restored afterwards)."""
    monkeypatch.setattr(instrumentation, "_installed", None)
    return monkeypatch


def test_without_the_variable_every_hook_does_nothing(fresh: pytest.MonkeyPatch) -> None:
    fresh.delenv(instrumentation.ENV_MODULE, raising=False)
    assert instrumentation.hooks() is instrumentation.NO_HOOKS
    assert instrumentation.aiohttp_middlewares() == []
    assert instrumentation.server_module_argv("resources_servers.x.app") == ["resources_servers.x.app"]
    assert instrumentation.active() is False
    instrumentation.add_call_cost("stage_s", 1.0)
    instrumentation.set_call_fact("generated_tokens", 3)
    instrumentation.add_counter("staged_bytes", 10)
    instrumentation.time_capture_calls(object())


def test_the_named_module_receives_every_hook_call(fresh: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []
    module = types.ModuleType("nrl_test_hooks")
    module.add_call_cost = lambda part, seconds: calls.append(("cost", part, seconds))
    module.set_call_fact = lambda name, value: calls.append(("fact", name, value))
    module.add_counter = lambda name, value: calls.append(("counter", name, value))
    module.active = lambda: True
    module.aiohttp_middlewares = lambda role="worker": [role]
    module.time_capture_calls = lambda service: calls.append(("timed", service))
    module.server_module_argv = lambda name: ["runner", name]
    fresh.setitem(sys.modules, "nrl_test_hooks", module)
    fresh.setenv(instrumentation.ENV_MODULE, "nrl_test_hooks")
    instrumentation.add_call_cost("stage_s", 0.5)
    instrumentation.set_call_fact("generated_tokens", 3)
    instrumentation.add_counter("staged_calls", 1)
    instrumentation.time_capture_calls("svc")
    assert calls == [("cost", "stage_s", 0.5), ("fact", "generated_tokens", 3), ("counter", "staged_calls", 1),
                     ("timed", "svc")]
    assert instrumentation.active() is True
    assert instrumentation.aiohttp_middlewares() == ["worker"]
    assert instrumentation.server_module_argv("m") == ["runner", "m"]
    assert instrumentation.hooks() is module


def test_the_wire_metrics_benchmark_module_is_a_complete_hook_module() -> None:
    assert instrumentation.load_hooks("benchmarks.wire_metrics").__name__ == "benchmarks.wire_metrics"


def test_an_unimportable_or_incomplete_module_fails_naming_the_variable(fresh: pytest.MonkeyPatch) -> None:
    with pytest.raises(instrumentation.InstrumentationError, match=r"NRL_INSTRUMENTATION='no_such_hooks_mod' cannot be imported"):
        instrumentation.load_hooks("no_such_hooks_mod")
    partial = types.ModuleType("nrl_partial_hooks")
    partial.add_call_cost = lambda part, seconds: None
    fresh.setitem(sys.modules, "nrl_partial_hooks", partial)
    with pytest.raises(instrumentation.InstrumentationError, match=r"lacks the hook\(s\) \['set_call_fact', 'add_counter', 'active'"):
        instrumentation.load_hooks("nrl_partial_hooks")
