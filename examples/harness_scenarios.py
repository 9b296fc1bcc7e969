"""Drive the capture stack the way real agent harnesses do, with the official `openai` client.

Brings up the real stack (private Ray, TransferQueue, the vLLM CPU engine with the tiny local
model, Gym's capture gate on loopback) and, with no Gym agent, drives one rollout per harness
behaviour through `openai.AsyncOpenAI(base_url=<gate>/ng-rollout/<id>/training-token-capture/v1)`:

- plain            multi-call tool loop; the returned `ChatCompletionMessage` object is appended
                   to `messages` as is, then the tool result, then the next call.
- distinct_retry   one call re-sent with the same messages at temperature 1 (as after a client
                   timeout; re-sent again, at most a few times, while the replies are
                   identical); the harness continues from the last reply.
- identical_retry  the same at temperature 0 with a fixed seed: identical replies.
- compaction       two calls, then the history is replaced by system + a summary user message,
                   then two more calls.
- rerendered       every assistant turn is re-serialised by the harness (a plain dict; tool-call
                   arguments JSON re-dumped with other spacing and sorted keys; `<think>` reasoning
                   stripped from content) instead of echoing the SDK object.
- edited           the harness edits what the model said before sending it back (the first reply's
                   text reworded, `<think>` reasoning stripped), then echoes later replies as is: the
                   gate finds no captured parent although the history holds an assistant turn, and
                   opens a new text chain. A degradation the capture-health figures must show
                   (`token_in_rate` < 1, an unresolved continuation), while every row stays exact.
- failed_final     the last request overflows the model's context (`max_model_len`): the worker
                   answers 400 and the client gets an error or Gym's synthetic empty completion;
                   the scored response stays the previous one.
- subagent         a sub-agent with its own system prompt and user message runs two calls inside
                   the same rollout id, then the main conversation continues.
- streamed         `stream=True` (with `stream_options.include_usage`) through the SDK's streaming
                   iterator: one call dropped after its first content chunk (the client goes away:
                   never committed, an off-chain outcome), then a multi-call tool loop rebuilt from
                   the chunks. Prints time to first content chunk vs the full reply of its longest
                   reply (`first_chunk_s`, `last_chunk_s`, `full_response_s`): the first must come
                   strictly before the last token.
- cross_worker     (with --num-workers >= 2) every call from a fresh client, i.e. a fresh gate
                   session, which the gate may route to any worker; the continuation is re-sent
                   (each re-send a retry sibling) until a worker other than its parent's serves it.
                   Its exactness proves a worker continues a rollout from ids another worker staged.
- responses_api    the OpenAI Agents SDK's `Runner.run(max_turns=4)` with its default model
                   (`OpenAIResponsesModel`, the Responses API) and the calculator tool, run by
                   `examples/harness/agents_sdk_driver.py` in its own venv (`harness-openai-agents`);
                   the last response id it saw is the declared terminal.
- agents_sdk_chat  the same over `OpenAIChatCompletionsModel`: the SDK sees no response id, so the
                   outcome declares the scored output's text (`terminal_output_text`) as the witness.
- agents_sdk_streamed / agents_sdk_chat_streamed  `Runner.run_streamed` with each of those two
                   models (`stream=true` on /v1/responses, resp. /v1/chat/completions); the driver
                   reads every stream event and counts the text deltas (`sdk_text_deltas`).
- messages_streamed the `anthropic` client (`AsyncAnthropic(base_url=<gate>/ng-rollout/<id>/training-token-capture)`)
                   with `messages.stream(...)` (`stream: true` on /v1/messages) and the calculator tool:
                   each tool_use answered by a `tool_result` block, the `get_final_message()` content
                   echoed, until a reply without a tool call (at most 4 calls). Counts the wire events and
                   the `text_delta` / `input_json_delta` deltas, times the first and last delta of its
                   longest reply; the last message id (the ledger row's response id) is the declared terminal.

Every line also names the workers that served the rollout's committed calls (`workers`, from
each worker's own engine records) and counts `cross_worker_continuations` (token-in calls
served by another worker than their parent), and carries the rollout's capture-health figures
as the judge computed them (`judge.call_lineage`, the per-rollout terms of the finalize
metrics): `continuation_calls`, `token_in_rate` (token-in / continuation calls; 0.0 without a
continuation), `unresolved_continuations`, `branches`, and the retried replies the harness
discarded (`abandoned_retry_calls`, `abandoned_retry_tokens`: masked, outside the kept-fraction
denominator).

Each scenario ends with a Gym-`/run`-like outcome `{"reward", "response": {"id", "output": []},
"terminal_response_id"}` naming the completion the harness kept. The manifest and the engine's
own records are read first; then the group is judged through the project's path
(`RolloutManager.collect_group` with the FinalizerPool, TQStagingCleaner and the workers'
served-call report), which also runs retention. One JSON line per scenario goes to stdout
(progress to stderr); the exit code is 0 only when every scenario is kept, exact, keeps >= 99%
of the generated tokens the workers served (abandoned retries apart) and shows the capture
health its behaviour implies (`LINEAGE_EXPECTED`): no unresolved continuation and
`token_in_rate` 1.0 where the harness echoes what the model said, at least one unresolved
continuation and `token_in_rate` < 1 for `edited` (it passes when the degradation is detected
and its rows are still exact), and for `rerendered` whichever its `rerender_changed_fingerprint`
fact implies (whether Gym's canonical fingerprint absorbs the re-serialisation depends on what
the model wrote).

    uv run python examples/harness_scenarios.py [--log-dir DIR] [--only plain,compaction] [--num-workers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import openai
from openai.types.chat import ChatCompletion
from examples.arith.rows import calculator_tool_output
from examples.arith.task import CALCULATOR_TOOL, SYSTEM_PROMPT, make_problems, user_prompt
from examples.arith.tiny_model import TinyModelConfig, ensure_tiny_model
from examples.harness.agents_sdk_scenarios import AgentsSdkRunError, run_agents_sdk, sdk_outcome
from nemo_gym.token_id_capture.fingerprint import assistant_fingerprint

from nemo_rl.data.rows import KeptRollout, PlaceholderReason
from nemo_rl.algorithms.setup import start_stack
from nemo_rl.data_plane import DataPlaneConfig
from nemo_rl.data_plane.partitions import TQStagingCleaner
from nemo_rl.environments.nemo_gym_config import NemoGymConfig
from nemo_rl.experience.finalizer_pool import FinalizerPool, TQSourceFactory
from nemo_rl.experience.rollout_manager import RetentionError, RolloutManager, RolloutManagerConfig
from nemo_rl.models.generation.vllm.config import GenerationConfig
from nemo_rl.token_capture.audit import audit_train_row
from nemo_rl.token_capture.config import TokenCaptureConfig
from nemo_rl.token_capture.judge import RunFailure
from nemo_rl.token_capture.judge import TERMINAL_OUTPUT_TEXT_KEY, TERMINAL_RESPONSE_ID_KEY

MIN_FRACTION = 0.99
EDIT_PREFIX = "Let me restate my previous step. "
# What each scenario's capture health must show (see the module docstring): "clean" = no
# unresolved continuation and token_in_rate 1.0; "degraded" = >= 1 unresolved continuation and
# token_in_rate < 1 (`rerendered`: decided by its `rerender_changed_fingerprint` fact).
LINEAGE_EXPECTED = {"edited": "degraded"}
SUBAGENT_SYSTEM = "You are a checking sub-agent. Recompute the expression with the calculator and report it."
COMPACTION_SUMMARY = "Summary of the work so far: you were asked {question!r}; the calculator was used{result}. {next_q}"
_THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL)
# The calculator tool in the Anthropic Messages form (what the `anthropic` client sends).
CALCULATOR_TOOL_ANTHROPIC = {"name": CALCULATOR_TOOL["function"]["name"],
                             "description": CALCULATOR_TOOL["function"]["description"],
                             "input_schema": CALCULATOR_TOOL["function"]["parameters"]}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log-dir", type=Path, default=None, help="default: logs/harness_scenarios/<timestamp>")
    p.add_argument("--seed", type=int, default=11, help="which arithmetic problems to pose")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--call-timeout-s", type=float, default=90.0, help="openai client timeout per call")
    p.add_argument("--scenario-timeout-s", type=float, default=300.0)
    p.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    p.add_argument("--num-workers", type=int, default=1,
                   help="generation workers behind the one gate (cross_worker runs only with >= 2)")
    return p.parse_args()


# --- the harness side -------------------------------------------------------------------------
@dataclass
class CallLog:
    label: str
    response_id: str | None
    ok: bool
    detail: str = ""


@dataclass
class ScenarioRun:
    """What one scenario did: the kept completion and every call it made."""

    kept: Any = None  # the ChatCompletion the harness scored
    calls: list[CallLog] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    declared_outcome: dict[str, Any] | None = None  # a subprocess harness's own outcome (the Agents SDK)

    def outcome(self) -> dict[str, Any]:
        if self.declared_outcome is not None:
            return self.declared_outcome
        return declared_terminal(self.kept.id, self.kept.choices[0].message.content)


def declared_terminal(response_id: str, text: str | None) -> dict[str, Any]:
    """The Gym-`/run`-like outcome naming the kept call by its response id (rewarded when it says something)."""
    return {"reward": 1.0 if (text or "").strip() else 0.0, "response": {"id": response_id, "output": []},
            TERMINAL_RESPONSE_ID_KEY: response_id}


class Harness:
    """One rollout's client: the official SDK pointed at the gate's capture route for that id."""

    def __init__(self, gate_url: str, rollout_id: str, model: str, args: argparse.Namespace, run: ScenarioRun) -> None:
        self.capture_url = f"{gate_url}/ng-rollout/{rollout_id}/training-token-capture"
        self._client_kwargs = {
            "base_url": f"{self.capture_url}/v1",
            "api_key": "dummy",
            "timeout": args.call_timeout_s,
            "max_retries": 0,
        }
        self.client = openai.AsyncOpenAI(**self._client_kwargs)
        self.call_timeout_s = args.call_timeout_s
        self.base_url = self._client_kwargs["base_url"]
        self.model = model
        self.max_tokens = args.max_tokens
        self.run = run

    async def call(self, messages: list, label: str, *, temperature: float = 0.0, seed: int | None = None,
                   tools: bool = True, fresh_session: bool = False):
        kwargs: dict[str, Any] = {"model": self.model, "messages": messages, "temperature": temperature,
                                  "max_tokens": self.max_tokens}
        if tools:
            kwargs["tools"] = [CALCULATOR_TOOL]
        if seed is not None:
            kwargs["seed"] = seed
        # A fresh client carries no session cookie, so the gate assigns the call to a worker anew.
        client = openai.AsyncOpenAI(**self._client_kwargs) if fresh_session else self.client
        try:
            completion = await client.chat.completions.create(**kwargs)
        except openai.APIError as error:
            self.run.calls.append(CallLog(label, None, False, f"{type(error).__name__}: {str(error)[:300]}"))
            raise
        finally:
            if fresh_session:
                await client.close()
        message = completion.choices[0].message
        summary = f"tool_calls={len(message.tool_calls or [])} content={(message.content or '')[:60]!r}"
        self.run.calls.append(CallLog(label, completion.id, True, summary))
        log(f"[{label}] {completion.id}: {summary}")
        return completion

    async def call_streamed(self, messages: list, label: str, *, drop_after_first_chunk: bool = False):
        """A `stream=True` call through the SDK's iterator: the ChatCompletion the chunks add up to,
        with the client-side clock of its chunks (None when the client dropped the stream)."""
        kwargs: dict[str, Any] = {"model": self.model, "messages": messages, "temperature": 0.0,
                                  "max_tokens": self.max_tokens, "tools": [CALCULATOR_TOOL], "stream": True,
                                  "stream_options": {"include_usage": True}}
        started = time.perf_counter()
        clock = StreamClock()
        stream = await self.client.chat.completions.create(**kwargs)
        try:
            async for chunk in stream:
                clock.see(chunk, time.perf_counter() - started)
                if drop_after_first_chunk:
                    break  # the client goes away after the first chunk
        finally:
            await stream.close()
        if drop_after_first_chunk:
            self.run.calls.append(CallLog(label, clock.head.get("id"), False, "dropped after its first chunk"))
            log(f"[{label}] {clock.head.get('id')}: dropped after its first chunk")
            return None, clock
        completion = clock.completion()
        clock.full_s = time.perf_counter() - started
        message = completion.choices[0].message
        summary = (f"tool_calls={len(message.tool_calls or [])} content={(message.content or '')[:60]!r} "
                   f"chunks={clock.content_chunks}")
        self.run.calls.append(CallLog(label, completion.id, True, summary))
        log(f"[{label}] {completion.id}: {summary}")
        return completion, clock

    async def message_streamed(self, system: str, messages: list, label: str):
        """A `messages.stream(...)` call with the `anthropic` client (it appends `/v1/messages` to the
        rollout's capture route): the helper's `get_final_message()`, with the clock of its events."""
        clock = MessagesClock()
        started = time.perf_counter()
        async with anthropic.AsyncAnthropic(base_url=self.capture_url, api_key="dummy", timeout=self.call_timeout_s,
                                            max_retries=0) as client:
            try:
                async with client.messages.stream(model=self.model, system=system, messages=messages,
                                                  tools=[CALCULATOR_TOOL_ANTHROPIC], max_tokens=self.max_tokens,
                                                  temperature=0.0) as stream:
                    async for event in stream:
                        clock.see(event, time.perf_counter() - started)
                    final = await stream.get_final_message()
            except anthropic.APIError as error:
                self.run.calls.append(CallLog(label, None, False, f"{type(error).__name__}: {str(error)[:300]}"))
                raise
        clock.full_s = time.perf_counter() - started
        uses = [b for b in final.content if b.type == "tool_use"]
        summary = (f"tool_use={len(uses)} text={message_text(final)[:60]!r} stop={final.stop_reason} "
                   f"events={clock.events} text_deltas={clock.text_deltas} input_json_deltas={clock.input_json_deltas}")
        self.run.calls.append(CallLog(label, final.id, True, summary))
        log(f"[{label}] {final.id}: {summary}")
        return final, clock

    async def close(self) -> None:
        await self.client.close()


# The Anthropic wire events (the `messages.stream` helper adds derived `text` / `input_json` events).
MESSAGES_WIRE_EVENTS = frozenset({"message_start", "content_block_start", "content_block_delta", "content_block_stop",
                                  "message_delta", "message_stop"})


@dataclass
class MessagesClock:
    """One streamed Messages call: its wire events, its deltas by kind, when they arrived (s after the call)."""

    events: int = 0
    text_deltas: int = 0
    input_json_deltas: int = 0
    start_id: str | None = None  # the `message_start` message's id
    first_s: float | None = None
    last_s: float | None = None
    full_s: float | None = None

    def see(self, event, at_s: float) -> None:
        if event.type not in MESSAGES_WIRE_EVENTS:
            return
        self.events += 1
        if event.type == "message_start":
            self.start_id = event.message.id
        if event.type != "content_block_delta":
            return
        if event.delta.type == "text_delta":
            self.text_deltas += 1
        elif event.delta.type == "input_json_delta":
            self.input_json_deltas += 1
        self.first_s = at_s if self.first_s is None else self.first_s
        self.last_s = at_s

    @property
    def deltas(self) -> int:
        return self.text_deltas + self.input_json_deltas


def message_text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def tool_result_blocks(message) -> list[dict]:
    """The calculator's answers to the message's tool_use blocks, as the user turn's `tool_result` blocks."""
    return [{"type": "tool_result", "tool_use_id": block.id,
             "content": calculator_tool_output(str(block.input.get("expression", "")))}
            for block in message.content if block.type == "tool_use"]


@dataclass
class StreamClock:
    """What a streamed call's chunks add up to, and when its content chunks arrived (seconds after the call)."""

    content: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict] = field(default_factory=dict)
    head: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: Any = None
    content_chunks: int = 0
    first_s: float | None = None
    last_s: float | None = None
    full_s: float | None = None

    def see(self, chunk, at_s: float) -> None:
        self.head = {"id": chunk.id, "created": chunk.created, "model": chunk.model}
        if chunk.usage is not None:
            self.usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            if choice.delta.content:
                self.content.append(choice.delta.content)
                self.content_chunks += 1
                self.first_s = at_s if self.first_s is None else self.first_s
                self.last_s = at_s
            for call in choice.delta.tool_calls or []:
                slot = self.tool_calls.setdefault(call.index, {"id": None, "type": "function",
                                                               "function": {"name": "", "arguments": ""}})
                slot["id"] = call.id or slot["id"]
                if call.function is not None:
                    slot["function"]["name"] += call.function.name or ""
                    slot["function"]["arguments"] += call.function.arguments or ""
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason

    def completion(self) -> ChatCompletion:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return ChatCompletion.model_validate({
            **self.head, "object": "chat.completion", "usage": self.usage,
            "choices": [{"index": 0, "message": message, "finish_reason": self.finish_reason}],
        })


