"""`BranchingCaptureLedger` against Gym's own `FileLineageStore`, over real ledger files.

Rows are written by Gym's `record` / `record_failure` from real `CaptureLedgerCommit`s
(`CallRecord` + chat request items + Responses output items, as the gate commits them).
Resolution is read through the public async `resolve`, and, for the admission decision,
through Gym's own `resolve_parent`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from examples.arith.gym_task import RESOURCES_SERVER as ARITH
from nemo_gym.token_id_capture.adapters.vllm import VLLMCaptureAdapter

from nemo_gym.token_id_capture.fingerprint import FINGERPRINT_VERSION
from nemo_gym.token_id_capture.lineage import FileLineageStore
from nemo_gym.token_id_capture.protocols import LineageResolution
from nemo_gym.token_id_capture.records import UNRESOLVED_PARENT_REASON, ParentResolutionStatus
from nemo_gym.token_id_capture.sink import CaptureContext, reset_token_sink, resolve_parent, set_token_sink
from nemo_gym.token_id_capture.staging.capture import RolloutTokenCapture
from nemo_gym.token_id_capture.staging.records import (
    CallRecord,
    CaptureAdmission,
    CaptureLedgerCommit,
    RolloutManifest,
    StagedCallRecord,
    StageResult,
    staging_key,
)
from nemo_rl.environments import nemo_gym_launch as launch
from nemo_rl.environments.gate.ledger import (
    CONTEXT_MISMATCH,
    NO_FINGERPRINT_MATCH,
    BranchingCaptureLedger,
    select_parent_row,
)
from nemo_rl.environments.nemo_gym_config import NemoGymConfig

ROLLOUT = "r1-step0-g0-i0-a0"
SYSTEM = {"role": "system", "content": "You are a calculator agent."}
USER = {"role": "user", "content": "What is 12 + 5 * 3?"}
ROOT = ParentResolutionStatus.ROOT
RESOLVED = ParentResolutionStatus.RESOLVED
UNRESOLVED = ParentResolutionStatus.UNRESOLVED


def _hex(*parts: str) -> str:
    return hashlib.sha256("/".join(parts).encode()).hexdigest()


def _tool_call(call_id: str, expression: str) -> dict:
    arguments = json.dumps({"expression": expression})
    return {"id": call_id, "type": "function", "function": {"name": "calculator", "arguments": arguments}}


def _assistant(call_id: str, expression: str) -> dict:
    """The served turn as a chat harness echoes it."""
    return {"role": "assistant", "content": None, "tool_calls": [_tool_call(call_id, expression)]}


def _output_items(call_id: str, expression: str) -> list[dict]:
    """The same turn as the gate records it (Responses output items)."""
    arguments = json.dumps({"expression": expression})
    return [
        {"type": "function_call", "call_id": call_id, "name": "calculator", "arguments": arguments, "status": "completed"}
    ]


def _tool(call_id: str, output: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _commit(
    call_id: str, request: list[dict], response: list[dict], *, parent: CaptureLedgerCommit | None = None
) -> CaptureLedgerCommit:
    prev_len = parent.record.cum_len if parent is not None else 0
    key = f"{ROLLOUT}/{call_id}"
    record = CallRecord(
        model_call_id=call_id,
        parent_call_id=parent.record.model_call_id if parent is not None else None,
        prev_len=prev_len,
        delta_len=10,
        cum_len=prev_len + 10,
        weight_version=0,
        digest=_hex("digest", call_id),
        extras_digest=_hex("extras", call_id),
        staging_key=key,
        mode="token_in" if parent is not None else "text",
        chain_hash=_hex("chain", call_id),
        cumulative_hash=_hex("cumulative", call_id),
        response_id=f"chatcmpl-{call_id}",
        fingerprint_version=FINGERPRINT_VERSION,
    )
    chain = (parent.staging_chain if parent is not None else ()) + (key,)
    return CaptureLedgerCommit(
        rollout_id=ROLLOUT, record=record, staging_chain=chain, request_items=request, response_items=response
    )


async def _resolve(store: FileLineageStore, items: list[dict]) -> LineageResolution:
    return await store.resolve(ROLLOUT, items)


async def _failures(store: FileLineageStore) -> list[tuple[str, str]]:
    manifest = RolloutManifest.model_validate(await store.manifest(ROLLOUT))
    return [(f.model_call_id, f.reason) for f in manifest.failures]


def _parent(resolution: LineageResolution) -> str | None:
    return resolution.match.model_call_id if resolution.match is not None else None


# --- (a) identical retry: two rows with one fingerprint ---------------------------------------


async def _identical_siblings(tmp_path: Path) -> tuple[BranchingCaptureLedger, list[dict]]:
    ledger = BranchingCaptureLedger(tmp_path)
    request = [SYSTEM, USER]
    # Committed first, although its id sorts last: the policy is ledger order, not id order.
    await ledger.record(_commit("ffff-first", request, _output_items("call_1", "12 + 5 * 3")))
    await ledger.record(_commit("0000-second", request, _output_items("call_1", "12 + 5 * 3")))
    continuation = [SYSTEM, USER, _assistant("call_1", "12 + 5 * 3"), _tool("call_1", "27")]
    return ledger, continuation


async def test_identical_siblings_resolve_to_the_first_committed_row(tmp_path: Path) -> None:
    ledger, continuation = await _identical_siblings(tmp_path)
    gym = FileLineageStore(tmp_path)

    gym_answer = await _resolve(gym, continuation)
    ours = [await _resolve(ledger, continuation) for _ in range(3)]
    fresh = await _resolve(BranchingCaptureLedger(tmp_path), continuation)

    assert (gym_answer.status, gym_answer.match) == (UNRESOLVED, None)
    assert {(r.status, _parent(r)) for r in ours + [fresh]} == {(RESOLVED, "ffff-first")}
    match = ours[0].match
    assert (match.staging_chain, match.prev_len, match.chain_hash) == (
        (f"{ROLLOUT}/ffff-first",),
        10,
        _hex("chain", "ffff-first"),
    )
    assert ledger.branch_counts() == {}


async def test_the_chosen_sibling_is_stable_as_the_ledger_grows(tmp_path: Path) -> None:
    ledger, continuation = await _identical_siblings(tmp_path)
    # A third identical retry with the smallest id of all: an id order would switch to it.
    await ledger.record(_commit("0000-0000-third", [SYSTEM, USER], _output_items("call_1", "12 + 5 * 3")))
    chosen = await _resolve(ledger, continuation)
    # The child is committed on the chosen sibling; its own continuation has one match.
    first = _commit("ffff-first", [SYSTEM, USER], _output_items("call_1", "12 + 5 * 3"))
    answer = {"type": "output_text", "text": "The answer is 27.", "annotations": []}
    child = _commit("child", continuation, [{"type": "message", "role": "assistant", "content": [answer]}], parent=first)
    await ledger.record(child)
    thanks = [{"role": "assistant", "content": "The answer is 27."}, {"role": "user", "content": "Thanks"}]
    grandchild_request = continuation + thanks
    next_turn = await _resolve(BranchingCaptureLedger(tmp_path), grandchild_request)

    assert (chosen.status, _parent(chosen)) == (RESOLVED, "ffff-first")
    assert (next_turn.status, _parent(next_turn)) == (RESOLVED, "child")
    assert next_turn.match.staging_chain == (f"{ROLLOUT}/ffff-first", f"{ROLLOUT}/child")
    assert next_turn.match.prev_len == 20


async def test_a_distinct_retry_resolves_to_the_continued_sibling(tmp_path: Path) -> None:
    ledger = BranchingCaptureLedger(tmp_path)
    request = [SYSTEM, USER]
    await ledger.record(_commit("first", request, _output_items("call_1", "12 + 5")))
    await ledger.record(_commit("retry", request, _output_items("call_2", "12 + 5 * 3")))
    continuation = [SYSTEM, USER, _assistant("call_2", "12 + 5 * 3"), _tool("call_2", "27")]

    ours = await _resolve(ledger, continuation)
    gym = await _resolve(FileLineageStore(tmp_path), continuation)

    assert (ours.status, _parent(ours)) == (gym.status, _parent(gym)) == (RESOLVED, "retry")


async def test_siblings_with_different_contexts_pick_the_one_the_request_continues(tmp_path: Path) -> None:
    # Gym counts fingerprint matches before checking contexts, so two matches poison the call
    # even when only one of them continues the request.
    ledger = BranchingCaptureLedger(tmp_path)
    other_user = {"role": "user", "content": "What is 1 + 1?"}
    await ledger.record(_commit("other", [SYSTEM, other_user], _output_items("call_1", "12 + 5 * 3")))
    await ledger.record(_commit("mine", [SYSTEM, USER], _output_items("call_1", "12 + 5 * 3")))
    continuation = [SYSTEM, USER, _assistant("call_1", "12 + 5 * 3"), _tool("call_1", "27")]

    ours = await _resolve(ledger, continuation)
    gym = await _resolve(FileLineageStore(tmp_path), continuation)

    assert (ours.status, _parent(ours)) == (RESOLVED, "mine")
    assert gym.status == UNRESOLVED


async def test_the_longest_recorded_context_wins_over_ledger_order(tmp_path: Path) -> None:
    # Same output after a shorter and a longer context: both recorded contexts are prefixes of the
    # request, and the longer one explains more of it (the extra user turn is in its prefix).
    ledger = BranchingCaptureLedger(tmp_path)
    nudge = {"role": "user", "content": "Use the calculator."}
    await ledger.record(_commit("short", [SYSTEM, USER], _output_items("call_1", "12 + 5 * 3")))
    await ledger.record(_commit("longer", [SYSTEM, USER, nudge], _output_items("call_1", "12 + 5 * 3")))
    request = [SYSTEM, USER, nudge, _assistant("call_1", "12 + 5 * 3"), _tool("call_1", "27")]

    resolution = await _resolve(ledger, request)
    selection = select_parent_row(ledger._read(ROLLOUT), request)

    assert (resolution.status, _parent(resolution)) == (RESOLVED, "longer")
    assert (selection.row["model_call_id"], selection.candidates) == ("longer", 2)


# --- (b) rewritten history: a branch instead of a poisoned call -------------------------------


async def _one_root(tmp_path: Path) -> BranchingCaptureLedger:
    ledger = BranchingCaptureLedger(tmp_path)
    await ledger.record(_commit("root", [SYSTEM, USER], _output_items("call_1", "12 + 5 * 3")))
    return ledger


@pytest.mark.parametrize(
    ("history", "why"),
    [
        # Tool-call arguments re-serialised with another value (a harness that rewrites them).
        ([SYSTEM, USER, _assistant("call_1", "12+5*3"), _tool("call_1", "27")], NO_FINGERPRINT_MATCH),
        # Compaction: the earlier turns replaced by a summary the model never wrote.
        ([SYSTEM, {"role": "user", "content": "Summary: you computed 12 + 5 * 3 = 27."},
          {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Go on."}], NO_FINGERPRINT_MATCH),
        # The assistant turn echoed verbatim, but the user turn before it edited.
        ([SYSTEM, {"role": "user", "content": "What is 12+5*3?"}, _assistant("call_1", "12 + 5 * 3"),
          _tool("call_1", "27")], CONTEXT_MISMATCH),
    ],
    ids=["reserialised-tool-call", "compaction", "edited-context"],
)
async def test_rewritten_history_is_a_root_branch_and_unresolved_without_the_policy(
    tmp_path: Path, history: list[dict], why: str
) -> None:
    ledger = await _one_root(tmp_path)

    ours = await _resolve(ledger, history)
    strict = await _resolve(BranchingCaptureLedger(tmp_path, branch_unresolved=False), history)
    gym = await _resolve(FileLineageStore(tmp_path), history)

    assert (ours.status, ours.match, ours.reason) == (ROOT, None, f"branch:{why}")
    assert ledger.branch_counts() == {f"branch:{why}": 1}
    assert strict == gym == LineageResolution(UNRESOLVED, reason="no_match")


async def test_requests_without_assistant_output_are_roots_as_in_gym(tmp_path: Path) -> None:
    ledger = await _one_root(tmp_path)
    await ledger.record_failure(ROLLOUT, "failed-call", UNRESOLVED_PARENT_REASON)
    ours = await _resolve(ledger, [SYSTEM, USER])
    gym = await _resolve(FileLineageStore(tmp_path), [SYSTEM, USER])
    assert ours == gym == LineageResolution(ROOT)
    assert ledger.branch_counts() == {}


async def test_failure_rows_never_resolve_as_parents(tmp_path: Path) -> None:
    ledger = BranchingCaptureLedger(tmp_path)
    await ledger.record_failure(ROLLOUT, "failed-call", UNRESOLVED_PARENT_REASON)
    continuation = [SYSTEM, USER, _assistant("call_1", "12 + 5 * 3"), _tool("call_1", "27")]
    assert (await _resolve(ledger, continuation)).status == ROOT
    assert await _failures(ledger) == [("failed-call", UNRESOLVED_PARENT_REASON)]


# --- what Gym's resolve_parent admits with each ledger ----------------------------------------


async def _admit(store: FileLineageStore, call_id: str, items: list[dict]) -> CaptureContext:
    context = CaptureContext(
        rollout_id=ROLLOUT, model_call_id=call_id, token_sink=None, lineage_store=store, external_staging=True
    )
    token = set_token_sink(context)
    try:
        await resolve_parent(items)
    finally:
        reset_token_sink(token)
    return context


async def test_resolve_parent_admits_a_text_branch_where_gym_poisons(tmp_path: Path) -> None:
    rewritten = [SYSTEM, USER, _assistant("call_1", "12+5*3"), _tool("call_1", "27")]
    ours_dir, gym_dir = tmp_path / "ours", tmp_path / "gym"
    ours = await _one_root(ours_dir)
    gym = FileLineageStore(gym_dir)
    await gym.record(_commit("root", [SYSTEM, USER], _output_items("call_1", "12 + 5 * 3")))

    branched = await _admit(ours, "branch-call", rewritten)
    poisoned = await _admit(gym, "branch-call", rewritten)

    assert branched.capture_admission.mode == "text"
    assert branched.capture_admission.parent_call_id is None
    assert await _failures(ours) == []
    assert poisoned.capture_admission is None
    assert await _failures(gym) == [("branch-call", UNRESOLVED_PARENT_REASON)]


async def test_resolve_parent_admits_token_in_on_the_first_identical_sibling(tmp_path: Path) -> None:
    ledger, continuation = await _identical_siblings(tmp_path)
    context = await _admit(ledger, "child", continuation)
    admission = context.capture_admission
    assert (admission.mode, admission.parent_call_id, admission.prev_len) == ("token_in", "ffff-first", 10)
    assert admission.staging_chain == [f"{ROLLOUT}/ffff-first"]
    assert await _failures(ledger) == []


# --- the gate process: `python -m nemo_rl.environments.gate.app` on loopback ---------------


class MemoryStagingSink:
    """StagingSink over a dict (the fake worker is one process, so nothing needs sharing)."""

    def __init__(self) -> None:
        self.records: dict[str, StagedCallRecord] = {}

    def stage(self, record: StagedCallRecord, *, attachments: Any = None) -> StageResult:
        key = staging_key(record.rollout_id, record.model_call_id)
        self.records[key] = record
        return StageResult(ok=True, staging_key=key)


def _render(messages: list[dict]) -> list[int]:
    return list(json.dumps(messages, sort_keys=True).encode())


@dataclass
class FakeWorker:
    """A chat-completions worker that stages through Gym's `RolloutTokenCapture`.

    A request ending in a tool result gets `The answer is <result>.`; any other request gets a
    calculator call whose id is a hash of the request, so an identical request gets an
    identical reply (only the unique completion id differs).
    """

    sink: MemoryStagingSink = field(default_factory=MemoryStagingSink)
    bodies: list[dict] = field(default_factory=list)
    port: int = 0

    def __post_init__(self) -> None:
        self.capture = RolloutTokenCapture(sink=self.sink, weight_version_fn=lambda: 0, adapter=VLLMCaptureAdapter())

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        messages = body["messages"]
        if messages[-1]["role"] == "tool":
            text = f"The answer is {messages[-1]['content']}."
            message: dict[str, Any] = {"role": "assistant", "content": text}
        else:
            arguments = json.dumps({"expression": "2 + 2"})
            call_id = "call_" + _hex(json.dumps(messages, sort_keys=True))[:12]
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "calculator", "arguments": arguments}}]}
            text = f"<tool_call>{arguments}</tool_call>"
        admission = CaptureAdmission.model_validate(body["ng_capture"])
        prefix = None
        prompt_ids = _render(messages)
        if admission.mode == "token_in":
            prefix = [t for key in admission.staging_chain for t in self.sink.records[key].token_ids_delta]
            last_assistant = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            prompt_ids = prefix + _render(messages[last_assistant + 1 :])
        gen_ids = list(text.encode())
        response = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "prompt_token_ids": prompt_ids,
            "choices": [{
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if "tool_calls" in message else "stop",
                "token_ids": gen_ids,
                "logprobs": {"content": [
                    {"token": f"token_id:{t}", "logprob": -0.5, "bytes": None, "top_logprobs": []} for t in gen_ids]},
            }],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(gen_ids),
                      "total_tokens": len(prompt_ids) + len(gen_ids)},
        }
        call = self.capture.begin_call(admission, prefix_token_ids=prefix)
        response["ng_commit_coords"] = self.capture.complete_call_from_response(call, response).model_dump(mode="json")
        return web.json_response(response)


async def _model_list(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "policy", "object": "model", "max_model_len": 2048}]})


async def _serve(worker: FakeWorker) -> web.AppRunner:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", worker.chat)
    # Our capture gate reads the context limit from the worker's model list before admitting calls.
    app.router.add_get("/v1/models", _model_list)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, launch.LOOPBACK, 0).start()
    worker.port = runner.addresses[0][1]
    return runner


async def _wait_healthy(proc: subprocess.Popen, url: str, log_path: Path, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"gate exited with {proc.returncode}:\n{launch.read_log_tail(log_path, 40)}")
            try:
                async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=1.0)) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass  # not listening yet
            await asyncio.sleep(0.2)
    raise AssertionError(f"gate not healthy within {deadline_s}s:\n{launch.read_log_tail(log_path, 40)}")


@pytest.mark.stand_in_worker
async def test_capture_gate_process_admits_sdk_echoes_compaction_and_identical_retries(tmp_path: Path) -> None:
    worker = FakeWorker()
    runner = await _serve(worker)
    gate_port, spare1, spare2 = launch.pick_free_ports(3)
    wiring = launch.CaptureWiring(ledger_dir=tmp_path / "ledger", control_token_env="GATE_TEST_BEARER")
    config = launch.build_global_config(
        NemoGymConfig(), worker_base_url=f"http://127.0.0.1:{worker.port}/v1",
        ports=launch.ServerPorts(gate_port, spare1, spare2), capture=wiring, resources_server=ARITH
    )
    spec = launch.server_specs(launch.ServerPorts(gate_port, spare1, spare2), wiring, resources_server=ARITH)[0]
    assert spec.module == "nemo_rl.environments.gate.app"
    env = launch.server_env(
        os.environ, config_json=json.dumps(config), spec=spec, import_root=Path(__file__).resolve().parents[4],
        extra={"GATE_TEST_BEARER": "test-bearer"},
    )
    log_path = tmp_path / "gate.log"
    proc = launch.start_server(spec, python=sys.executable, env=env, cwd=tmp_path, log_path=log_path)
    gate = f"http://127.0.0.1:{gate_port}"
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]

    def client(rollout_id: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{gate}/ng-rollout/{rollout_id}/training-token-capture/v1", api_key="dummy", max_retries=0
        )

    async def manifest(session: aiohttp.ClientSession, rollout_id: str) -> RolloutManifest:
        async with session.get(
            f"{gate}/training-token-capture/control/rollouts/{rollout_id}/manifest",
            headers={"Authorization": "Bearer test-bearer"},
        ) as resp:
            assert resp.status == 200, await resp.text()
            return RolloutManifest.model_validate(await resp.json())

    try:
        await _wait_healthy(proc, gate, log_path, deadline_s=45.0)
        # 1. The plain harness loop: append the returned message object, then the tool result.
        plain = client("plain")
        messages: list[Any] = [SYSTEM, {"role": "user", "content": "What is 2 + 2?"}]
        first = await plain.chat.completions.create(model="tiny", messages=messages, tools=tools)
        call = first.choices[0].message.tool_calls[0]
        messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "4"}]
        second = await plain.chat.completions.create(model="tiny", messages=messages, tools=tools)
        # 2. Compaction: the history replaced by a summary the model never wrote.
        compact = client("compact")
        history = [SYSTEM, {"role": "user", "content": "What is 2 + 2?"}]
        turn1 = await compact.chat.completions.create(model="tiny", messages=history, tools=tools)
        compacted = [SYSTEM, {"role": "user", "content": "Summary: a calculator call was made."},
                     {"role": "assistant", "content": "Noted, continuing."}, {"role": "user", "content": "Go on."}]
        await compact.chat.completions.create(model="tiny", messages=compacted, tools=tools)
        # 3. An identical retry, then the continuation (the model_dump() echo).
        retry = client("retry")
        tries = [await retry.chat.completions.create(model="tiny", messages=history, tools=tools) for _ in range(2)]
        kept = tries[1].choices[0].message
        continued = history + [kept.model_dump(),
                               {"role": "tool", "tool_call_id": kept.tool_calls[0].id, "content": "4"}]
        await retry.chat.completions.create(model="tiny", messages=continued, tools=tools)
        async with aiohttp.ClientSession() as session:
            manifests = {rid: await manifest(session, rid) for rid in ("plain", "compact", "retry")}
    finally:
        codes = launch.terminate_processes({"gate": proc}, timeout_s=10.0)
        await runner.cleanup()

    assert codes["gate"] is not None
    assert second.choices[0].message.content == "The answer is 4."
    assert turn1.choices[0].message.tool_calls is not None
    assert tries[0].choices[0].message.tool_calls[0].id == tries[1].choices[0].message.tool_calls[0].id
    modes = {rid: [r.mode for r in m.records] for rid, m in manifests.items()}
    assert modes == {"plain": ["text", "token_in"], "compact": ["text", "text"], "retry": ["text", "text", "token_in"]}
    assert {rid: m.failures for rid, m in manifests.items()} == {"plain": [], "compact": [], "retry": []}
    plain_root, plain_child = manifests["plain"].records
    assert plain_child.parent_call_id == plain_root.model_call_id
    retry_first, _, retry_child = manifests["retry"].records
    # The continuation was served on the first committed sibling's exact staged ids.
    assert retry_child.parent_call_id == retry_first.model_call_id
    admissions = [CaptureAdmission.model_validate(b["ng_capture"]) for b in worker.bodies]
    assert [a.mode for a in admissions] == ["text", "token_in", "text", "text", "text", "text", "token_in"]
    # What reached the worker on the echoed turns carries none of the SDK's response-only fields.
    echoed = [m for b in worker.bodies for m in b["messages"] if m["role"] == "assistant" and m.get("tool_calls")]
    assert echoed and all(set(m) <= {"role", "content", "tool_calls"} for m in echoed)


# --- rows on disk without cumulative staging chains (ledger.compact_row) ---------------------------


def _chain_of_commits(turns: int) -> list[CaptureLedgerCommit]:
    commits, request, parent = [], [SYSTEM, USER], None
    for turn in range(turns):
        call_id = f"c{turn:03d}"
        commit = _commit(call_id, list(request), _output_items(f"t{turn}", f"{turn} + 1"), parent=parent)
        commits.append(commit)
        request += [_assistant(f"t{turn}", f"{turn} + 1"), _tool(f"t{turn}", str(turn + 1))]
        parent = commit
    return commits


async def test_the_ledger_file_holds_no_cumulative_chain_and_reads_back_as_gyms_rows(tmp_path: Path) -> None:
    ours, gyms = BranchingCaptureLedger(tmp_path / "ours"), FileLineageStore(tmp_path / "gym")
    commits = _chain_of_commits(12)
    branch = _commit("b000", [SYSTEM, {"role": "user", "content": "compacted history"}], _output_items("tb", "2 + 2"))
    for store in (ours, gyms):
        for commit in [*commits, branch]:
            await store.record(commit)
        await store.record_failure(ROLLOUT, "c999", "worker_capture_failed")
    lines = (tmp_path / "ours" / f"{ROLLOUT}.lineage.jsonl").read_bytes().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [("staging_chain" in r, r.get("staging_chain_from_parent")) for r in rows] == [(False, True)] * 13 + [(False, None)]
    # Flat bytes per call: the 12th committed row is the 2nd's length plus one digit in each of
    # context_len (4 -> 24), prev_len (10 -> 110) and cum_len (20 -> 120) ...
    assert len(lines[11]) - len(lines[1]) == 3
    # ... while Gym's own row also grows by one key per turn.
    gym_lines = (tmp_path / "gym" / f"{ROLLOUT}.lineage.jsonl").read_bytes().splitlines()
    assert len(gym_lines[11]) - len(gym_lines[1]) == 3 + 10 * len(json.dumps(f"{ROLLOUT}/c000") + ",")
    # What every reader above the file sees is Gym's: the manifest (here and from a cold instance) ...
    expected = await gyms.manifest(ROLLOUT)
    assert await ours.manifest(ROLLOUT) == expected
    assert await BranchingCaptureLedger(tmp_path / "ours").manifest(ROLLOUT) == expected
    # ... and the parent a continuation resolves to, with its whole chain.
    request = list(commits[-1].request_items) + [_assistant("t11", "11 + 1"), _tool("t11", "12")]
    cold = await BranchingCaptureLedger(tmp_path / "ours").resolve(ROLLOUT, request)
    assert cold == await gyms.resolve(ROLLOUT, request)
    assert cold.match.staging_chain == commits[-1].staging_chain and len(cold.match.staging_chain) == 12


async def test_a_ledger_file_missing_a_parent_row_fails_closed_by_name(tmp_path: Path) -> None:
    from nemo_rl.environments.gate.ledger import LedgerChainError

    ledger = BranchingCaptureLedger(tmp_path)
    for commit in _chain_of_commits(3):
        await ledger.record(commit)
    path = tmp_path / f"{ROLLOUT}.lineage.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + lines[2])  # the middle row is gone
    with pytest.raises(LedgerChainError, match=rf"ledger of rollout '{ROLLOUT}': row 'c002' elides its staging_chain "
                                               r"but its parent row 'c001' is not before it"):
        await BranchingCaptureLedger(tmp_path).manifest(ROLLOUT)
