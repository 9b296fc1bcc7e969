"""Bad input, component failures and bugs at the worker's HTTP surface, with exact answers.

The transport (`http.py`, with the actor shell `worker.py`) runs for real on loopback (aiohttp's
TestServer) over the real `ChatService`, Gym's real `RolloutTokenCapture` and an in-memory staging
store; only the engine is a scripted stand-in (pure request logic). Expected failures are named 4xx/503s; a bug is a 500
that fails the worker; nothing is staged for a refused request; the bearer never leaks.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from examples.arith import task as arith_task
from examples.arith.tiny_model.corpus import task_conversation
from examples.arith.tiny_model.tokenizer import train_tokenizer
from nemo_gym.token_id_capture.staging import StageResult, staging_key
from nemo_rl.data_plane.errors import DataPlaneTimeoutError
from nemo_rl.data_plane.partitions import StagedKeysMissingError, StagingStoreUnavailableError
from nemo_rl.models.generation.vllm.config import GenerationConfig
from nemo_rl.models.generation.vllm.engine import EngineDeadlines, StreamStep, VllmEngine
from nemo_rl.models.generation.vllm.errors import (
    EngineFailedError,
    GenerationTimeoutError,
    RefitGateTimeoutError,
    WorkerError,
    WorkerFailedError,
)
from nemo_rl.data.errors import ApiError
from nemo_rl.models.generation.vllm.chat import derive_turn_end
from nemo_rl.models.generation.vllm.custody_state import AdmittedCalls, request_digest
from nemo_rl.models.generation.vllm.http import Endpoint, build_app
from nemo_rl.models.generation.vllm.lifecycle import build_custody
from nemo_rl.models.generation.vllm.serving import ChatService
from nemo_rl.models.generation.vllm.worker import VllmGenerationWorker
from nemo_rl.data.calls import StagedRecordInvalidError
from tests.unit.models.generation.vllm.test_engine_deadlines import raw_prompt

TOKEN = "per-run-control-token-0123456789"
MAX_MODEL_LEN = 512
MAX_BYTES = 64 * 1024
PROBLEM = arith_task.Problem("12 + 5", 17)
MESSAGES = [
    {"role": "system", "content": arith_task.SYSTEM_PROMPT},
    {"role": "user", "content": arith_task.user_prompt(PROBLEM)},
]


@pytest.fixture(scope="module")
def tokenizer():
    texts = [json.dumps(task_conversation(p)) for p in arith_task.make_problems(0, 200)]
    return train_tokenizer(texts, vocab_size=600, max_length=2048)


@dataclass(frozen=True)
class _Result:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int


class EchoEngine:
    """Always answers `The answer is 17.`; `raise_next` makes the next call raise that exception."""

    def __init__(self, tokenizer) -> None:
        self.ids = tokenizer.encode("The answer is 17.", add_special_tokens=False) + [tokenizer.eos_token_id]
        self.prompts: list[list[int]] = []
        self.raise_next: BaseException | None = None
        self.weight_version = 0

    async def generate(self, prompt_ids, sampling, request_id):
        if self.raise_next is not None:
            error, self.raise_next = self.raise_next, None
            raise error
        self.prompts.append(list(prompt_ids))
        ids = self.ids[: sampling.max_tokens]
        return _Result(request_id, list(prompt_ids), ids, [-0.5] * len(ids), "stop", self.weight_version)

    async def generate_stream(self, prompt_ids, sampling, request_id):
        """`generate`, one token per step (a `stream: true` request)."""
        result = await self.generate(prompt_ids, sampling, request_id)
        for token in result.token_ids:
            yield StreamStep([token], None)
        yield StreamStep([], result)


class Staging:
    """In-memory sink + source that refuses to overwrite a key (corruption would be a test failure)."""

    def __init__(self) -> None:
        self.records: dict = {}
        self.fetch_error: Exception | None = None
        self._lock = threading.Lock()

    def stage(self, record, *, attachments=None):
        key = staging_key(record.rollout_id, record.model_call_id)
        with self._lock:
            assert key not in self.records or self.records[key].digest == record.digest, f"{key} overwritten"
            self.records[key] = record
        return StageResult(ok=True, staging_key=key)

    def fetch(self, keys):
        from nemo_gym.token_id_capture.staging import StagedCallBaseSnapshot

        if self.fetch_error is not None:
            raise self.fetch_error
        missing = [k for k in keys if k not in self.records]
        if missing:
            raise StagedKeysMissingError("staging", missing)
        return [StagedCallBaseSnapshot.model_validate(self.records[k].model_dump(exclude={"extras"})) for k in keys]


def _service(tokenizer, engine=None, staging=None, **kw) -> tuple[ChatService, EchoEngine, Staging]:
    engine = engine or EchoEngine(tokenizer)
    staging = staging or Staging()
    custody = build_custody(staging, staging, weight_version_fn=lambda: engine.weight_version,
                            prefix_cache_max_tokens=100_000, vocab_size=len(tokenizer), max_admitted_calls=1000, **kw)
    svc = ChatService(
        engine, tokenizer, model_name="tiny", default_max_tokens=16, max_model_len=MAX_MODEL_LEN,
        turn_end=derive_turn_end(tokenizer), custody=custody,
    )
    return svc, engine, staging


def _admission(call_id: str, *, rollout: str = "r1", mode: str = "text", **extra) -> dict:
    return {"schema_version": 2, "rollout_id": rollout, "model_call_id": call_id, "parent_call_id": None,
            "prev_len": 0, "mode": mode, "required_prefix_token_ids": [], "staging_chain": [],
            "parent_chain_hash": None, **extra}


async def _refused(svc: ChatService, body: dict) -> ApiError:
    with pytest.raises(ApiError) as e:
        await svc.chat_completions(body)
    return e.value


# --- the request core -----------------------------------------------------------------------


async def test_a_reused_model_call_id_with_another_body_is_409_and_nothing_is_staged_twice(tokenizer) -> None:
    svc, engine, staging = _service(tokenizer)
    first = await svc.chat_completions({"messages": MESSAGES, "ng_capture": _admission("c1")})
    assert first["ng_commit_coords"]["disposition"] == "staged"
    again = await _refused(svc, {"messages": MESSAGES + [{"role": "user", "content": "x"}], "ng_capture": _admission("c1")})
    assert (again.status, again.err_type, again.param) == (409, "duplicate_model_call_id", "ng_capture.model_call_id")
    assert again.message == ("rollout 'r1' call 'c1' was already admitted by this worker with another request body; "
                             "a model_call_id is served once, and only a byte-identical re-send is replayed (fix: mint "
                             "a fresh model_call_id per call)")
    assert (len(engine.prompts), list(staging.records)) == (1, ["r1/c1"])
    # Another rollout may use the same call id: the key is (rollout_id, model_call_id).
    await svc.chat_completions({"messages": MESSAGES, "ng_capture": _admission("c1", rollout="r2")})
    assert sorted(staging.records) == ["r1/c1", "r2/c1"]


async def test_a_resend_of_a_committed_call_replays_its_reply_and_generates_nothing(tokenizer) -> None:
    svc, engine, staging = _service(tokenizer)
    body = {"messages": MESSAGES, "max_tokens": 8, "ng_capture": _admission("c1")}
    first = await svc.chat_completions(body)
    resent = await svc.chat_completions(json.loads(json.dumps(body)))  # the same request, decoded again
    assert resent == first  # same id, same message, same commit coordinates
    assert len(engine.prompts) == 1 and list(staging.records) == ["r1/c1"]
    assert [(c.model_call_id, c.staged) for c in svc.take_served(["r1"])] == [("c1", True)]  # served once
    assert (svc.stats["replayed_calls"], svc.stats["served_calls"], svc.stats["duplicate_model_call_id"]) == (1, 1, 0)
    # Reported: the reply is dropped from the registry, and a late re-send is refused, not replayed.
    assert svc.custody._admitted.claim(("r1", "c1"), request_digest(body)).reply_json is None
    late = await _refused(svc, body)
    assert (late.status, late.err_type, late.param) == (409, "duplicate_model_call_id", "ng_capture.model_call_id")
    assert "belongs to a rollout already reported to the trainer, so it is not replayed" in late.message
    assert len(engine.prompts) == 1 and svc.stats["replayed_calls"] == 1


def test_the_request_digest_covers_every_field_of_the_body_and_not_its_key_order() -> None:
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 1.0, "ng_capture": _admission("c1")}
    reordered = json.loads(json.dumps(dict(reversed(list(body.items())))))
    assert request_digest(reordered) == request_digest(body)
    for change in ({"max_tokens": 9}, {"temperature": 0.5}, {"seed": 1}, {"messages": MESSAGES[:1]},
                   {"ng_capture": _admission("c1", prev_len=0, parent_chain_hash=None, staging_chain=[], mode="text",
                                             rollout="r2")}):
        assert request_digest({**body, **change}) != request_digest(body), change


class HeldEngine(EchoEngine):
    """Generation waits for `release`; `fail_first` makes the first generation time out."""

    def __init__(self, tokenizer, fail_first: bool = False) -> None:
        super().__init__(tokenizer)
        self.release = asyncio.Event()
        self.started = asyncio.Event()
        self.fail_first = fail_first

    async def generate(self, prompt_ids, sampling, request_id):
        self.started.set()
        await self.release.wait()
        if self.fail_first:
            self.fail_first = False
            raise GenerationTimeoutError("generation past generation.vllm.generate_timeout_s=1s")
        return await super().generate(prompt_ids, sampling, request_id)


async def _send_then_resend_while_held(tokenizer, *, fail_first: bool):
    """The same call sent twice, the re-send while the first is held in generation."""
    engine = HeldEngine(tokenizer, fail_first=fail_first)
    svc, _, staging = _service(tokenizer, engine)
    body = {"messages": MESSAGES, "ng_capture": _admission("c1")}
    first = asyncio.ensure_future(svc.chat_completions(body))
    await engine.started.wait()
    resent = asyncio.ensure_future(svc.chat_completions(body))
    await asyncio.sleep(0.05)
    return engine, svc, staging, first, resent


async def test_a_resend_while_the_first_is_in_flight_waits_for_it_and_replays(tokenizer) -> None:
    engine, svc, staging, first, resent = await _send_then_resend_while_held(tokenizer, fail_first=False)
    assert not resent.done()  # waiting for the first, not refused
    engine.release.set()
    assert await resent == await first
    assert len(engine.prompts) == 1 and list(staging.records) == ["r1/c1"]
    assert svc.stats["replayed_calls"] == 1


async def test_a_resend_waiting_on_a_first_that_was_not_generated_is_served_in_its_place(tokenizer) -> None:
    engine, svc, staging, first, resent = await _send_then_resend_while_held(tokenizer, fail_first=True)
    engine.release.set()
    with pytest.raises(ApiError) as e:
        await first
    assert (e.value.status, e.value.err_type) == (503, "generation_timeout")
    reply = await resent
    assert reply["ng_commit_coords"]["disposition"] == "staged"
    assert len(engine.prompts) == 1 and list(staging.records) == ["r1/c1"]  # generated once, by the re-send
    assert (svc.stats["replayed_calls"], svc.stats["served_calls"]) == (0, 1)


async def test_a_resend_waits_for_the_first_only_within_its_bound(tokenizer) -> None:
    engine = HeldEngine(tokenizer)
    svc, _, _ = _service(tokenizer, engine, duplicate_wait_s=0.1)
    body = {"messages": MESSAGES, "ng_capture": _admission("c1")}
    first = asyncio.ensure_future(svc.chat_completions(body))
    await engine.started.wait()
    refused = await _refused(svc, body)
    assert (refused.status, refused.err_type) == (409, "duplicate_model_call_id")
    assert "is still in flight on this worker after 0.1s" in refused.message
    engine.release.set()
    assert (await first)["ng_commit_coords"]["disposition"] == "staged"


def test_the_replay_memory_is_the_bounded_admission_lru() -> None:
    calls = AdmittedCalls(2)
    for call in ("a", "b", "c"):
        assert calls.claim(("r", call), "d") is None
        calls.commit(("r", call), {"id": call})
    assert len(calls) == 2
    assert calls.claim(("r", "a"), "d") is None  # forgotten: admitted afresh
    assert calls.claim(("r", "c"), "d").reply_json == b'{"id":"c"}'


async def test_a_call_refused_before_generation_may_be_retried_with_its_id(tokenizer) -> None:
    svc, engine, staging = _service(tokenizer)
    staging.fetch_error = DataPlaneTimeoutError("get", "staging", 10.0)
    token_in = _admission("c2", mode="token_in", parent_call_id="c1", prev_len=3, staging_chain=["r1/c1"],
                          parent_chain_hash="ab" * 32)
    refused = await _refused(svc, {"messages": MESSAGES, "ng_capture": token_in})
    assert (refused.status, refused.err_type) == (503, "staging_unavailable")
    staging.fetch_error = None
    retried = await _refused(svc, {"messages": MESSAGES, "ng_capture": token_in})
    assert (retried.status, retried.err_type) == (503, "staging_unavailable")  # missing key now, not a duplicate
    assert "staging keys not found in partition 'staging': ['r1/c1']" in retried.message
    assert engine.prompts == [] and staging.records == {}


@pytest.mark.parametrize(
    ("error", "status", "err_type"),
    [
        (StagedKeysMissingError("staging", ["r1/c1"]), 503, "staging_unavailable"),
        (StagingStoreUnavailableError("fetching 1 staging key(s) failed: controller dead"), 503, "staging_unavailable"),
        (DataPlaneTimeoutError("get", "staging", 10.0), 503, "staging_unavailable"),
        (StagedRecordInvalidError("r1/c1", "header is not JSON"), 409, "prefix_mismatch"),
    ],
    ids=["missing", "unavailable", "deadline", "invalid"],
)
async def test_the_staging_sources_named_errors_map_to_named_answers(tokenizer, error, status, err_type) -> None:
    svc, engine, staging = _service(tokenizer)
    staging.fetch_error = error
    token_in = _admission("c2", mode="token_in", parent_call_id="c1", prev_len=3, staging_chain=["r1/c1"],
                          parent_chain_hash="ab" * 32)
    refused = await _refused(svc, {"messages": MESSAGES, "ng_capture": token_in})
    assert (refused.status, refused.err_type, refused.param) == (status, err_type, "ng_capture.staging_chain")
    assert refused.message.startswith(f"staging_chain of call c2: {type(error).__name__}: ")
    assert engine.prompts == []


async def test_a_bug_in_the_staging_source_is_not_a_data_verdict(tokenizer) -> None:
    svc, _, staging = _service(tokenizer)
    staging.fetch_error = AttributeError("'NoneType' object has no attribute 'get'")
    token_in = _admission("c2", mode="token_in", parent_call_id="c1", prev_len=3, staging_chain=["r1/c1"],
                          parent_chain_hash="ab" * 32)
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'get'"):
        await svc.chat_completions({"messages": MESSAGES, "ng_capture": token_in})


@pytest.mark.parametrize(
    ("error", "err_type"),
    [
        (EngineFailedError("the vLLM engine is failed: refit to version 3 raised KeyError"), "worker_failed"),
        (GenerationTimeoutError("request x produced no final output within 300 s"), "generation_timeout"),
        (RefitGateTimeoutError("the refit gate stayed closed"), "worker_refitting"),
    ],
)
async def test_engine_failures_are_503s_that_name_them(tokenizer, error, err_type) -> None:
    svc, engine, staging = _service(tokenizer)
    engine.raise_next = error
    refused = await _refused(svc, {"messages": MESSAGES, "ng_capture": _admission("c1")})
    assert (refused.status, refused.err_type, refused.message) == (503, err_type, str(error))
    assert staging.records == {} and svc.take_served(["r1"]) == []


async def test_inline_prefix_ids_outside_the_vocabulary_are_refused(tokenizer) -> None:
    svc, engine, _ = _service(tokenizer)
    bad = _admission("c2", mode="token_in", parent_call_id="c1", prev_len=2,
                     required_prefix_token_ids=[1, len(tokenizer) + 5], parent_chain_hash="ab" * 32)
    refused = await _refused(svc, {"messages": MESSAGES, "ng_capture": bad})
    assert (refused.status, refused.err_type, refused.param) == (400, "invalid_capture_admission", "ng_capture.required_prefix_token_ids")
    assert refused.message == (f"ng_capture.required_prefix_token_ids holds 1 id(s) outside this model's vocabulary "
                               f"0..{len(tokenizer) - 1} (first: {len(tokenizer) + 5})")
    assert engine.prompts == []


async def test_an_invalid_admission_names_the_admission_field(tokenizer) -> None:
    svc, _, _ = _service(tokenizer)
    refused = await _refused(svc, {"messages": MESSAGES, "ng_capture": {**_admission("c1"), "prev_len": "many"}})
    assert (refused.status, refused.err_type, refused.param) == (400, "invalid_capture_admission", "ng_capture.prev_len")


async def test_the_worker_refuses_max_tokens_beyond_the_context_naming_both(tokenizer) -> None:
    svc, engine, _ = _service(tokenizer)
    refused = await _refused(svc, {"messages": MESSAGES, "max_tokens": 10**9})
    assert (refused.status, refused.err_type, refused.param) == (400, "invalid_request", "max_tokens")
    assert refused.message == (f"max_tokens=1000000000 does not fit this model's context: max_model_len={MAX_MODEL_LEN} "
                               f"tokens for prompt and completion together, so max_tokens must be at most "
                               f"{MAX_MODEL_LEN - 1} (fix: lower max_tokens)")
    assert engine.prompts == []


# --- the transport --------------------------------------------------------------------------


async def _client(svc: ChatService | None, endpoint: Endpoint | None = None) -> tuple[TestClient, Endpoint]:
    endpoint = endpoint or Endpoint()
    endpoint.service = svc
    app = build_app(endpoint, model_name="tiny", max_model_len=MAX_MODEL_LEN, max_request_bytes=MAX_BYTES, control_token=TOKEN)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    return client, endpoint


async def _answer(client: TestClient, method: str, path: str, **kwargs) -> tuple[int, dict, str]:
    async with client.request(method, path, **kwargs) as resp:
        text = await resp.text()
        return resp.status, (json.loads(text) if text.startswith("{") else _sse_answer(text)), text


def _sse_answer(text: str) -> dict:
    """A streamed reply as the fuzz checks read it: its terminal error event, or its commit coords."""
    events = [json.loads(e[len("data: "):]) for e in text.split("\n\n") if e.startswith("data: {")]
    if events and "error" in events[-1]:
        return events[-1]
    coords = [e["ng_commit_coords"] for e in events if "ng_commit_coords" in e]
    return {"ng_commit_coords": coords[0]} if coords else {}


async def test_control_state_needs_the_runs_bearer_in_every_state(tokenizer) -> None:
    client, endpoint = await _client(None)
    try:
        answers = [await _answer(client, "GET", "/control/state", headers=h) for h in (
            {}, {"Authorization": "Basic " + TOKEN}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer " + TOKEN})]
        assert [(s, b.get("error", {}).get("type")) for s, b, _ in answers] == [
            (401, "control_auth_required"), (401, "control_auth_required"), (403, "control_auth_invalid"), (200, None)]
        assert answers[0][1]["error"]["param"] == "Authorization"
        assert answers[3][1] == {"state": "starting", "failure": None}
        assert all(TOKEN not in text for _, _, text in answers)
        async with client.get("/control/state") as resp:
            assert resp.headers["WWW-Authenticate"] == "Bearer"
    finally:
        await client.close()


async def test_routes_answer_by_state_starting_failed_stopping(tokenizer) -> None:
    svc, engine, _ = _service(tokenizer)
    client, endpoint = await _client(None)
    try:
        body = {"messages": MESSAGES}
        assert (await _answer(client, "POST", "/v1/chat/completions", json=body))[1]["error"]["type"] == "worker_starting"
        endpoint.service = svc
        assert (await _answer(client, "POST", "/v1/chat/completions", json=body))[0] == 200
        endpoint.engine_failure = lambda: "refit to version 3 raised KeyError: 'w'"
        for path, method in (("/v1/chat/completions", "POST"), ("/health", "GET"), ("/v1/models", "GET")):
            status, answer, _ = await _answer(client, method, path, json=body if method == "POST" else None)
            assert (status, answer["error"]["type"]) == (503, "worker_failed"), path
            assert answer["error"]["message"] == ("the vLLM worker is failed and serves nothing: refit to version 3 "
                                                  "raised KeyError: 'w'")
        state = await _answer(client, "GET", "/control/state", headers={"Authorization": f"Bearer {TOKEN}"})
        assert state[1]["state"] == "failed"
        endpoint.stopping = True
        assert (await _answer(client, "GET", "/health"))[1]["error"]["type"] == "worker_stopping"
    finally:
        await client.close()
    assert len(engine.prompts) == 1


async def test_a_bug_is_a_500_that_fails_the_worker_with_its_traceback(tokenizer) -> None:
    svc, engine, _ = _service(tokenizer)
    engine.raise_next = AttributeError("'NoneType' object has no attribute 'token_ids'")
    client, endpoint = await _client(svc)
    try:
        status, answer, text = await _answer(client, "POST", "/v1/chat/completions", json={"messages": MESSAGES})
        assert (status, answer["error"]["type"]) == (500, "internal_error")
        assert answer["error"]["message"] == "internal error (AttributeError); the worker is now failed, see its log"
        failure = endpoint.failure()
        assert failure.startswith("internal error in POST /v1/chat/completions: AttributeError: 'NoneType' object has "
                                  "no attribute 'token_ids'\nTraceback (most recent call last):")
        status, answer, _ = await _answer(client, "POST", "/v1/chat/completions", json={"messages": MESSAGES})
        assert (status, answer["error"]["type"]) == (503, "worker_failed")
    finally:
        await client.close()
    assert engine.prompts == []


@pytest.mark.parametrize(
    ("raw", "status", "err_type", "param"),
    [
        (b"{not json", 400, "invalid_json", "body"),
        (b'{"messages": [], "temperature": NaN}', 400, "invalid_json", "body"),
        (b"[" * 30_000 + b"]" * 30_000, 400, "invalid_json", "body"),
        (b'{"messages": "' + b"x" * (MAX_BYTES + 10) + b'"}', 413, "request_too_large", "body"),
        (b"[]", 400, "invalid_request", "body"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}', 400, "invalid_request", "max_tokens"),
    ],
    ids=["malformed", "nan", "deep", "too-large", "not-object", "negative-max-tokens"],
)
async def test_bad_bodies_get_a_named_4xx_and_nothing_runs(tokenizer, raw, status, err_type, param) -> None:
    svc, engine, staging = _service(tokenizer)
    client, endpoint = await _client(svc)
    try:
        got_status, answer, _ = await _answer(client, "POST", "/v1/chat/completions", data=raw,
                                              headers={"Content-Type": "application/json"})
    finally:
        await client.close()
    assert (got_status, answer["error"]["type"], answer["error"]["param"]) == (status, err_type, param)
    assert engine.prompts == [] and staging.records == {} and endpoint.failure() is None


# --- the Ray actor shell (no Ray: the actor object itself) --------------------------------------


class _HungLLM:
    """An AsyncLLM stand-in whose generation never finishes and whose reload never returns."""

    def __init__(self) -> None:
        self.never = asyncio.Event()

    async def generate(self, prompt, params, request_id):
        await self.never.wait()
        yield None

    async def abort(self, request_id):
        return None

    async def collective_rpc(self, method, kwargs):
        await self.never.wait()

    async def reset_prefix_cache(self):
        return None


def _worker_with(engine: VllmEngine, svc: ChatService) -> VllmGenerationWorker:
    worker = VllmGenerationWorker("/nonexistent", GenerationConfig().model_dump(), {}, None, worker_index=2)
    worker._engine, worker._service = engine, svc
    worker._endpoint.engine_failure = lambda: engine.failure
    return worker


async def test_an_aborted_refit_keeps_the_worker_serving_and_says_so(tokenizer, tmp_path: Path) -> None:
    engine = VllmEngine(_HungLLM(), 2, 64, 10, EngineDeadlines(5.0, 0.05, 0.05), params_cls=dict, prompt_input=raw_prompt)
    svc, _, _ = _service(tokenizer)
    worker = _worker_with(engine, svc)
    hung = asyncio.create_task(engine.generate([1], _sampling(), "hung"))
    await asyncio.sleep(0.02)
    with pytest.raises(WorkerError, match=r"vLLM worker 2: refit to version 1 aborted: 1 generation\(s\) still in "
                                          r"flight after generation.vllm.refit_drain_timeout_s=0.05 s"):
        await worker.update_weights(str(tmp_path), 1)
    assert worker.weight_version() == 0 and worker.capture_stats()["worker_index"] == 2
    hung.cancel()


async def test_a_failed_refit_fails_the_worker_and_every_later_driver_call(tokenizer, tmp_path: Path) -> None:
    engine = VllmEngine(_HungLLM(), 2, 64, 10, EngineDeadlines(5.0, 0.05, 0.05), params_cls=dict, prompt_input=raw_prompt)
    svc, _, _ = _service(tokenizer)
    worker = _worker_with(engine, svc)
    with pytest.raises(WorkerError, match=r"vLLM worker 2: refit to version 1 from .* failed: EngineFailedError: the vLLM "
                                          r"engine is failed: refit to version 1 did not finish within "
                                          r"generation.vllm.refit_reload_timeout_s=0.05 s"):
        await worker.update_weights(str(tmp_path), 1)
    expected = ("vLLM worker 2 is failed, {op} refused: refit to version 1 did not finish within "
                "generation.vllm.refit_reload_timeout_s=0.05 s; the weights may be partially loaded")
    for op, call in [("weight_version", worker.weight_version), ("capture_stats", worker.capture_stats),
                     ("engine_records", lambda: worker.engine_records([]))]:
        with pytest.raises(WorkerFailedError) as e:
            call()
        assert str(e.value) == expected.format(op=op)
    for op, coro in [("take_served", lambda: worker.take_served(["r1"])),
                     ("update_weights", lambda: worker.update_weights(str(tmp_path), 2)),
                     ("prompt_logprobs", lambda: worker.prompt_logprobs([1, 2]))]:
        with pytest.raises(WorkerFailedError) as e:
            await coro()
        assert str(e.value) == expected.format(op=op)


async def test_a_refit_folder_the_worker_cannot_see_names_the_knob_and_keeps_it_serving(tokenizer, tmp_path: Path,
                                                                                        monkeypatch) -> None:
    engine = VllmEngine(_HungLLM(), 2, 64, 10, EngineDeadlines(5.0, 0.05, 0.05), params_cls=dict, prompt_input=raw_prompt)
    svc, _, _ = _service(tokenizer)
    worker = _worker_with(engine, svc)
    monkeypatch.setattr(worker, "_node_ip", lambda: "10.0.0.2")
    with pytest.raises(WorkerError) as e:
        await worker.update_weights(str(tmp_path / "not-shared"), 1)
    assert str(e.value) == (
        f"vLLM worker 2 on node 10.0.0.2 cannot see the folder grpo.refit_dir={tmp_path / 'not-shared'} (fix: on a "
        "multi-node cluster set grpo.refit_dir to a folder on a filesystem every node mounts at the same path, e.g. "
        "NFS or Lustre; on one node, check that the folder exists)"
    )
    # The engine was never touched: same version, not failed.
    assert worker.weight_version() == 0 and worker._endpoint.failure() is None


def test_check_shared_dir_reads_the_drivers_marker_or_fails_by_name(tokenizer, tmp_path: Path, monkeypatch) -> None:
    from nemo_rl.distributed.shared_fs import remove_probe, write_probe

    engine = VllmEngine(_HungLLM(), 2, 64, 10, EngineDeadlines(5.0, 0.05, 0.05), params_cls=dict, prompt_input=raw_prompt)
    svc, _, _ = _service(tokenizer)
    worker = _worker_with(engine, svc)
    monkeypatch.setattr(worker, "_node_ip", lambda: "10.0.0.2")
    probe = write_probe(tmp_path / "refit")
    assert worker.check_shared_dir(probe, "grpo.refit_dir") is None
    remove_probe(probe)
    with pytest.raises(WorkerError, match=r"^vLLM worker 2 on node 10.0.0.2 cannot see .*, which the driver wrote in "
                                          r"grpo.refit_dir=.*: that folder is not shared with this node \(fix: "):
        worker.check_shared_dir(probe, "grpo.refit_dir")


async def test_a_model_folder_the_worker_cannot_see_fails_start_engine_by_name(monkeypatch) -> None:
    worker = VllmGenerationWorker("/nonexistent/model", GenerationConfig().model_dump(), {}, None, worker_index=1)
    monkeypatch.setattr(worker, "_node_ip", lambda: "10.0.0.3")
    with pytest.raises(WorkerError, match=r"^vLLM worker 1 on node 10.0.0.3 cannot see the folder "
                                          r"model.path=/nonexistent/model \(fix: on a multi-node cluster set model.path "):
        await worker.start_engine()


@pytest.mark.parametrize(("bind", "node_ip", "host"), [("loopback", "127.0.0.2", "127.0.0.1"),
                                                       ("node_ip", "127.0.0.2", "127.0.0.2")])
async def test_bind_listens_on_and_advertises_the_chosen_address(monkeypatch, bind: str, node_ip: str,
                                                                  host: str) -> None:
    """127.0.0.2 stands in for a node IP: any 127/8 address is this host's loopback on Linux."""
    import aiohttp

    gen = GenerationConfig.model_validate({"vllm": {"bind": bind}})
    worker = VllmGenerationWorker("/nonexistent", gen.model_dump(), {}, None, worker_index=0)
    monkeypatch.setattr(worker, "_node_ip", lambda: node_ip)
    url = await worker.bind(TOKEN)
    try:
        assert url.startswith(f"http://{host}:") and url.endswith("/v1")
        port = int(url.split(":")[2].split("/")[0])
        assert worker._runner is not None
        assert [s.getsockname()[:2] for site in worker._runner.sites for s in site._server.sockets] == [(host, port)]
        async with aiohttp.ClientSession() as session, session.get(f"{url}/models") as resp:
            assert resp.status == 503 and (await resp.json())["error"]["type"] == "worker_starting"
    finally:
        await worker.shutdown()


