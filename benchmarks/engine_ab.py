"""The engine's part of a call, capture vs plain, on identical requests (one worker, one engine).

`capture_ab.py` compares whole GRPO runs: the two arms train different policies, so their calls
differ in length and in how many overlap in the engine, and a per-call engine time mixes those
with any cost of capture. This benchmark removes both: one stack (capture on), one vLLM worker,
and rounds of the same B root calls (greedy, fixed seed, the task's tool schema) sent at once,
either through the gate's capture route (admitted: exact prompt ids, staging behind the reply,
commit) or straight to the worker's plain route (Gym's legacy path: render, generate, parse),
alternating which mode goes first (ABBA). With greedy sampling both modes generate the same
tokens, so any difference in the engine's time per call is capture's doing.

Figures per mode (`results.json`, `report.md`): the engine's part per call (`generate_s`, from
the worker's own wire metrics), engine time per generated token, the engine's load (busy time,
calls in flight), the client's latency (the capture mode's includes the gate), and the fraction
of calls whose generated token count equals the other mode's for the same prompt. Nothing is
asserted on a timer.

    uv run python benchmarks/engine_ab.py --out DIR [--rounds 8] [--concurrency 8] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from capture_ab import engine_load, percentile, wire_metrics_env  # noqa: E402  (a sibling script, not a package)

MODES = ("capture", "plain")


def _log(msg: str) -> None:
    print(f"[engine_ab] {msg}", file=sys.stderr, flush=True)


def order_for_round(index: int) -> tuple[str, str]:
    """ABBA: capture first on rounds 0, 3, 4, 7, ...; plain first on 1, 2, 5, 6, ..."""
    return MODES if index % 4 in (0, 3) else MODES[::-1]


def mode_figures(samples: Sequence[Mapping[str, Any]], client_s: Sequence[float]) -> dict[str, Any]:
    """One mode's figures from the worker's call samples and the client's latencies (pure)."""
    ok = [s for s in samples if int(s.get("status", 0)) == 200 and "generate_s" in s]
    if not ok:
        raise ValueError("no successful call was sampled in this mode")
    generate = [float(s["generate_s"]) for s in ok]
    per_token = [float(s["generate_s"]) / int(s["generated_tokens"]) for s in ok if int(s.get("generated_tokens", 0))]
    return {
        "calls": len(ok),
        "generate_ms_p50": 1000.0 * percentile(generate, 50),
        "generate_ms_mean": 1000.0 * statistics.fmean(generate),
        "generate_ms_per_token_p50": 1000.0 * percentile(per_token, 50) if per_token else None,
        "worker_total_ms_p50": 1000.0 * percentile([float(s["total_s"]) for s in ok], 50),
        "outside_engine_ms_p50": 1000.0 * percentile([float(s["total_s"]) - float(s["generate_s"]) for s in ok], 50),
        "outside_engine_ms_p90": 1000.0 * percentile([float(s["total_s"]) - float(s["generate_s"]) for s in ok], 90),
        "client_ms_p50": 1000.0 * percentile(client_s, 50) if client_s else None,
        "generated_tokens": sum(int(s.get("generated_tokens", 0)) for s in ok),
        "engine_load": engine_load(ok),
    }


def mode_of(sample: Mapping[str, Any]) -> str:
    return "capture" if sample.get("capture") else "plain"


def batches_of(samples: Sequence[Mapping[str, Any]], size: int) -> list[list[Mapping[str, Any]]]:
    """The measured samples (time order) cut into the rounds' batches; each batch is one mode."""
    if len(samples) % size:
        raise ValueError(f"{len(samples)} samples do not split into batches of {size}")
    batches = [list(samples[i:i + size]) for i in range(0, len(samples), size)]
    for batch in batches:
        if len({mode_of(s) for s in batch}) != 1:
            raise ValueError("a batch mixes modes: calls of two rounds overlapped or a call was not sampled")
    return batches