def tool_results(message) -> list[dict]:
    """The calculator's answers to the message's tool calls (the harness executes them)."""
    out = []
    for tool_call in message.tool_calls or []:
        try:
            expression = json.loads(tool_call.function.arguments).get("expression", "")
        except (json.JSONDecodeError, AttributeError):
            expression = tool_call.function.arguments
        out.append({"role": "tool", "tool_call_id": tool_call.id, "content": calculator_tool_output(str(expression))})
    return out


def next_turn(message, follow_up: str) -> list[dict]:
    """Tool results if the model called the tool, else the user's next question."""
    return tool_results(message) or [{"role": "user", "content": follow_up}]


def reply_key(completion) -> str:
    message = completion.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    return json.dumps([message.content, calls])


def rerender(message) -> dict:
    """The harness's own serialisation of an assistant turn (what many agent frameworks send back)."""
    content = _THINK_RE.sub("", message.content or "").strip() or None
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if message.tool_calls:
        calls = []
        for tool_call in message.tool_calls:
            try:
                arguments = json.dumps(json.loads(tool_call.function.arguments), sort_keys=True, indent=2,
                                       separators=(",", ":"))
            except json.JSONDecodeError:
                arguments = " " + tool_call.function.arguments + " "
            calls.append({"id": tool_call.id, "type": "function",
                          "function": {"name": tool_call.function.name, "arguments": arguments}})
        out["tool_calls"] = calls
    return out