def _sampling():
    from nemo_rl.models.generation.vllm.engine import SamplingRequest

    return SamplingRequest(temperature=1.0, top_p=1.0, max_tokens=4, seed=None, logprobs=False, return_token_ids=False)


# --- fuzzing the endpoint (hypothesis, bounded) --------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**66), 2**66) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=12,
)
FIELDS = ["messages", "tools", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "n", "stream",
          "logprobs", "return_token_ids", "model", "ng_capture", "required_prefix_token_ids"]
ADMISSION_FIELDS = ["schema_version", "rollout_id", "model_call_id", "parent_call_id", "prev_len", "mode",
                    "required_prefix_token_ids", "staging_chain", "parent_chain_hash"]
IDS = st.sampled_from(["r1", "r2", "a b", "../x", "r" * 300, "", "ok.id-1"])


@st.composite
def chat_bodies(draw) -> bytes:
    kind = draw(st.sampled_from(["raw", "mutated", "admission"]))
    if kind == "raw":
        return draw(st.binary(max_size=64))
    body: dict = {"messages": MESSAGES, "max_tokens": 4}
    if kind == "admission":
        admission = _admission(draw(st.sampled_from(["c1", "c2", "c3"])), rollout=draw(IDS))
        for key in draw(st.lists(st.sampled_from(ADMISSION_FIELDS), max_size=2)):
            admission[key] = draw(JSON | IDS)
        body["ng_capture"] = admission
    for key in draw(st.lists(st.sampled_from(FIELDS), max_size=3)):
        body[key] = draw(JSON)
    return json.dumps(body).encode()


