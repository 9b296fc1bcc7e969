"""Every wait inside the engine is bounded, and a refit never leaves it wedged in `refitting`.

The engine under test is the real `VllmEngine` state machine over an asyncio fake of vLLM's
`AsyncLLM` (generate / abort / collective_rpc / reset_prefix_cache): what is scripted is only
when the fake answers, so the waits, deadlines and state transitions are the production code.
"""

from __future__ import annotations

import asyncio
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nemo_rl.models.generation.vllm.config import VllmConfig
from nemo_rl.models.generation.vllm.diagnostics import engine_prompt_logprobs
from nemo_rl.models.generation.vllm.engine import EngineDeadlines, EngineState, SamplingRequest, VllmEngine, token_prompt_input
from nemo_rl.models.generation.vllm.errors import (
    EngineFailedError,
    GenerationTimeoutError,
    InvalidChatRequest,
    RefitAbortedError,
    RefitGateTimeoutError,
)
from nemo_rl.models.generation.vllm.refit import reload_weights

SAMPLING = SamplingRequest(temperature=1.0, top_p=1.0, max_tokens=4, seed=None, logprobs=False, return_token_ids=False)
EOS = 2


class EngineDead(RuntimeError):
    """Stands in for vLLM's EngineDeadError."""


@dataclass
class _Logprob:
    logprob: float


@dataclass
class _Completion:
    token_ids: list[int]
    logprobs: list[dict[int, _Logprob]]
    finish_reason: str = "stop"


@dataclass
class _Output:
    prompt_token_ids: list[int]
    outputs: list[_Completion]
    prompt_logprobs: list | None = None


@dataclass
class FakeAsyncLLM:
    """Answers each request when its gate opens; `hold` keeps a request's stream open until released."""

    hold: set[str] = field(default_factory=set)
    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)
    reloads: list[str] = field(default_factory=list)
    reload_s: float = 0.0
    reload_error: Exception | None = None
    dead: bool = False
    prefix_resets: int = 0
    trims: int = 0

    def release(self, request_id: str) -> None:
        self.gates.setdefault(request_id, asyncio.Event()).set()

    async def generate(self, prompt, params, request_id):
        if self.dead:
            raise EngineDead("engine core died")
        if request_id in self.hold:
            await self.gates.setdefault(request_id, asyncio.Event()).wait()
        ids = [5, EOS]
        yield _Output(list(prompt["prompt_token_ids"]), [_Completion(ids, [{t: _Logprob(-0.5)} for t in ids])])

    async def abort(self, request_id):
        self.aborted.append(request_id)

    async def collective_rpc(self, method, kwargs):
        if method == "trim_host_memory":
            self.trims += 1
            return [True]
        assert method == "reload_weights"
        await asyncio.sleep(self.reload_s)
        if self.reload_error is not None:
            raise self.reload_error
        self.reloads.append(kwargs["weights_path"])

    async def reset_prefix_cache(self):
        self.prefix_resets += 1


def raw_prompt(prompt_ids: list[int]) -> dict:
    """The fakes' engine input: the ids as they are (the real one is vLLM's renderer, `engine.token_prompt_input`)."""
    return {"prompt_token_ids": prompt_ids}


def _params(**kwargs):
    if kwargs.get("top_p") == 0.0:
        raise ValueError("top_p must be in (0, 1], got 0.0.")  # vLLM's SamplingParams wording
    return kwargs


def _engine(llm: FakeAsyncLLM, *, generate_s=5.0, drain_s=0.3, reload_s=0.3) -> VllmEngine:
    return VllmEngine(
        llm, EOS, max_model_len=64, max_records=10, deadlines=EngineDeadlines(generate_s, drain_s, reload_s),
        params_cls=_params, prompt_input=raw_prompt, dead_errors=(EngineDead,),
    )


async def _until(predicate, timeout_s: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.005)


def test_deadlines_come_from_the_config_and_the_gate_bound_is_their_sum() -> None:
    cfg = VllmConfig()
    assert EngineDeadlines.from_config(cfg) == EngineDeadlines(300.0, 30.0, 60.0)
    assert EngineDeadlines.from_config(cfg).refit_gate_s == 90.0