def fingerprint_changed(message, sent: dict) -> bool:
    """Whether the turn the harness sends back has another Gym lineage fingerprint than the model's reply."""
    return assistant_fingerprint([sent]) != assistant_fingerprint([message.model_dump(exclude_none=True)])


def overflow_text(tokenizer, max_model_len: int, seed: int) -> tuple[str, int]:
    """A user message longer than the model's whole context window (measured with its tokenizer)."""
    rng = random.Random(seed)
    words: list[str] = []
    count = 0
    while count <= max_model_len + 256:
        words += ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
                  for _ in range(max_model_len // 2)]
        text = " ".join(words)
        count = len(tokenizer.encode(text, add_special_tokens=False))
    return text, count


# --- scenarios --------------------------------------------------------------------------------
@dataclass
class Context:
    problems: list
    tokenizer: Any
    max_model_len: int
    seed: int
    worker_of: Callable[[str], Awaitable[int | None]]  # which worker served a completion id


async def scenario_plain(h: Harness, ctx: Context, run: ScenarioRun) -> None:
    p, q = ctx.problems[0], ctx.problems[1]
    messages: list = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user_prompt(p)}]
    for index in range(4):
        completion = await h.call(messages, f"plain#{index}")
        run.kept = completion
        message = completion.choices[0].message
        if not message.tool_calls and index >= 1:
            break
        messages.append(message)  # the SDK's ChatCompletionMessage object itself
        messages += next_turn(message, user_prompt(q))


