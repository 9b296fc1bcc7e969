"""Time to first chunk, streamed vs not, and what capture costs a streamed call (not in CI).

    uv run python benchmarks/streaming_ttfc.py --out DIR [--rounds 20] [--max-tokens 96] [--candidates 6]

Starts the real stack once (private Ray, TransferQueue, the vLLM CPU engine with the tiny model,
Gym's capture gate) and sends the same chat request, one call at a time, in four arms whose order
rotates every round (so drift in the machine's load hits all alike):

- `streamed_capture`  `stream=true` on the gate's capture route (admitted, staged, ledgered);
- `whole_capture`     the same without `stream` (its first content arrives with the whole reply);
- `streamed_plain`    `stream=true` on the gate without the rollout prefix (capture off);
- `whole_plain`       the same without `stream`;
- `responses_streamed_capture` / `responses_whole_capture`  the same task as a `/v1/responses`
  request on the capture route, streamed (Responses events built from the worker's stream) or not.
  The Responses API has no `seed`, so these replies are sampled afresh each call: compare them by
  ms per token and by the first `response.output_text.delta`.

Per arm: time to the first content chunk (`ttfc`), to the whole reply (`total`), generated tokens,
p50 / p90 over the measured rounds. Capture's per-call cost on the streamed path is
`streamed_capture.total_p50 - streamed_plain.total_p50` (and the same per generated token).
Writes DIR/streaming_ttfc.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

ARMS = ("streamed_capture", "whole_capture", "streamed_plain", "whole_plain", "responses_streamed_capture",
        "responses_whole_capture")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def arm_order(round_index: int) -> list[str]:
    """The arms rotated by one each round."""
    k = round_index % len(ARMS)
    return list(ARMS[k:] + ARMS[:k])


def sse_payloads(buffer: bytearray) -> list[str]:
    """Complete `data` payloads cut off the front of `buffer` (in place)."""
    out = []
    while (end := buffer.find(b"\n\n")) >= 0:
        event, buffer[:] = bytes(buffer[:end]), buffer[end + 2 :]
        out += [line[5:].strip().decode() for line in event.split(b"\n") if line.startswith(b"data:")]
    return out


@dataclass(frozen=True)
class Dialect:
    """How one API reads: generated tokens of a whole reply, and one streamed event as
    (first content?, end of stream?, generated tokens or None); `end` names the end event."""

    whole_tokens: Callable[[dict], int]
    read_event: Callable[[str, str], tuple[bool, bool, int | None]]
    end: str


def _chat_event(url: str, text: str) -> tuple[bool, bool, int | None]:
    if text == "[DONE]":
        return False, True, None
    chunk = json.loads(text)
    if "error" in chunk:
        raise RuntimeError(f"{url} streamed an error: {chunk['error']}")
    tokens = int(chunk["usage"]["completion_tokens"]) if chunk.get("usage") else None
    return any((c.get("delta") or {}).get("content") for c in chunk["choices"]), False, tokens


def _responses_event(url: str, text: str) -> tuple[bool, bool, int | None]:
    event = json.loads(text)
    if event["type"] == "response.failed":
        raise RuntimeError(f"{url} streamed a failure: {event['response'].get('error')}")
    if event["type"] in ("response.completed", "response.incomplete"):
        return False, True, int(event["response"]["usage"]["output_tokens"])
    return event["type"] == "response.output_text.delta", False, None


CHAT = Dialect(lambda payload: int(payload["usage"]["completion_tokens"]), _chat_event, "[DONE]")
RESPONSES = Dialect(lambda payload: int(payload["usage"]["output_tokens"]), _responses_event, "response.completed")


async def timed_call(session: aiohttp.ClientSession, url: str, request: dict, stream: bool, dialect: Dialect,
                     timeout_s: float) -> dict:
    """Seconds to the first content and to the whole reply, and the generated tokens, of one call."""
    started = time.perf_counter()
    first: float | None = None
    tokens = 0
    async with session.post(url, json=request, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {(await resp.text())[:300]}")
        if not stream:
            payload = await resp.json()
            first = time.perf_counter() - started
            tokens = dialect.whole_tokens(payload)
        else:
            buffer = bytearray()
            done = False
            async for data in resp.content.iter_any():
                buffer.extend(data)
                for text in sse_payloads(buffer):
                    content, end, count = dialect.read_event(url, text)
                    if content and first is None:
                        first = time.perf_counter() - started
                    tokens = tokens if count is None else count
                    done = done or end
            if not done:
                raise RuntimeError(f"{url}: the stream ended without {dialect.end}")
    return {"ttfc_s": first, "total_s": time.perf_counter() - started, "tokens": tokens}


async def one_call(session: aiohttp.ClientSession, url: str, body: dict, stream: bool, timeout_s: float) -> dict:
    """`timed_call` for `/v1/chat/completions` (usage in the last chunk when streamed)."""
    request = {**body, "stream": True, "stream_options": {"include_usage": True}} if stream else body
    return await timed_call(session, url, request, stream, CHAT, timeout_s)


def responses_body(chat: dict) -> dict:
    """The chat request as a Responses request (system prompt as instructions; no seed in this API)."""
    system, *rest = chat["messages"]
    return {"model": chat["model"], "instructions": system["content"], "input": rest,
            "max_output_tokens": chat["max_tokens"], "temperature": chat["temperature"]}


async def one_responses_call(session: aiohttp.ClientSession, url: str, body: dict, stream: bool,
                             timeout_s: float) -> dict:
    """`timed_call` for `/v1/responses`: first content is the first `response.output_text.delta`."""
    return await timed_call(session, url, {**body, "stream": stream}, stream, RESPONSES, timeout_s)


def arm_figures(calls: list[dict]) -> dict[str, Any]:
    ttfc = [c["ttfc_s"] for c in calls if c["ttfc_s"] is not None]
    total = [c["total_s"] for c in calls]
    per_token = [c["total_s"] / c["tokens"] for c in calls if c["tokens"]]
    ms = lambda v: None if v is None else round(1000 * v, 3)  # noqa: E731
    return {"calls": len(calls), "ttfc_ms_p50": ms(percentile(ttfc, 50)), "ttfc_ms_p90": ms(percentile(ttfc, 90)),
            "total_ms_p50": ms(percentile(total, 50)), "total_ms_p90": ms(percentile(total, 90)),
            "ms_per_token_p50": ms(percentile(per_token, 50)),
            "tokens_p50": percentile([c["tokens"] for c in calls], 50)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from examples.arith.task import SYSTEM_PROMPT, make_problems, user_prompt
    from examples.arith.tiny_model import TinyModelConfig, ensure_tiny_model
    from nemo_rl.algorithms.setup import start_stack
    from nemo_rl.data.calls import rollout_id_for
    from nemo_rl.data_plane import DataPlaneConfig
    from nemo_rl.environments.nemo_gym_config import NemoGymConfig
    from nemo_rl.models.generation.vllm.config import GenerationConfig
    from nemo_rl.token_capture.config import TokenCaptureConfig

    model_dir = ensure_tiny_model(TinyModelConfig(), progress=_log)
    generation = GenerationConfig(num_workers=1)
    stack = await start_stack(model_dir=model_dir, log_dir=args.out / "logs", generation=generation,
                              token_capture=TokenCaptureConfig(enabled=True), data_plane=DataPlaneConfig(),
                              nemo_gym=NemoGymConfig(), num_cpus=2, progress=_log)
    problem = make_problems(args.seed, 1)[0]
    base = {"model": generation.model_name, "max_tokens": args.max_tokens,
            "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user_prompt(problem)}]}
    # The tiny model's greedy answers are a few tokens, too short to separate the first chunk from
    # the last: among seeded samplings (each reproducible, so every arm gets the same reply) take
    # the one with the longest reply, measured once before the rounds.
    candidates = [{**base, "temperature": t, "seed": args.seed + k} for t in (1.0, 1.5, 2.0) for k in range(args.candidates)]
    calls: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    run_id = f"stream-ttfc-{uuid.uuid4().hex[:8]}"
    try:
        assert stack.env is not None
        gate = stack.env.servers.gate_url
        async with aiohttp.ClientSession() as session:
            lengths = [(await one_call(session, f"{gate}/v1/chat/completions", c, False, args.call_timeout_s))["tokens"]
                       for c in candidates]
            body = candidates[max(range(len(candidates)), key=lambda i: lengths[i])]
            _log(f"reply lengths of the candidate samplings: {lengths}; using temperature={body['temperature']} "
                 f"seed={body['seed']} ({max(lengths)} tokens)")
            for index in range(args.warmup_rounds + args.rounds):
                for arm in arm_order(index):
                    rollout = rollout_id_for(run_id, index, 0, ARMS.index(arm), 0)
                    capture = f"{gate}/ng-rollout/{rollout}/training-token-capture/v1"
                    streamed = "streamed" in arm
                    if arm.startswith("responses"):
                        call = await one_responses_call(session, f"{capture}/responses", responses_body(body),
                                                        streamed, args.call_timeout_s)
                    else:
                        url = f"{capture if arm.endswith('capture') else gate + '/v1'}/chat/completions"
                        call = await one_call(session, url, body, streamed, args.call_timeout_s)
                    if index >= args.warmup_rounds:
                        calls[arm].append(call)
                _log(f"round {index + 1}/{args.warmup_rounds + args.rounds} done")
    finally:
        await stack.aclose()
    arms = {arm: arm_figures(calls[arm]) for arm in ARMS}
    sc, sp = arms["streamed_capture"], arms["streamed_plain"]
    return {
        "body": {k: body[k] for k in ("temperature", "seed", "max_tokens")},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "arms": arms,
        "streamed_capture_cost_ms_p50": round(sc["total_ms_p50"] - sp["total_ms_p50"], 3),
        "streamed_capture_cost_ms_per_token_p50": (
            round(sc["ms_per_token_p50"] - sp["ms_per_token_p50"], 4)
            if sc["ms_per_token_p50"] is not None and sp["ms_per_token_p50"] is not None else None),
        "ttfc_streamed_over_whole_capture_p50": round(sc["ttfc_ms_p50"] / arms["whole_capture"]["ttfc_ms_p50"], 4),
        "responses_ttfc_streamed_over_whole_p50": round(
            arms["responses_streamed_capture"]["ttfc_ms_p50"] / arms["responses_whole_capture"]["ttfc_ms_p50"], 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup-rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--candidates", type=int, default=6, help="seeded samplings tried per temperature")
    p.add_argument("--call-timeout-s", type=float, default=120.0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = asyncio.run(run(args))
    (args.out / "streaming_ttfc.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    print(f"{'arm':<27} {'calls':>5} {'ttfc p50 ms':>12} {'ttfc p90 ms':>12} {'total p50 ms':>13} "
          f"{'total p90 ms':>13} {'ms/token p50':>13} {'tokens p50':>10}")
    for arm, f in results["arms"].items():
        print(f"{arm:<27} {f['calls']:>5} {f['ttfc_ms_p50']!s:>12} {f['ttfc_ms_p90']!s:>12} {f['total_ms_p50']!s:>13} "
              f"{f['total_ms_p90']!s:>13} {f['ms_per_token_p50']!s:>13} {f['tokens_p50']!s:>10}")
    print(f"capture on the streamed path: +{results['streamed_capture_cost_ms_p50']} ms per call (p50), "
          f"+{results['streamed_capture_cost_ms_per_token_p50']} ms per generated token (p50); "
          f"time to first chunk streamed / whole (capture on, p50): {results['ttfc_streamed_over_whole_capture_p50']}, "
          f"Responses API: {results['responses_ttfc_streamed_over_whole_p50']}")


if __name__ == "__main__":
    main()
