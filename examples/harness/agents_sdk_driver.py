"""One OpenAI Agents SDK rollout against a capture route: run in the `harness-openai-agents` venv.

The Agents SDK needs `openai>=3` while the project (through nemo-gym) pins `openai` 2.x, so this
script runs in a venv of its own (`nemo_rl.utils.venvs.harness_spec("openai-agents")`) as a
subprocess. It imports only the SDK and the arithmetic task's stdlib-only `examples.arith.task`
(run it with the repository root on `PYTHONPATH`).

It points the SDK's `OpenAIProvider` at `--base-url` (a gate's
`<gate>/ng-rollout/<id>/training-token-capture/v1`) and runs
`Runner.run(agent, prompt, max_turns=--max-turns)` with the task's `calculator` function tool:
`--mode responses` uses the SDK's default model (`OpenAIResponsesModel`, the Responses API),
`--mode chat` uses `OpenAIChatCompletionsModel`; `--streamed` runs `Runner.run_streamed` instead and
reads every event of `stream_events()`. Tracing is off (it would export to a remote host).

It prints one JSON line to stdout: `mode`, `streamed`, `final_output` (the scored text),
`response_ids` (what `raw_responses[i].response_id` held: None on chat completions, whose streamed
placeholder id is reported as None too), `tool_calls`, for a streamed run `stream_events`,
`text_deltas` and `first_delta_s`, and, when the run raised, `error`. Exit code 0 only when the run finished. `--log-requests FILE` writes every
request body the SDK sent (a JSON list) for inspection.

    python examples/harness/agents_sdk_driver.py --base-url URL --model NAME --prompt "What is 2+3?"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx2
from agents import Agent, FunctionTool, ModelSettings, RunConfig, Runner, set_tracing_disabled
from agents.models.fake_id import FAKE_RESPONSES_ID
from agents.models.openai_provider import OpenAIProvider
from openai import AsyncOpenAI

from examples.arith.task import CALCULATOR_TOOL, SYSTEM_PROMPT, CalculatorError, calculate

TOOL_ERROR_PREFIX = "error: "  # the same text examples.arith.rows.calculator_tool_output answers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True, help="the capture route's /v1 base URL")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--prompt", required=True, help="the user's message")
    p.add_argument("--mode", choices=("responses", "chat"), default="responses")
    p.add_argument("--streamed", action="store_true", help="Runner.run_streamed, reading every stream event")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--timeout-s", type=float, default=90.0, help="deadline of one model call")
    p.add_argument("--log-requests", type=Path, default=None, help="write every request body sent (JSON list)")
    return p.parse_args(argv)


def calculator_answer(arguments: str) -> str:
    """The calculator's answer to a tool call's JSON arguments (an `error: ...` text, never an exception)."""
    try:
        expression = json.loads(arguments).get("expression", "")
    except (json.JSONDecodeError, AttributeError):
        expression = arguments
    try:
        return str(calculate(str(expression)))
    except CalculatorError as e:
        return f"{TOOL_ERROR_PREFIX}{e}"


async def _invoke_calculator(_context: Any, arguments: str) -> str:
    return calculator_answer(arguments)


def calculator_tool() -> FunctionTool:
    spec = CALCULATOR_TOOL["function"]
    return FunctionTool(
        name=spec["name"], description=spec["description"], params_json_schema=spec["parameters"],
        on_invoke_tool=_invoke_calculator, strict_json_schema=False,
    )


def _body_logger(sink: list[Any]):
    async def on_request(request: httpx2.Request) -> None:
        if request.method == "POST":
            sink.append(json.loads(request.content or b"null"))

    return on_request


async def read_stream(result: Any) -> dict[str, Any]:
    """Every event of a streamed run: how many, how many text deltas, and when the first one came."""
    started = time.perf_counter()
    events = deltas = 0
    first: float | None = None
    async for event in result.stream_events():
        events += 1
        if event.type == "raw_response_event" and getattr(event.data, "type", None) == "response.output_text.delta":
            deltas += 1
            first = round(time.perf_counter() - started, 4) if first is None else first
    return {"stream_events": events, "text_deltas": deltas, "first_delta_s": first}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    set_tracing_disabled(True)
    bodies: list[Any] = []
    http_client = httpx2.AsyncClient(event_hooks={"request": [_body_logger(bodies)]}) if args.log_requests else None
    client = AsyncOpenAI(base_url=args.base_url, api_key="unused", timeout=args.timeout_s, max_retries=0,
                         http_client=http_client)
    provider = OpenAIProvider(openai_client=client, use_responses=args.mode == "responses")
    agent = Agent(name="calculator-agent", instructions=SYSTEM_PROMPT, model=args.model, tools=[calculator_tool()],
                  model_settings=ModelSettings(temperature=0.0, max_tokens=args.max_tokens))
    out: dict[str, Any] = {"mode": args.mode, "streamed": args.streamed, "final_output": None, "response_ids": [],
                           "tool_calls": 0}
    run_config = RunConfig(model_provider=provider, tracing_disabled=True)
    try:
        if args.streamed:
            result = Runner.run_streamed(agent, args.prompt, max_turns=args.max_turns, run_config=run_config)
            out.update(await read_stream(result))
        else:
            result = await Runner.run(agent, args.prompt, max_turns=args.max_turns, run_config=run_config)
        out["final_output"] = None if result.final_output is None else str(result.final_output)
        out["response_ids"] = [None if response.response_id == FAKE_RESPONSES_ID else response.response_id
                               for response in result.raw_responses]
        out["tool_calls"] = sum(1 for item in result.new_items if item.type == "tool_call_item")
    except Exception as error:  # the driver's verdict: reported on its JSON line, exit code 1
        out["error"] = f"{type(error).__name__}: {str(error)[:1500]}"
    finally:
        await client.close()
        if args.log_requests:
            args.log_requests.write_text(json.dumps(bodies, indent=2, sort_keys=True))
    return out


def main(argv: list[str] | None = None) -> int:
    result = asyncio.run(run(parse_args(argv)))
    print(json.dumps(result, sort_keys=True), flush=True)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