async def _retry(h: Harness, ctx: Context, run: ScenarioRun, name: str, temperature: float,
                 seed: int | None) -> None:
    p, q = ctx.problems[2], ctx.problems[3]
    messages: list = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user_prompt(p)}]
    first = await h.call(messages, f"{name}#0", temperature=temperature, seed=seed)
    messages.append(first.choices[0].message)
    messages += next_turn(first.choices[0].message, user_prompt(q))
    # The call the client "timed out" on, then its re-send with the very same messages.
    replies = [await h.call(messages, f"{name}#1", temperature=temperature, seed=seed)]
    replies.append(await h.call(messages, f"{name}#1-retry", temperature=temperature, seed=seed))
    while temperature > 0 and reply_key(replies[-1]) == reply_key(replies[0]) and len(replies) < 4:
        replies.append(await h.call(messages, f"{name}#1-retry{len(replies)}", temperature=temperature, seed=seed))
    run.facts["sends_of_retried_call"] = len(replies)
    run.facts["replies_identical"] = len({reply_key(r) for r in replies}) == 1
    kept = replies[-1]
    messages.append(kept.choices[0].message)
    messages += next_turn(kept.choices[0].message, user_prompt(p))
    run.kept = await h.call(messages, f"{name}#2", temperature=temperature, seed=seed)


async def scenario_distinct_retry(h: Harness, ctx: Context, run: ScenarioRun) -> None:
    await _retry(h, ctx, run, "distinct_retry", temperature=1.0, seed=None)


async def scenario_identical_retry(h: Harness, ctx: Context, run: ScenarioRun) -> None:
    await _retry(h, ctx, run, "identical_retry", temperature=0.0, seed=1234)


async def scenario_compaction(h: Harness, ctx: Context, run: ScenarioRun) -> None:
    p, q = ctx.problems[4], ctx.problems[5]
    messages: list = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user_prompt(p)}]
    first = await h.call(messages, "compaction#0")
    messages.append(first.choices[0].message)
    tools_out = tool_results(first.choices[0].message)
    messages += tools_out or [{"role": "user", "content": user_prompt(q)}]
    second = await h.call(messages, "compaction#1")
    result = f" and returned {tools_out[0]['content']}" if tools_out else ""
    summary = COMPACTION_SUMMARY.format(question=user_prompt(p), result=result, next_q=user_prompt(q))
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": summary}]
    run.facts["compacted_after_calls"] = 2
    run.facts["pre_compaction_final"] = second.id
    third = await h.call(messages, "compaction#2")
    messages.append(third.choices[0].message)
    messages += next_turn(third.choices[0].message, user_prompt(p))
    run.kept = await h.call(messages, "compaction#3")


async def scenario_rerendered(h: Harness, ctx: Context, run: ScenarioRun) -> None:
    p, q = ctx.problems[6], ctx.problems[7]
    messages: list = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user_prompt(p)}]
    first = await h.call(messages, "rerendered#0")
    original = first.choices[0].message
    rewritten = rerender(original)
    run.facts["rerender_changed_content"] = rewritten["content"] != original.content
    run.facts["rerender_changed_arguments"] = any(
        a["function"]["arguments"] != b.function.arguments
        for a, b in zip(rewritten.get("tool_calls", []), original.tool_calls or [])
    )
    changed = [fingerprint_changed(original, rewritten)]
    messages.append(rewritten)
    messages += next_turn(original, user_prompt(q))
    second = await h.call(messages, "rerendered#1")
    rewritten = rerender(second.choices[0].message)  # the harness re-serialises every assistant turn
    changed.append(fingerprint_changed(second.choices[0].message, rewritten))
    # Whether Gym's lineage fingerprint (what the gate matches) saw a different turn: then the gate
    # finds no parent and the call is an unresolved continuation.
    run.facts["rerender_changed_fingerprint"] = any(changed)
    messages.append(rewritten)
    messages += next_turn(second.choices[0].message, user_prompt(p))
    run.kept = await h.call(messages, "rerendered#2")


def edit_reply(message) -> dict:
    """The harness's edit of an assistant turn: reasoning stripped, the text reworded; tool calls kept."""
    content = _THINK_RE.sub("", message.content or "").strip()
    out: dict[str, Any] = {"role": "assistant", "content": f"{EDIT_PREFIX}{content}" if content else EDIT_PREFIX.strip()}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in message.tool_calls
        ]
    return out