def paired_ratios(batches: Sequence[Sequence[Mapping[str, Any]]]) -> dict[str, float]:
    """Per round (two adjacent batches, one per mode): median capture engine time / median plain
    engine time; the median and quartiles over rounds. Pairing adjacent batches cancels the
    machine's slow load changes that dominate a shared 2-core host."""
    ratios = []
    for first, second in zip(batches[0::2], batches[1::2]):
        med = {mode_of(b[0]): statistics.median(float(s["generate_s"]) for s in b) for b in (first, second)}
        if set(med) != set(MODES):
            raise ValueError("a round's two batches are not one per mode")
        ratios.append(med["capture"] / med["plain"])
    return {"rounds": len(ratios), "median": percentile(ratios, 50), "q1": percentile(ratios, 25),
            "q3": percentile(ratios, 75)}


def same_lengths(lengths: Mapping[str, Mapping[int, list[int]]]) -> float | None:
    """Fraction of (prompt, round) pairs where both modes generated the same number of tokens."""
    pairs = [(a, b) for p, a_list in lengths["capture"].items() for a, b in zip(a_list, lengths["plain"].get(p, []))]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


async def _post(session: aiohttp.ClientSession, url: str, body: dict, timeout_s: float) -> tuple[float, dict]:
    started = time.perf_counter()
    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {(await resp.text())[:300]}")
        payload = await resp.json()
    return time.perf_counter() - started, payload


def _completion_tokens(payload: dict) -> int:
    return int(payload["usage"]["completion_tokens"])


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from nemo_rl.data_plane import DataPlaneConfig
    from nemo_rl.algorithms.setup import start_stack
    from examples.arith.task import CALCULATOR_TOOL, SYSTEM_PROMPT, make_problems, user_prompt
    from examples.arith.tiny_model import TinyModelConfig, ensure_tiny_model
    from nemo_rl.environments.nemo_gym_config import NemoGymConfig
    from nemo_rl.data.calls import rollout_id_for
    from nemo_rl.models.generation.vllm.config import GenerationConfig
    from nemo_rl.token_capture.config import TokenCaptureConfig

    wire_dir = args.out / "wire"
    wire_dir.mkdir(parents=True, exist_ok=True)
    os.environ.update(wire_metrics_env(wire_dir))  # before Ray starts: the worker inherits it
    model_dir = ensure_tiny_model(TinyModelConfig(), progress=_log)
    generation = GenerationConfig(num_workers=1)
    stack = await start_stack(model_dir=model_dir, log_dir=args.out / "logs", generation=generation,
                              token_capture=TokenCaptureConfig(enabled=True), data_plane=DataPlaneConfig(),
                              nemo_gym=NemoGymConfig(), num_cpus=2, progress=_log)
    problems = make_problems(args.seed, args.concurrency)
    bodies = [{"model": generation.model_name, "temperature": 0.0, "seed": args.seed, "max_tokens": args.max_tokens,
               "tools": [CALCULATOR_TOOL],
               "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user_prompt(p)}]}
              for p in problems]
    client_s: dict[str, list[float]] = {m: [] for m in MODES}
    lengths: dict[str, dict[int, list[int]]] = {m: {} for m in MODES}
    run_id = f"engine-ab-{uuid.uuid4().hex[:8]}"
    try:
        assert stack.env is not None and stack.workers is not None
        gate, worker = stack.env.servers.gate_url, stack.workers.base_urls[0]
        async with aiohttp.ClientSession() as session:
            for index in range(args.warmup_rounds + args.rounds):
                measured = index >= args.warmup_rounds
                for mode in order_for_round(index):
                    def url(i: int) -> str:
                        if mode == "plain":
                            return f"{worker}/chat/completions"  # base_url ends in /v1
                        rollout = rollout_id_for(run_id, index, 0, i, 0)
                        return f"{gate}/ng-rollout/{rollout}/training-token-capture/v1/chat/completions"
                    replies = await asyncio.gather(*(_post(session, url(i), body, args.call_timeout_s)
                                                     for i, body in enumerate(bodies)))
                    if measured:
                        client_s[mode].extend(seconds for seconds, _ in replies)
                        for i, (_, payload) in enumerate(replies):
                            lengths[mode].setdefault(i, []).append(_completion_tokens(payload))
                _log(f"round {index + 1}/{args.warmup_rounds + args.rounds}{'' if measured else ' (warm-up)'} done")
    finally:
        await stack.aclose()
    time.sleep(1.0)  # the worker's metrics file is flushed at exit and every 0.5 s
    samples = [c for path in sorted(wire_dir.glob("worker-*.json"))
               for c in json.loads(path.read_text())["calls"]]
    measured = sorted(samples, key=lambda s: float(s.get("generate_t0_s", 0.0)))[-args.rounds * args.concurrency * 2:]
    batches = batches_of(measured, args.concurrency)
    by_mode: dict[str, list[dict]] = {m: [] for m in MODES}
    for sample in measured:
        by_mode[mode_of(sample)].append(sample)
    figures = {m: mode_figures(by_mode[m], client_s[m]) for m in MODES}
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "modes": figures,
        "paired_generate_ratio": paired_ratios(batches),
        "same_generated_length_fraction": same_lengths(lengths),
        "generate_ms_p50_ratio": figures["capture"]["generate_ms_p50"] / figures["plain"]["generate_ms_p50"],
        "generate_ms_per_token_p50_ratio": (
            figures["capture"]["generate_ms_per_token_p50"] / figures["plain"]["generate_ms_per_token_p50"]
            if figures["capture"]["generate_ms_per_token_p50"] and figures["plain"]["generate_ms_per_token_p50"]
            else None),
    }