def test_refit_deadlines_must_fit_inside_the_drivers_call_deadline() -> None:
    with pytest.raises(ValueError, match=r"refit_drain_timeout_s \+ refit_reload_timeout_s = 120 s must be below "
                                         r"generation.vllm.call_timeout_s=120 s"):
        VllmConfig(refit_drain_timeout_s=60.0, refit_reload_timeout_s=60.0)


async def test_generate_stamps_the_version_and_counts_nothing_in_flight_after() -> None:
    engine = _engine(FakeAsyncLLM())
    result = await engine.generate([1, 3], SAMPLING, "r1")
    assert (result.token_ids, result.logprobs, result.weight_version) == ([5, EOS], [-0.5, -0.5], 0)
    assert (engine.inflight, engine.state) == (0, EngineState.SERVING)


class _RecordingRenderer:
    """vLLM's `Renderer.render_cmpl` shape: a list of prompts in, one engine input per prompt out."""

    def __init__(self) -> None:
        self.calls: list[list[dict]] = []

    def render_cmpl(self, prompts):
        self.calls.append(prompts)
        return [{"type": "token", "prompt_token_ids": p["prompt_token_ids"]} for p in prompts]


async def test_the_engine_gets_the_rendered_input_of_the_exact_prompt_ids() -> None:
    llm, renderer = FakeAsyncLLM(), _RecordingRenderer()
    seen: list = []
    original = llm.generate

    def generate(prompt, params, request_id):
        seen.append(prompt)
        return original(prompt, params, request_id)

    llm.generate = generate
    engine = VllmEngine(llm, EOS, max_model_len=64, max_records=10, deadlines=EngineDeadlines(5.0, 0.3, 0.3),
                        params_cls=_params, prompt_input=partial(token_prompt_input, renderer))
    result = await engine.generate([7, 8, 9], SAMPLING, "r1")
    assert renderer.calls == [[{"prompt_token_ids": [7, 8, 9]}]]
    assert seen == [{"type": "token", "prompt_token_ids": [7, 8, 9]}]  # vLLM's input type, not a raw prompt
    assert result.prompt_token_ids == [7, 8, 9]


def _refusing_input(prompt_ids: list[int]) -> dict:
    raise ValueError(f"prompt of {len(prompt_ids)} tokens refused by the renderer")


@pytest.mark.parametrize("path", ["generate", "generate_stream"])
async def test_a_prompt_the_renderer_refuses_fails_the_call_and_releases_its_slot(path: str) -> None:
    engine = VllmEngine(FakeAsyncLLM(), EOS, max_model_len=64, max_records=10, deadlines=EngineDeadlines(5.0, 0.3, 0.3),
                        params_cls=_params, prompt_input=_refusing_input)
    with pytest.raises(ValueError, match="prompt of 2 tokens refused by the renderer"):
        if path == "generate":
            await engine.generate([1, 3], SAMPLING, "r1")
        else:
            async for _ in engine.generate_stream([1, 3], SAMPLING, "r1"):
                pass
    # rendered inside the admitted call's bounds, so the slot a refit drains for is given back
    assert (engine.inflight, engine.state) == (0, EngineState.SERVING)


async def test_a_hung_generation_is_aborted_at_its_deadline() -> None:
    llm = FakeAsyncLLM(hold={"hung"})
    engine = _engine(llm, generate_s=0.05)
    with pytest.raises(GenerationTimeoutError, match=r"request hung produced no final output within "
                                                     r"generation.vllm.generate_timeout_s=0.05 s and was aborted"):
        await engine.generate([1], SAMPLING, "hung")
    assert llm.aborted == ["hung"]
    assert (engine.inflight, engine.state) == (0, EngineState.SERVING)
    assert (await engine.generate([1], SAMPLING, "next")).token_ids == [5, EOS]  # still serving