async def scenario_edited(h: Harness, ctx: Context, run: ScenarioRun) -> None:
    p, q = ctx.problems[6], ctx.problems[7]
    messages: list = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user_prompt(p)}]
    first = await h.call(messages, "edited#0")
    edited = edit_reply(first.choices[0].message)
    run.facts["edited_content"] = edited["content"]
    messages.append(edited)
    messages += next_turn(first.choices[0].message, user_prompt(q))
    second = await h.call(messages, "edited#1")  # continues an edited history: no captured parent
    messages.append(second.choices[0].message)  # later replies are echoed as is
    messages += next_turn(second.choices[0].message, user_prompt(p))
    run.kept = await h.call(messages, "edited#2")


async def scenario_failed_final(h: Harness, ctx: Context, run: ScenarioRun) -> None:
    p, q = ctx.problems[8], ctx.problems[9]
    messages: list = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user_prompt(p)}]
    first = await h.call(messages, "failed_final#0")
    messages.append(first.choices[0].message)
    messages += next_turn(first.choices[0].message, user_prompt(q))
    run.kept = await h.call(messages, "failed_final#1")
    messages.append(run.kept.choices[0].message)
    text, tokens = overflow_text(ctx.tokenizer, ctx.max_model_len, ctx.seed)
    messages.append({"role": "user", "content": text + "\n" + user_prompt(q)})
    run.facts["overflow_prompt_tokens_at_least"] = tokens
    try:
        last = await h.call(messages, "failed_final#2-overflow")
    except openai.APIError as error:
        run.facts["final_failed"] = True
        run.facts["final_failure"] = f"client error {type(error).__name__} status={getattr(error, 'status_code', None)}"
        return
    message = last.choices[0].message
    if not (message.content or message.tool_calls):
        # Gym's gate turns the worker's context-length 400 into a synthetic empty completion.
        run.facts["final_failed"] = True
        run.facts["final_failure"] = f"synthetic empty completion id={last.id} finish_reason={last.choices[0].finish_reason}"
    else:
        run.facts["final_failed"] = False
        run.kept = last  # not expected: the overflow was served


async def scenario_subagent(h: Harness, ctx: Context, run: ScenarioRun) -> None:
    p, q = ctx.problems[10], ctx.problems[11]
    main: list = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user_prompt(p)}]
    first = await h.call(main, "subagent:main#0")
    main.append(first.choices[0].message)
    main += next_turn(first.choices[0].message, user_prompt(q))
    sub: list = [{"role": "system", "content": SUBAGENT_SYSTEM}, {"role": "user", "content": user_prompt(q)}]
    sub_first = await h.call(sub, "subagent:sub#0")
    sub.append(sub_first.choices[0].message)
    sub += next_turn(sub_first.choices[0].message, user_prompt(p))
    await h.call(sub, "subagent:sub#1")
    run.facts["subagent_calls"] = 2
    run.kept = await h.call(main, "subagent:main#1")


async def scenario_cross_worker(h: Harness, ctx: Context, run: ScenarioRun) -> None:
    p, q = ctx.problems[0], ctx.problems[1]
    messages: list = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user_prompt(p)}]
    first = await h.call(messages, "cross_worker#0", fresh_session=True)
    parent_worker = await ctx.worker_of(first.id)
    messages.append(first.choices[0].message)
    messages += next_turn(first.choices[0].message, user_prompt(q))
    for send in range(CROSS_WORKER_MAX_SENDS):
        reply = await h.call(messages, f"cross_worker#1-send{send}", fresh_session=True)
        worker = await ctx.worker_of(reply.id)
        if worker is not None and worker != parent_worker:
            break
    run.facts.update(parent_worker=parent_worker, continuation_worker=worker, continuation_sends=send + 1)
    run.kept = reply


async def _agents_sdk(h: Harness, ctx: Context, run: ScenarioRun, mode: str, streamed: bool = False) -> None:
    """The Agents SDK's `Runner.run` (or `run_streamed`) tool loop, in its own venv, against this rollout's route."""
    sdk = await run_agents_sdk(h.base_url, h.model, user_prompt(ctx.problems[0]), mode, max_tokens=h.max_tokens,
                               timeout_s=SDK_DRIVER_TIMEOUT_S, streamed=streamed, log=log)
    run.facts.update(sdk_mode=sdk.mode, sdk_final_output=sdk.final_output, sdk_response_ids=list(sdk.response_ids),
                     sdk_tool_calls=sdk.tool_calls, sdk_error=sdk.error, sdk_seconds=sdk.seconds,
                     sdk_streamed=sdk.streamed, sdk_stream_events=sdk.stream_events, sdk_text_deltas=sdk.text_deltas,
                     sdk_first_delta_s=sdk.first_delta_s)
    # The response ids the SDK saw (Responses API only) name its calls for `call_lineage`.
    run.calls += [CallLog(f"{mode}#{index}", rid, True) for index, rid in enumerate(sdk.response_ids) if rid]
    log(f"[agents-sdk:{mode}] {json.dumps(run.facts)}")
    if sdk.error is not None:
        raise AgentsSdkRunError(sdk.error)
    run.declared_outcome = sdk_outcome(sdk)


async def scenario_responses_api(h: Harness, ctx: Context, run: ScenarioRun) -> None:
    await _agents_sdk(h, ctx, run, "responses")  # the SDK's default model: OpenAIResponsesModel


async def scenario_agents_sdk_chat(h: Harness, ctx: Context, run: ScenarioRun) -> None:
    await _agents_sdk(h, ctx, run, "chat")  # OpenAIChatCompletionsModel: no response id, an output witness


async def scenario_agents_sdk_streamed(h: Harness, ctx: Context, run: ScenarioRun) -> None:
    await _agents_sdk(h, ctx, run, "responses", streamed=True)  # Runner.run_streamed, Responses API streaming


async def scenario_agents_sdk_chat_streamed(h: Harness, ctx: Context, run: ScenarioRun) -> None:
    await _agents_sdk(h, ctx, run, "chat", streamed=True)  # Runner.run_streamed over streamed chat completions