def write_report(path: Path, results: Mapping[str, Any]) -> None:
    m = results["modes"]
    cfg = results["config"]
    rows = [("calls", "calls", 0), ("engine per call, p50 ms", "generate_ms_p50", 3),
            ("engine per call, mean ms", "generate_ms_mean", 3),
            ("engine per generated token, p50 ms", "generate_ms_per_token_p50", 3),
            ("worker's whole call, p50 ms", "worker_total_ms_p50", 3),
            ("worker's call outside the engine, p50 ms", "outside_engine_ms_p50", 3),
            ("worker's call outside the engine, p90 ms", "outside_engine_ms_p90", 3),
            ("client latency, p50 ms", "client_ms_p50", 3),
            ("generated tokens", "generated_tokens", 0)]
    lines = ["# Engine A/B: capture vs plain on identical requests", "",
             f"{cfg['rounds']} rounds (+{cfg['warmup_rounds']} warm-up) of {cfg['concurrency']} concurrent root calls, "
             f"greedy, max_tokens {cfg['max_tokens']}, one worker; modes alternate ABBA.", "",
             "| | capture | plain |", "|---|---|---|"]
    for label, key, digits in rows:
        cells = [m[mode][key] for mode in MODES]
        lines.append(f"| {label} | " + " | ".join("-" if c is None else f"{c:.{digits}f}" if digits else str(c)
                                                 for c in cells) + " |")
    for key, label in (("busy_s", "engine busy, s"), ("tokens_per_busy_s", "generated tokens per busy second"),
                       ("in_flight_mean", "calls in flight, mean")):
        lines.append(f"| {label} | {m['capture']['engine_load'][key]:.3f} | {m['plain']['engine_load'][key]:.3f} |")
    pr = results["paired_generate_ratio"]
    lines += ["", f"Engine time per call, capture / plain, paired by round: median {pr['median']:.3f} "
              f"(quartiles {pr['q1']:.3f}-{pr['q3']:.3f}, {pr['rounds']} rounds).",
              "", f"Same generated length in both modes: {results['same_generated_length_fraction']}; "
              f"engine per call p50 ratio {results['generate_ms_p50_ratio']:.3f}, per token "
              f"{results['generate_ms_per_token_p50_ratio']}."]
    path.write_text("\n".join(lines) + "\n")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output folder (results.json, report.md, wire/, logs/)")
    p.add_argument("--rounds", type=int, default=8, help="measured rounds per mode (default 8)")
    p.add_argument("--warmup-rounds", type=int, default=1, help="rounds left out (default 1)")
    p.add_argument("--concurrency", type=int, default=8, help="calls sent at once per round (default 8)")
    p.add_argument("--max-tokens", type=int, default=48, help="max_tokens per call (default 48)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--call-timeout-s", type=float, default=120.0, help="deadline per HTTP call (default 120)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results = asyncio.run(run(args))
    (args.out / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    write_report(args.out / "report.md", results)
    _log(f"wrote {args.out}/results.json and report.md in {time.monotonic() - started:.0f}s")
    print(json.dumps({k: results[k] for k in ("paired_generate_ratio", "generate_ms_p50_ratio", "generate_ms_per_token_p50_ratio",
                                              "same_generated_length_fraction")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