async def test_sampling_values_the_engine_refuses_are_the_callers_error() -> None:
    engine = _engine(FakeAsyncLLM())
    bad = SamplingRequest(temperature=1.0, top_p=0.0, max_tokens=4, seed=None, logprobs=False, return_token_ids=False)
    with pytest.raises(InvalidChatRequest, match=r"sampling parameters rejected by the engine: top_p must be in"):
        await engine.generate([1], bad, "r")
    assert engine.inflight == 0


async def test_a_refit_waits_for_in_flight_requests_and_holds_new_ones_at_the_gate(tmp_path: Path) -> None:
    llm = FakeAsyncLLM(hold={"old"})
    engine = _engine(llm)
    old = asyncio.create_task(engine.generate([1], SAMPLING, "old"))
    await _until(lambda: engine.inflight == 1)
    refit = asyncio.create_task(reload_weights(engine, tmp_path, 7))
    await _until(lambda: engine.state is EngineState.REFITTING)
    new = asyncio.create_task(engine.generate([1], SAMPLING, "new"))
    await asyncio.sleep(0.05)
    assert not new.done() and llm.reloads == []  # the new request waits; nothing reloads under "old"
    llm.release("old")
    await refit
    assert ((await old).weight_version, (await new).weight_version) == (0, 7)
    assert (engine.weight_version, engine.state, llm.reloads, llm.prefix_resets) == (7, EngineState.SERVING, [str(tmp_path)], 1)
    assert llm.trims == 1  # the engine core's freed heap returned after the reload


async def test_a_refit_whose_drain_times_out_is_aborted_and_the_old_weights_keep_serving(tmp_path: Path) -> None:
    llm = FakeAsyncLLM(hold={"slow"})
    engine = _engine(llm, drain_s=0.1)
    slow = asyncio.create_task(engine.generate([1], SAMPLING, "slow"))
    await _until(lambda: engine.inflight == 1)
    refit = asyncio.create_task(reload_weights(engine, tmp_path, 1))
    await _until(lambda: engine.state is EngineState.REFITTING)
    waiting = asyncio.create_task(engine.generate([1], SAMPLING, "waiting"))
    with pytest.raises(RefitAbortedError, match=r"refit to version 1 aborted: 1 generation\(s\) still in flight after "
                                                r"generation.vllm.refit_drain_timeout_s=0.1 s; the engine keeps serving version 0"):
        await refit
    assert (engine.state, engine.weight_version, engine.failure, llm.reloads, llm.trims) == (EngineState.SERVING, 0, None, [], 0)
    assert (await waiting).weight_version == 0  # the gate reopened on the old weights
    llm.release("slow")
    assert (await slow).weight_version == 0


async def test_a_reload_past_its_deadline_fails_the_engine_loudly(tmp_path: Path) -> None:
    llm = FakeAsyncLLM(reload_s=10.0)
    engine = _engine(llm, reload_s=0.1)
    refit = asyncio.create_task(reload_weights(engine, tmp_path, 3))
    await _until(lambda: engine.state is EngineState.REFITTING)
    waiting = asyncio.create_task(engine.generate([1], SAMPLING, "waiting"))
    with pytest.raises(EngineFailedError, match=r"^the vLLM engine is failed: refit to version 3 did not finish within "
                                                r"generation.vllm.refit_reload_timeout_s=0.1 s"):
        await refit
    assert engine.state is EngineState.FAILED and engine.weight_version == 0
    assert engine.failure == ("refit to version 3 did not finish within generation.vllm.refit_reload_timeout_s=0.1 s; "
                              "the weights may be partially loaded")
    with pytest.raises(EngineFailedError, match="refit_reload_timeout_s=0.1 s"):
        await waiting  # the request held at the gate is refused, not left waiting
    with pytest.raises(EngineFailedError):
        await engine.generate([1], SAMPLING, "later")
    with pytest.raises(EngineFailedError):
        await reload_weights(engine, tmp_path, 4)
    assert engine.inflight == 0