async def scenario_streamed(h: Harness, ctx: Context, run: ScenarioRun) -> None:
    p, q = ctx.problems[12], ctx.problems[13]
    messages: list = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user_prompt(p)}]
    _, dropped = await h.call_streamed(messages, "streamed#dropped", drop_after_first_chunk=True)
    run.facts["dropped_response_id"] = dropped.head.get("id")
    longest: StreamClock | None = None
    for index in range(4):
        completion, clock = await h.call_streamed(messages, f"streamed#{index}")
        run.kept = completion
        if longest is None or clock.content_chunks > longest.content_chunks:
            longest = clock
        message = completion.choices[0].message
        if not message.tool_calls and index >= 1:
            break
        messages.append(message)
        messages += next_turn(message, user_prompt(q))
    assert longest is not None
    run.facts.update(
        content_chunks=longest.content_chunks,
        first_chunk_s=round(longest.first_s, 4) if longest.first_s is not None else None,
        last_chunk_s=round(longest.last_s, 4) if longest.last_s is not None else None,
        full_response_s=round(longest.full_s, 4),
        usage_completion_tokens=(longest.usage or {}).get("completion_tokens"),
    )
    log(f"[streamed] longest reply: {longest.content_chunks} content chunks, first at {longest.first_s}s, "
        f"last at {longest.last_s}s, full reply at {longest.full_s:.4f}s")


async def scenario_messages_streamed(h: Harness, ctx: Context, run: ScenarioRun) -> None:
    p, q = ctx.problems[0], ctx.problems[1]
    messages: list = [{"role": "user", "content": user_prompt(p)}]
    clocks: list[MessagesClock] = []
    finals = []
    for index in range(4):
        final, clock = await h.message_streamed(SYSTEM_PROMPT, messages, f"messages_streamed#{index}")
        finals.append(final)
        clocks.append(clock)
        results = tool_result_blocks(final)
        if not results and index >= 1:
            break
        messages.append({"role": "assistant", "content": final.content})  # the helper's content blocks as is
        messages.append({"role": "user", "content": results or user_prompt(q)})
    longest = max(clocks, key=lambda c: c.deltas)
    run.facts.update(
        message_ids=[f.id for f in finals],
        message_start_ids=[c.start_id for c in clocks],
        stop_reasons=[f.stop_reason for f in finals],
        tool_uses=sum(1 for f in finals for b in f.content if b.type == "tool_use"),
        stream_events=sum(c.events for c in clocks),
        text_deltas=sum(c.text_deltas for c in clocks),
        input_json_deltas=sum(c.input_json_deltas for c in clocks),
        first_delta_s=round(longest.first_s, 4) if longest.first_s is not None else None,
        last_delta_s=round(longest.last_s, 4) if longest.last_s is not None else None,
        full_message_s=round(longest.full_s, 4),
        final_text=message_text(finals[-1]),
    )
    log(f"[messages_streamed] longest reply: {longest.deltas} deltas, first at {longest.first_s}s, "
        f"last at {longest.last_s}s, full message at {longest.full_s:.4f}s")
    run.declared_outcome = declared_terminal(finals[-1].id, message_text(finals[-1]))


SCENARIOS: dict[str, Callable[[Harness, Context, ScenarioRun], Awaitable[None]]] = {
    "plain": scenario_plain,
    "distinct_retry": scenario_distinct_retry,
    "identical_retry": scenario_identical_retry,
    "compaction": scenario_compaction,
    "rerendered": scenario_rerendered,
    "edited": scenario_edited,
    "failed_final": scenario_failed_final,
    "subagent": scenario_subagent,
    "streamed": scenario_streamed,
    "cross_worker": scenario_cross_worker,
    "responses_api": scenario_responses_api,
    "agents_sdk_chat": scenario_agents_sdk_chat,
    "agents_sdk_streamed": scenario_agents_sdk_streamed,
    "agents_sdk_chat_streamed": scenario_agents_sdk_chat_streamed,
    "messages_streamed": scenario_messages_streamed,
}
SDK_DRIVER_TIMEOUT_S = 240.0
# Scenarios whose client drops a call mid-stream: that call's served tokens are off-chain (never
# committed, `client_disconnected` or, if the reply finished first, staged-not-committed) and are
# left out of the kept-fraction denominator, as abandoned retries are.
DROPPING_SCENARIOS = {"streamed"}
OFF_CHAIN_YIELD_REASONS = ("served_not_staged", "staged_not_committed")
MULTI_WORKER_SCENARIOS = {"cross_worker"}
CROSS_WORKER_MAX_SENDS = 8  # the gate hashes fresh sessions over the workers: 2 workers miss 8 times with p = 1/256


# --- the trainer side -------------------------------------------------------------------------
def call_lineage(run: ScenarioRun, records: list) -> list[str]:
    """Per client call, in call order: how the ledger committed it (`text`, or `token_in<k>` for a
    continuation of client call k), `uncommitted` when no record names its response, `error`."""
    by_response = {r.response_id: r for r in records if r.response_id}
    call_index = {}
    for index, call in enumerate(run.calls):
        record = by_response.get(call.response_id)
        if record is not None:
            call_index[record.model_call_id] = index
    out = []
    for call in run.calls:
        record = by_response.get(call.response_id)
        if not call.ok:
            out.append("error")
        elif record is None:
            out.append("uncommitted")
        elif record.mode == "token_in":
            out.append(f"token_in<{call_index.get(record.parent_call_id, '?')}")
        else:
            out.append(record.mode)
    return out


def worker_facts(records: list, served_by: dict[str, int]) -> dict[str, Any]:
    """Which workers served the committed calls, and how many continuations crossed workers."""
    worker_of_call = {r.model_call_id: served_by.get(r.response_id) for r in records}
    crossed = sum(
        1 for r in records
        if r.mode == "token_in" and worker_of_call.get(r.parent_call_id) is not None
        and worker_of_call[r.model_call_id] is not None and worker_of_call[r.parent_call_id] != worker_of_call[r.model_call_id]
    )
    return {"workers": sorted({w for w in worker_of_call.values() if w is not None}), "cross_worker_continuations": crossed}


