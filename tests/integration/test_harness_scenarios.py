"""External harness behaviours against the real stack, driven with the official `openai` client.

Runs `examples/harness_scenarios.py --num-workers 2` (real components only: private Ray,
TransferQueue, two vLLM CPU engines behind our one capture gate on loopback) and checks each
scenario's verdict: kept, exact against the engine's own records, and nearly every served
generated token kept (retried replies the harness discarded are masked and outside that
fraction), plus the shape each behaviour guarantees (a `streamed` tool loop through the SDK's
streaming iterator: one exact chain, the first chunk before the last, a call dropped mid-stream
never committed), the capture health each behaviour implies
(`token_in_rate`, `unresolved_continuations`: an `edited` history must show the miss, an echoed
one must not), and that a continuation served by another worker than its parent is exact.
The OpenAI Agents SDK runs from its own spec-hashed venv (`responses_api`: its default
Responses-API model; `agents_sdk_chat`: chat completions, judged by its output witness;
`agents_sdk_streamed` / `agents_sdk_chat_streamed`: the same two through `Runner.run_streamed`).
`messages_streamed`: the `anthropic` client's `messages.stream(...)` tool loop on `/v1/messages`, its
deltas streamed, judged by the last message id it declares.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_rl.utils import venvs

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = (
    "plain", "distinct_retry", "identical_retry", "compaction", "rerendered", "edited", "failed_final", "subagent",
    "streamed", "cross_worker", "responses_api", "agents_sdk_chat", "agents_sdk_streamed", "agents_sdk_chat_streamed",
    "messages_streamed",
)
SDK_RESPONSES = ("responses_api", "agents_sdk_streamed")  # the Agents SDK's default model (Responses API)
SDK_CHAT = ("agents_sdk_chat", "agents_sdk_chat_streamed")  # OpenAIChatCompletionsModel: no response id
# Scenarios whose harness echoes every assistant turn as the model wrote it: no continuation may miss its parent.
ECHOED = ("plain", "distinct_retry", "identical_retry", "compaction", "failed_final", "subagent", "streamed",
          "cross_worker", *SDK_RESPONSES, *SDK_CHAT, "messages_streamed")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    log_dir = tmp_path_factory.mktemp("harness") / "logs"
    proc = subprocess.run(
        [sys.executable, "examples/harness_scenarios.py", "--log-dir", str(log_dir), "--num-workers", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    by_name = {line["scenario"]: line for line in lines}
    assert set(by_name) == set(SCENARIOS), (
        f"exit {proc.returncode}; scenarios reported: {sorted(by_name)}\nstdout:\n{proc.stdout[-4000:]}\n"
        f"stderr:\n{proc.stderr[-6000:]}"
    )
    by_name["_returncode"] = {"code": proc.returncode}
    return by_name


@pytest.mark.integration
@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_is_kept_exact_and_keeps_its_tokens(results, name):
    line = results[name]
    assert line["kept"] is True, line
    assert line["exact"] is True, line
    assert line["kept_generated_token_fraction"] >= 0.99, line
    assert line["reason"] is None, line
    assert line["rows"] >= 1 and line["chains"] >= 1, line
    assert line["engine_records_found"] == line["manifest_records"], line
    if name in SDK_CHAT:  # no response id: the scored text is the declared witness
        assert line["declared_output_witness"] == line["sdk_final_output"], line
        assert line["terminal_selection"] == "content", line
    else:
        assert line["declared_terminal"] is not None and line["terminal_selection"] == "declared", line


@pytest.mark.integration
def test_example_exit_code_reflects_all_scenarios(results):
    assert results["_returncode"]["code"] == 0, {k: v for k, v in results.items() if k != "_returncode"}


@pytest.mark.integration
def test_plain_tool_loop_is_one_token_in_chain(results):
    line = results["plain"]
    assert line["calls"] >= 2
    assert line["rows"] == 1 and line["chains"] == 1
    assert line["manifest_records"] == line["calls"]
    assert line["token_in_records"] == line["calls"] - 1
    assert line["call_lineage"] == ["text"] + [f"token_in<{i}" for i in range(line["calls"] - 1)]
    assert line["manifest_failures"] == []


@pytest.mark.integration
@pytest.mark.parametrize("name", ECHOED)
def test_an_echoed_history_resolves_every_continuation(results, name):
    line = results[name]
    assert line["unresolved_continuations"] == 0, line
    assert line["continuation_calls"] >= 1 and line["token_in_rate"] == 1.0, line


@pytest.mark.integration
def test_plain_capture_health_is_one_chain_without_a_miss(results):
    line = results["plain"]
    assert (line["token_in_rate"], line["unresolved_continuations"], line["branches"]) == (1.0, 0, 0), line
    assert line["continuation_calls"] == line["calls"] - 1, line


@pytest.mark.integration
def test_an_edited_history_shows_the_unresolved_continuation_and_stays_exact(results):
    line = results["edited"]
    # edited#1 continues an edited reply: the gate found no parent and opened a text root; edited#2
    # continues edited#1 as the model wrote it and resolves.
    assert line["calls"] == 3 and line["manifest_records"] == 3, line
    assert line["call_lineage"] == ["text", "text", "token_in<1"], line
    assert line["unresolved_continuations"] == 1 and line["continuation_calls"] == 2, line
    assert line["token_in_rate"] == 0.5 and line["branches"] == 1, line
    assert line["kept"] is True and line["exact"] is True and line["rows"] == 2, line


@pytest.mark.integration
def test_a_rerendered_history_misses_a_parent_exactly_when_the_fingerprint_changed(results):
    line = results["rerendered"]
    assert (line["unresolved_continuations"] >= 1) == line["rerender_changed_fingerprint"], line
    assert (line["token_in_rate"] < 1.0) == line["rerender_changed_fingerprint"], line


@pytest.mark.integration
@pytest.mark.parametrize("name", ["compaction", "subagent"])
def test_a_history_rewrite_is_a_branch_not_a_miss(results, name):
    line = results[name]
    assert line["branches"] == 1 and line["unresolved_continuations"] == 0, line


@pytest.mark.integration
@pytest.mark.parametrize("name", ["distinct_retry", "identical_retry"])
def test_a_discarded_retry_is_masked_as_an_abandoned_sibling(results, name):
    line = results[name]
    assert line["sends_of_retried_call"] >= 2
    # The retried call and its re-send are siblings; the harness continued one of them, the other
    # reply did not lead to the reward: it is masked (abandoned_retry), in no row, and outside the
    # kept fraction, which stays >= 0.99.
    assert line["abandoned_retry_calls"] == line["sends_of_retried_call"] - 1, line
    assert line["abandoned_retry_tokens"] >= 1, line
    assert line["chains"] >= 2 and line["rows"] == 1, line
    assert line["kept_generated_token_fraction"] >= 0.99, line
    assert line["unverifiable"] == [], line
    assert line["manifest_records"] == line["calls"]
    assert line["manifest_failures"] == []


@pytest.mark.integration
def test_identical_retry_continues_the_first_committed_sibling(results):
    line = results["identical_retry"]
    assert line["replies_identical"] is True
    # The harness continued from the re-send (call 2); the gate resolves identical siblings to
    # the first committed one (call 1), whose staged ids are the same tokens.
    assert line["call_lineage"] == ["text", "token_in<0", "token_in<0", "token_in<1"]


@pytest.mark.integration
def test_compaction_starts_a_new_chain(results):
    line = results["compaction"]
    assert line["calls"] == 4
    assert line["chains"] >= 2 and line["rows"] >= 2
    assert line["text_root_records"] >= 2
    assert line["call_lineage"][2] == "text"  # the summary is a new conversation


@pytest.mark.integration
def test_rerendered_turn_is_trained_exactly(results):
    line = results["rerendered"]
    assert line["calls"] == 3
    assert line["manifest_records"] == 3
    assert "error" not in line["call_lineage"] and "uncommitted" not in line["call_lineage"]


@pytest.mark.integration
def test_failed_final_call_keeps_the_previous_response(results):
    line = results["failed_final"]
    assert line["final_failed"] is True
    assert line["calls"] == 3
    # The overflowing call was never generated: only the two served calls are committed.
    assert line["manifest_records"] == 2
    assert line["rows"] == 1
    # The client saw an error, or Gym's synthetic empty completion: either way nothing committed.
    assert line["call_lineage"][:2] == ["text", "token_in<0"]
    assert line["call_lineage"][2] in ("uncommitted", "error")


@pytest.mark.integration
def test_subagent_conversation_is_its_own_chain(results):
    line = results["subagent"]
    assert line["calls"] == 4
    assert line["chains"] >= 2 and line["rows"] >= 2
    assert line["text_root_records"] >= 2
    assert line["call_lineage"] == ["text", "text", "token_in<1", "token_in<0"]


@pytest.mark.integration
def test_a_continuation_served_by_another_worker_is_exact(results):
    line = results["cross_worker"]
    # Parent and continuation were served by different workers (each worker's own engine records
    # say which); the continuation's prefix came from TransferQueue, and the row is exact.
    assert line["parent_worker"] != line["continuation_worker"], line
    assert line["workers"] == [0, 1], line
    assert line["cross_worker_continuations"] >= 1, line
    assert line["kept"] is True and line["exact"] is True, line
    # Every send before the one another worker served is a retry sibling the harness discarded.
    assert line["abandoned_retry_calls"] == line["continuation_sends"] - 1, line


@pytest.mark.integration
def test_the_agents_sdk_runs_in_its_own_spec_hashed_venv(results):
    spec = venvs.harness_spec("openai-agents")
    folder = venvs.venvs_root() / venvs.venv_folder_name(spec.name, venvs.spec_hash(spec))
    assert venvs.is_complete(folder, venvs.spec_hash(spec)), folder
    assert [results[name]["sdk_error"] for name in (*SDK_RESPONSES, *SDK_CHAT)] == [None] * 4


@pytest.mark.integration
@pytest.mark.parametrize("name", SDK_RESPONSES)
def test_the_agents_sdk_default_runner_tool_loop_is_kept_exact_and_declared(results, name):
    line = results[name]
    ids = line["sdk_response_ids"]
    # Every Responses call the SDK made (its default OpenAIResponsesModel) was committed and continues
    # its parent token-in; the last response id it saw is the declared terminal.
    assert line["sdk_tool_calls"] >= 1 and len(ids) >= 2 and all(ids), line
    assert line["manifest_records"] == len(ids) and line["manifest_failures"] == [], line
    assert line["call_lineage"] == ["text"] + [f"token_in<{i}" for i in range(len(ids) - 1)], line
    assert line["declared_terminal"] == ids[-1] and line["terminal_selection"] == "declared", line
    assert line["kept"] is True and line["exact"] is True and line["rows"] == 1, line


@pytest.mark.integration
@pytest.mark.parametrize("name", SDK_CHAT)
def test_the_agents_sdk_over_chat_completions_is_judged_by_its_output_witness_not_the_heuristic(results, name):
    line = results[name]
    ids = line["sdk_response_ids"]
    assert len(ids) >= 2 and all(rid is None for rid in ids), line  # the SDK reports no response id
    assert line["declared_terminal"] is None and line["declared_output_witness"] == line["sdk_final_output"], line
    assert line["terminal_selection"] == "content", line
    assert line["manifest_records"] == len(ids) and line["token_in_records"] == len(ids) - 1, line
    assert line["kept"] is True and line["exact"] is True and line["rows"] == 1, line


@pytest.mark.integration
@pytest.mark.parametrize("name", ("agents_sdk_streamed", "agents_sdk_chat_streamed"))
def test_the_agents_sdks_run_streamed_reads_text_deltas_as_they_come(results, name):
    line = results[name]
    assert line["sdk_streamed"] is True and line["sdk_stream_events"] > line["sdk_text_deltas"] >= 2, line
    assert line["sdk_first_delta_s"] is not None and line["sdk_first_delta_s"] < line["sdk_seconds"], line


@pytest.mark.integration
def test_a_streamed_tool_loop_is_one_exact_chain_and_its_first_chunk_comes_before_its_last(results):
    line = results["streamed"]
    # streamed#dropped was cut after its first chunk; streamed#0.. is the tool loop rebuilt from chunks.
    assert line["client_calls"][0] == "streamed#dropped:error" and len(line["client_calls"]) >= 3, line
    assert line["call_lineage"][1:] == ["text"] + [f"token_in<{i}" for i in range(1, len(line["call_lineage"]) - 1)], line
    assert line["rows"] == 1 and line["chains"] == 1, line
    assert line["content_chunks"] >= 2 and line["first_chunk_s"] < line["last_chunk_s"] <= line["full_response_s"], line
    assert line["usage_completion_tokens"] >= line["content_chunks"], line


@pytest.mark.integration
def test_a_call_dropped_mid_stream_is_never_committed_and_stays_off_chain(results):
    line = results["streamed"]
    assert line["dropped_call_committed"] is False, line
    # Typed: the worker aborted it (`client_disconnected`), or it finished first and Gym's ledger
    # names it uncommitted; in both cases no record, so no chain holds it.
    assert line["worker_client_disconnected"] == 1 or (
        "request_finished_without_staged_coordinates" in line["manifest_failures"]), line
    assert line["manifest_records"] == line["calls"] - 1, line
    # Its served tokens are off-chain (client_disconnected, or staged-not-committed if it finished first).
    assert line["served_generated_tokens"] == line["kept_generated_tokens"] + line["dropped_call_tokens"], line


@pytest.mark.integration
def test_a_streamed_anthropic_messages_tool_loop_is_one_exact_chain_judged_by_its_declared_message_id(results):
    line = results["messages_streamed"]
    ids = line["message_ids"]
    # Every `messages.stream(...)` call was committed under the id its `message_start` carried, and each
    # continues its parent token-in (the echoed content blocks, the tool_result); the last id is the terminal.
    assert len(ids) >= 2 and ids == line["message_start_ids"] and len(set(ids)) == len(ids), line
    # A tool loop: a tool_use block (its input streamed as input_json_delta) answered by a tool_result.
    assert line["tool_uses"] >= 1 and line["input_json_deltas"] >= line["tool_uses"], line
    assert line["stop_reasons"][0] == "tool_use", line
    assert line["manifest_records"] == line["calls"] == len(ids) and line["manifest_failures"] == [], line
    assert line["call_lineage"] == ["text"] + [f"token_in<{i}" for i in range(len(ids) - 1)], line
    assert line["declared_terminal"] == ids[-1] and line["terminal_selection"] == "declared", line
    assert line["kept"] is True and line["exact"] is True and line["rows"] == 1 and line["chains"] == 1, line
    assert line["stop_reasons"][-1] == "end_turn" and line["final_text"], line


@pytest.mark.integration
def test_a_streamed_anthropic_message_arrives_delta_by_delta(results):
    line = results["messages_streamed"]
    assert line["text_deltas"] >= 2, line
    # Around its deltas each message has at least message_start, one block's start and stop, message_delta, message_stop.
    deltas = line["text_deltas"] + line["input_json_deltas"]
    assert line["stream_events"] >= deltas + 5 * len(line["message_ids"]), line
    assert line["first_delta_s"] < line["last_delta_s"] <= line["full_message_s"], line