async def test_a_reload_that_raises_fails_the_engine_with_the_cause(tmp_path: Path) -> None:
    llm = FakeAsyncLLM(reload_error=KeyError("model.layers.0.weight"))
    engine = _engine(llm)
    with pytest.raises(EngineFailedError, match=r"raised KeyError: 'model.layers.0.weight'"):
        await reload_weights(engine, tmp_path, 2)
    assert engine.state is EngineState.FAILED and engine.weight_version == 0


async def test_a_refit_cancelled_while_draining_leaves_the_engine_serving(tmp_path: Path) -> None:
    llm = FakeAsyncLLM(hold={"slow"})
    engine = _engine(llm, drain_s=5.0)
    slow = asyncio.create_task(engine.generate([1], SAMPLING, "slow"))
    await _until(lambda: engine.inflight == 1)
    refit = asyncio.create_task(reload_weights(engine, tmp_path, 1))
    await _until(lambda: engine.state is EngineState.REFITTING)
    refit.cancel()
    with pytest.raises(asyncio.CancelledError):
        await refit
    assert (engine.state, engine.weight_version) == (EngineState.SERVING, 0)
    llm.release("slow")
    await slow


async def test_a_refit_cancelled_while_loading_fails_the_engine(tmp_path: Path) -> None:
    llm = FakeAsyncLLM(reload_s=5.0)
    engine = _engine(llm, reload_s=10.0)
    refit = asyncio.create_task(reload_weights(engine, tmp_path, 1))
    await _until(lambda: engine.state is EngineState.REFITTING)
    await asyncio.sleep(0.02)  # inside collective_rpc now
    refit.cancel()
    with pytest.raises(asyncio.CancelledError):
        await refit
    assert engine.state is EngineState.FAILED
    assert engine.failure == "refit to version 1 was cancelled while loading weights; the weights are unknown"


async def test_a_missing_weights_dir_aborts_before_anything_changes(tmp_path: Path) -> None:
    engine = _engine(FakeAsyncLLM())
    with pytest.raises(RefitAbortedError, match=r"weights dir .*nope is not a directory; the engine keeps serving version 0"):
        await reload_weights(engine, tmp_path / "nope", 1)
    assert (engine.state, engine.weight_version) == (EngineState.SERVING, 0)


async def test_the_gate_wait_is_bounded_even_if_a_refit_never_reopens_it() -> None:
    engine = _engine(FakeAsyncLLM(), drain_s=0.05, reload_s=0.05)
    engine._state = EngineState.REFITTING  # a refit that never ends: only a bug could do this
    with pytest.raises(RefitGateTimeoutError, match=r"refit_reload_timeout_s = 0.1 s; retry the request"):
        await engine.generate([1], SAMPLING, "r")
    assert engine.inflight == 0


async def test_a_dead_engine_process_fails_the_engine(tmp_path: Path) -> None:
    llm = FakeAsyncLLM(dead=True)
    engine = _engine(llm)
    with pytest.raises(EngineFailedError, match=r"the engine process died while serving request r1: EngineDead: engine core died"):
        await engine.generate([1], SAMPLING, "r1")
    assert engine.state is EngineState.FAILED and engine.inflight == 0
    with pytest.raises(EngineFailedError):
        await engine_prompt_logprobs(engine, [1, 2])


def test_the_trim_extension_is_wired_and_runs_here() -> None:
    from nemo_rl.models.generation.vllm.config import VllmConfig
    from nemo_rl.models.generation.vllm.lifecycle import engine_args
    from nemo_rl.models.generation.vllm.worker_extension import QUALNAME, HostMemoryTrim, trim_process_heap

    module, _, name = QUALNAME.rpartition(".")
    assert getattr(__import__(module, fromlist=[name]), name) is HostMemoryTrim
    assert engine_args(Path("/m"), VllmConfig(flavor="cpu"))["worker_extension_cls"] == QUALNAME
    assert engine_args(Path("/m"), VllmConfig(flavor="gpu"))["worker_extension_cls"] == QUALNAME
    garbage = [bytearray(1 << 20) for _ in range(64)]  # 64 MiB freed just below: glibc can give pages back
    del garbage
    assert trim_process_heap() is True