def summarize(name: str, rollout_id: str, run: ScenarioRun, outcome, entry, manifest, manifest_problem: str | None,
              engine: dict, served_by: dict[str, int]) -> dict[str, Any]:
    records = list(manifest.records) if manifest is not None else []
    line: dict[str, Any] = {
        "scenario": name,
        "rollout_id": rollout_id,
        "kept": isinstance(entry, KeptRollout),
        "rows": len(entry.rows) if isinstance(entry, KeptRollout) else 0,
        "kept_generated_token_fraction": None,
        "exact": False,
        "reason": None,
        "calls": len(run.calls),
        "chains": None,
        "manifest_records": len(records),
        "manifest_failures": sorted({f.reason for f in manifest.failures}) if manifest is not None else None,
        "token_in_records": sum(1 for r in records if r.mode == "token_in"),
        "text_root_records": sum(1 for r in records if r.mode != "token_in"),
        "terminal_selection": entry.terminal_selection,
        "declared_terminal": outcome.get(TERMINAL_RESPONSE_ID_KEY) if isinstance(outcome, dict) else None,
        "declared_output_witness": outcome.get(TERMINAL_OUTPUT_TEXT_KEY) if isinstance(outcome, dict) else None,
        "engine_records_found": sum(1 for r in records if r.response_id in engine),
        "client_calls": [f"{c.label}:{'ok' if c.ok else 'error'}" for c in run.calls],
        **run.facts,
    }
    line["call_lineage"] = call_lineage(run, records)
    if "dropped_response_id" in run.facts:
        line["dropped_call_committed"] = any(r.response_id == run.facts["dropped_response_id"] for r in records)
    line.update(worker_facts(records, served_by))
    if manifest_problem:
        line["manifest_problem"] = manifest_problem
    if isinstance(outcome, RunFailure):
        line["run_failure"] = f"{outcome.reason.value}: {outcome.detail}"
    y = entry.yield_
    if y is not None:
        line["chains"] = y.chains
        line["served_generated_tokens"] = y.served_generated_tokens
        line["kept_generated_tokens"] = y.kept_generated_tokens
        line["unverifiable"] = [list(u) for u in y.unverifiable]
        line["abandoned_retry_calls"] = y.abandoned_retry_calls
        line["abandoned_retry_tokens"] = y.abandoned_retry_tokens
        trainable = (y.served_generated_tokens or 0) - y.abandoned_retry_tokens
        if name in DROPPING_SCENARIOS:
            dropped = sum(n for reason, n in y.unverifiable if reason in OFF_CHAIN_YIELD_REASONS)
            line["dropped_call_tokens"] = dropped
            trainable -= dropped
        if trainable > 0:
            line["kept_generated_token_fraction"] = round(y.kept_generated_tokens / trainable, 6)
        if y.lineage is not None:
            line["continuation_calls"] = y.lineage.continuation_calls
            line["unresolved_continuations"] = y.lineage.unresolved_continuations
            line["branches"] = y.lineage.branches
            continuations = y.lineage.continuation_calls
            line["token_in_rate"] = round(y.lineage.token_in_calls / continuations, 6) if continuations else 0.0
    if isinstance(entry, KeptRollout):
        audits = [audit_train_row(row, records, engine) for row in entry.rows]
        problems = [
            f"row {index} call {call.model_call_id}: prompt={call.prompt_match} ids={call.ids_match} "
            f"logprob_diff={call.max_abs_logprob_diff}"
            for index, audit in enumerate(audits) for call in audit.calls
            if not (call.prompt_match and call.ids_match and call.max_abs_logprob_diff == 0.0)
        ]
        line["exact"] = entry.num_generated_tokens > 0 and not problems
        line["loss_tokens"] = entry.num_generated_tokens
        line["row_calls"] = [len(row.model_call_ids) for row in entry.rows]
        line["row_call_modes"] = [f"{row.token_in_calls} token_in + {row.text_root_calls} text" for row in entry.rows]
        if problems:
            line["exact_problems"] = problems[:6]
    else:
        line["reason"] = f"{entry.reason.value}: {entry.detail}"
    return line


def lineage_as_expected(line: dict[str, Any]) -> bool:
    """Whether the rollout's capture health is what its scenario implies (`LINEAGE_EXPECTED`)."""
    expected = LINEAGE_EXPECTED.get(line["scenario"], "clean")
    if line["scenario"] == "rerendered":
        expected = "degraded" if line.get("rerender_changed_fingerprint") else "clean"
    unresolved, rate = line.get("unresolved_continuations"), line.get("token_in_rate")
    if unresolved is None:
        return False  # no served report or manifest: the figures were not measured
    if expected == "degraded":
        return unresolved >= 1 and rate < 1.0
    return unresolved == 0 and (rate == 1.0 or line["continuation_calls"] == 0)


def streamed_as_expected(line: dict[str, Any]) -> bool:
    """A streamed rollout: content in several chunks, the first strictly before the last token, and
    the dropped call never committed, with a typed outcome: the worker's `client_disconnected`
    served call, or (when the reply finished first) Gym's off-chain failure row."""
    if line["scenario"] not in DROPPING_SCENARIOS:
        return True
    first, last = line.get("first_chunk_s"), line.get("last_chunk_s")
    typed = (line.get("worker_client_disconnected", 0) >= 1
             or "request_finished_without_staged_coordinates" in (line.get("manifest_failures") or []))
    return bool(line.get("content_chunks", 0) >= 2 and first is not None and last is not None and first < last
                and line.get("dropped_call_committed") is False and typed)


def messages_as_expected(line: dict[str, Any]) -> bool:
    """A streamed Messages rollout: >= 2 deltas, the first strictly before the last, every final message id
    the streamed one, and the declared terminal the last of them."""
    if line["scenario"] != "messages_streamed":
        return True
    first, last, ids = line.get("first_delta_s"), line.get("last_delta_s"), line.get("message_ids") or []
    return bool(line.get("text_deltas", 0) + line.get("input_json_deltas", 0) >= 2 and first is not None
                and last is not None and first < last and ids and ids == line.get("message_start_ids")
                and line["declared_terminal"] == ids[-1])


def passed(line: dict[str, Any]) -> bool:
    fraction = line.get("kept_generated_token_fraction")
    return bool(line["kept"] and line["exact"] and fraction is not None and fraction >= MIN_FRACTION
                and lineage_as_expected(line) and streamed_as_expected(line) and messages_as_expected(line))