def _check_fuzz_answer(status: int, answer: dict, raw: bytes, staging, answers: list[tuple[int, dict]]) -> None:
    if status == 503:
        # The only 503 bad input can reach: a token-in chain naming keys that were never staged.
        assert answer["error"]["type"] == "staging_unavailable" and "not found in partition" in answer["error"]["message"]
    else:
        assert status in (200, 400, 409), (status, answer, raw[:300])
    if status == 200:
        coords = answer.get("ng_commit_coords")
        assert coords is None or coords["disposition"] == "staged" and coords["staging_key"] in staging.records
    elif status in (400, 409):
        assert answer["error"]["type"] and answer["error"]["param"], answer
    # Every staged record is one a 200 reported (nothing staged for a refused request).
    staged_reported = {a["ng_commit_coords"]["staging_key"] for s, a in answers if s == 200 and a.get("ng_commit_coords")}
    assert set(staging.records) == staged_reported


def test_fuzzed_bodies_never_get_a_5xx_name_the_field_and_reach_every_outcome(tokenizer) -> None:
    """One app on its own event loop (hypothesis drives it synchronously, one request per example);
    after the examples, the coverage check: they reached served, staged and refused requests."""
    loop = asyncio.new_event_loop()
    svc, engine, staging = _service(tokenizer)
    client, endpoint = loop.run_until_complete(_client(svc))
    answers: list[tuple[int, dict]] = []

    @settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(raw=chat_bodies())
    def one_request(raw: bytes) -> None:
        status, answer, _ = loop.run_until_complete(
            _answer(client, "POST", "/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"}))
        answers.append((status, answer))
        assert endpoint.failure() is None, endpoint.failure()
        _check_fuzz_answer(status, answer, raw, staging, answers)

    try:
        one_request()
    finally:
        loop.run_until_complete(client.close())
        loop.close()
    statuses = {status for status, _ in answers}
    assert {200, 400} <= statuses and len(staging.records) >= 1, sorted(statuses)
    assert any(a.get("error", {}).get("type") == "invalid_capture_admission" for _, a in answers)