def _rows_kept_whole() -> Callable[[Sequence[KeptRollout]], list[KeptRollout]]:
    return list


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    names = [n for n in args.only.split(",") if n] or [
        n for n in SCENARIOS if args.num_workers >= 2 or n not in MULTI_WORKER_SCENARIOS]
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; known: {sorted(SCENARIOS)}")
    log_dir = args.log_dir or Path("logs/harness_scenarios") / time.strftime("%Y%m%d-%H%M%S")
    model_dir = ensure_tiny_model(TinyModelConfig(), progress=log)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    capture = TokenCaptureConfig(enabled=True)  # retire_after_commit=True: collect_group runs retention
    dp_cfg = DataPlaneConfig()
    generation = GenerationConfig(num_workers=args.num_workers)
    gym_cfg = NemoGymConfig()
    stack = await start_stack(model_dir=model_dir, log_dir=log_dir, generation=generation, token_capture=capture,
                              data_plane=dp_cfg, nemo_gym=gym_cfg, num_cpus=2, progress=log)
    pool: FinalizerPool | None = None
    try:
        assert stack.env is not None and stack.workers is not None and stack.client is not None
        # The audit reads every row's tokens here, so the pool hands kept rows back whole (`list`
        # as its row store) instead of writing them to the train partition as a training run does.
        pool = FinalizerPool.from_config(capture, TQSourceFactory.from_config(dp_cfg, capture), _rows_kept_whole)
        await pool.wait_ready(dp_cfg.startup_timeout_s)
        cleaner = TQStagingCleaner(stack.client, capture.staging_partition, capture.stage_timeout_s)
        manager = RolloutManager(
            RolloutManagerConfig(run_id=f"harness-{uuid.uuid4().hex[:8]}", run_timeout_s=args.scenario_timeout_s,
                                 capture=capture),
            stack.env, finalizer=pool, cleaner=cleaner, served=stack.workers.served,
        )
        rollout_ids = manager.reserve(1, 0, len(names))
        workers = stack.workers

        async def worker_of(response_id: str) -> int | None:
            parts = await asyncio.to_thread(workers.engine_records_by_worker, [response_id])
            owners = [index for index, part in enumerate(parts) if response_id in part]
            return owners[0] if len(owners) == 1 else None

        ctx = Context(make_problems(args.seed, 14), tokenizer, generation.vllm.max_model_len, args.seed, worker_of)
        runs: list[ScenarioRun] = []
        outcomes: list[dict[str, Any] | RunFailure] = []
        for name, rollout_id in zip(names, rollout_ids):
            log(f"[scenario] {name} -> rollout {rollout_id}")
            run = ScenarioRun()
            harness = Harness(stack.env.servers.gate_url, rollout_id, generation.model_name, args, run)
            started = time.perf_counter()
            try:
                await asyncio.wait_for(SCENARIOS[name](harness, ctx, run), args.scenario_timeout_s)
                done = run.kept is not None or run.declared_outcome is not None
                outcome: dict[str, Any] | RunFailure = run.outcome() if done else RunFailure(
                    PlaceholderReason.RUN_FAILED, "the harness kept no completion")
            except asyncio.TimeoutError:
                outcome = RunFailure(PlaceholderReason.RUN_TIMEOUT, f"scenario exceeded {args.scenario_timeout_s}s")
            except Exception as error:  # the scenario's verdict, reported, never fatal to the others
                outcome = RunFailure(PlaceholderReason.RUN_FAILED, f"{type(error).__name__}: {str(error)[:500]}")
            finally:
                await harness.close()
                run.facts["scenario_s"] = round(time.perf_counter() - started, 2)  # the harness side, judging apart
            runs.append(run)
            outcomes.append(outcome)
        # Streamed calls the workers saw their client drop (typed: served, not staged, `client_disconnected`).
        stats = await asyncio.to_thread(stack.workers.capture_stats)
        disconnected = sum(int(s.get("calls", {}).get("client_disconnected", 0)) for s in stats)
        for name, run in zip(names, runs):
            if name in DROPPING_SCENARIOS:
                run.facts["worker_client_disconnected"] = disconnected
        # Read the ledger and the engine's own records before collect_group retires the ledger
        # and clears the staged keys.
        manifests: list = []
        problems: list[str | None] = []
        for rollout_id in rollout_ids:
            try:
                manifests.append(await asyncio.wait_for(stack.env.manifest(rollout_id), capture.manifest_timeout_s))
                problems.append(None)
            except Exception as error:
                manifests.append(None)
                problems.append(f"{type(error).__name__}: {error}")
        response_ids = [r.response_id for m in manifests if m is not None for r in m.records if r.response_id]
        by_worker = await asyncio.to_thread(stack.workers.engine_records_by_worker, response_ids)
        engine = {rid: record for part in by_worker for rid, record in part.items()}
        served_by = {rid: index for index, part in enumerate(by_worker) for rid in part}
        log(f"[collect] judging {len(rollout_ids)} rollouts ({len(response_ids)} committed calls)")
        retention_error = None
        try:
            group = await asyncio.wait_for(manager.collect_group(0, rollout_ids, outcomes),
                                           capture.finalize_timeout_s + capture.manifest_timeout_s + 120.0)
        except RetentionError as error:
            group, retention_error = error.group, str(error)
        lines = []
        for name, rollout_id, run, outcome, entry, manifest, problem in zip(
            names, rollout_ids, runs, outcomes, group.entries, manifests, problems
        ):
            line = summarize(name, rollout_id, run, outcome, entry, manifest, problem, engine, served_by)
            if retention_error:
                line["retention_error"] = retention_error
            lines.append(line)
        return lines
    finally:
        if pool is not None:
            pool.shutdown()
        await stack.aclose()


if __name__ == "__main__":
    results = asyncio.run(main(parse_args()))
    for result in results:
        print(json.dumps(result, sort_keys=True), flush=True)
    failed = [r["scenario"] for r in results if not passed(r)]
    log(f"[done] {len(results) - len(failed)}/{len(results)} scenarios kept, exact, >= {MIN_FRACTION} kept and with "
        f"the expected capture health; failed: {failed}")
    sys.exit(0 if not failed and results else 1)
