"""Capture one multi-turn rollout end to end and check it against the engine's own record.

Brings up the real stack (private Ray, TransferQueue, the vLLM worker in its flavored venv, Gym's
gate + simple_agent + our arithmetic resources server on loopback), runs one rollout with
token capture on, then: fetches the manifest (bearer) and the workers' served-call report,
fetches the staged deltas from TQ, runs the project's one judge (`judge_rollout`, which runs
Gym's `verify_and_linearize` per chain), and compares every row, call by call, with what the
engine sampled. The last stdout line is one JSON object; the exit code is 0 only when the
row verified and its generated ids equal the engine's.

`--drop-first-reply` puts a loopback HTTP forwarder (`DropOnceLink`) between Gym's gate and the
worker that drops the gate's connection right after it has read the worker's reply to the
rollout's first model call, so the gate's HTTP client sees a connection error and re-sends the
same request; the worker replays the committed reply (the summary's `link` counts the drop and
the worker's stats the replay).

    uv run python examples/capture_one_rollout.py [--log-dir DIR] [--seed N] [--temperature T] [--drop-first-reply]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from examples.arith.rows import build_row
from examples.arith.task import make_problems
from examples.arith.tiny_model import TinyModelConfig, ensure_tiny_model
from nemo_rl.algorithms.setup import start_stack
from nemo_rl.data.rows import KeptRollout
from nemo_rl.data_plane import DataPlaneConfig
from nemo_rl.data_plane.partitions import TQTokenSource
from nemo_rl.environments.nemo_gym_config import NemoGymConfig
from nemo_rl.environments.task import RowSampling
from nemo_rl.experience.finalizer_pool import fetch_snapshots
from nemo_rl.models.generation.vllm.config import GenerationConfig
from nemo_rl.token_capture.audit import audit_train_row, retokenization_drift
from nemo_rl.token_capture.config import TokenCaptureConfig
from nemo_rl.token_capture.judge import RolloutEvidence, judge_rollout


class DropOnceLink:
    """A loopback HTTP/1.1 forwarder to one upstream; once armed, it reads the upstream's 200 reply to
    the next POST .../chat/completions and closes the client's connection without sending a byte."""

    def __init__(self) -> None:
        self.upstream: tuple[str, int] | None = None
        self.armed = False
        self.dropped = 0
        self.forwarded = 0
        self._server: asyncio.AbstractServer | None = None
        self._open: set[asyncio.StreamWriter] = set()  # client connections (keep-alive), closed by stop()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    def route(self, base_urls: list[str]) -> list[str]:
        """`start_stack`'s `gym_worker_urls`: the gate calls this link, the link calls the first worker."""
        upstream = urlsplit(base_urls[0])
        self.upstream = (upstream.hostname, upstream.port)
        port = self._server.sockets[0].getsockname()[1]
        return [f"http://127.0.0.1:{port}{upstream.path}"]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._open):
                writer.close()
            await asyncio.wait_for(self._server.wait_closed(), 10.0)

    @staticmethod
    async def _message(reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
        fields = {k.strip().lower(): v.strip() for k, v in fields.items()}
        if b"transfer-encoding" in fields:
            raise RuntimeError(f"DropOnceLink forwards Content-Length bodies only, got {fields[b'transfer-encoding']!r}")
        return head + await reader.readexactly(int(fields.get(b"content-length", b"0")))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open.add(writer)
        try:
            while True:
                try:
                    request = await self._message(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the client (or stop()) closed the keep-alive connection
                assert self.upstream is not None, "route() names the upstream before the gate starts"
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
                up_writer.write(request)
                await up_writer.drain()
                reply = await self._message(up_reader)
                up_writer.close()
                first_line = request.split(b"\r\n", 1)[0]
                if self.armed and first_line.startswith(b"POST ") and b"/chat/completions" in first_line \
                        and reply.startswith(b"HTTP/1.1 200"):
                    self.armed = False
                    self.dropped += 1
                    return  # the reply was read from the worker; the gate gets a closed connection
                writer.write(reply)
                await writer.drain()
                self.forwarded += 1
        finally:
            self._open.discard(writer)
            writer.close()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log-dir", type=Path, default=None, help="default: logs/capture_one_rollout/<timestamp>")
    p.add_argument("--seed", type=int, default=7, help="which arithmetic problem to pose")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-output-tokens", type=int, default=64)
    p.add_argument("--model-dir", type=Path, default=None, help="a local HF model folder; default: build/reuse the tiny model")
    p.add_argument("--drop-first-reply", action="store_true",
                   help="drop the gate's connection after the worker's first reply (the gate re-sends; see above)")
    return p.parse_args()


async def main(args: argparse.Namespace) -> dict:
    log_dir = args.log_dir or Path("logs/capture_one_rollout") / time.strftime("%Y%m%d-%H%M%S")
    t_start = time.monotonic()
    model_dir = args.model_dir or ensure_tiny_model(TinyModelConfig())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    capture = TokenCaptureConfig(enabled=True)
    dp_cfg = DataPlaneConfig()
    link = DropOnceLink() if args.drop_first_reply else None
    if link is not None:
        await link.start()
    stack = await start_stack(
        model_dir=model_dir,
        log_dir=log_dir,
        generation=GenerationConfig(),
        token_capture=capture,
        data_plane=dp_cfg,
        nemo_gym=NemoGymConfig(),
        num_cpus=2,
        gym_worker_urls=link.route if link is not None else None,
    )
    try:
        assert stack.env is not None and stack.workers is not None and stack.client is not None
        problem = make_problems(args.seed, 1)[0]
        rollout_id = f"one-{uuid.uuid4().hex[:12]}"
        row_body = build_row(problem, RowSampling(temperature=args.temperature, top_p=1.0, max_output_tokens=args.max_output_tokens))
        print(f"[rollout] {rollout_id}: {problem.expression} = ?", flush=True)
        if link is not None:
            link.armed = True
        t0 = time.monotonic()
        result = await stack.env.run(rollout_id, row_body)
        rollout_s = time.monotonic() - t0
        manifest = await stack.env.manifest(rollout_id)
        served = tuple(await stack.workers.served.take_served_async([rollout_id]))
        evidence = RolloutEvidence(rollout_id, 0, 0, result, None, manifest, None, served)
        snapshots, problems = fetch_snapshots(
            TQTokenSource(stack.client, capture.staging_partition), evidence.staging_keys())
        verdict = judge_rollout(evidence, snapshots, problems, capture)
        summary: dict = {
            "rollout_id": rollout_id,
            "calls": len(manifest.records) + len(manifest.failures),
            "token_in_calls": sum(1 for r in manifest.records if r.mode == "token_in"),
            "staged": len(snapshots),
            "manifest_failures": [f.reason for f in manifest.failures],
            "reward": result.get("reward"),
            "terminal_selection": verdict.terminal_selection,
            "served_generated_tokens": sum(call.generated_tokens for call in served),
            "served_report_calls": len(served),
            "link": None if link is None else {"dropped": link.dropped, "forwarded": link.forwarded},
        }
        if not isinstance(verdict, KeptRollout):
            summary.update(verified=False, verify_error=f"{verdict.reason.value}: {verdict.detail}", ids_match_engine=False)
            return summary
        engine = stack.workers.engine_records([r.response_id for r in manifest.records])
        audits = [audit_train_row(row, manifest.records, engine) for row in verdict.rows]
        row = verdict.rows[0]
        summary.update(
            verified=True,
            rows=len(verdict.rows),
            row_tokens=len(row.token_ids),
            generated_tokens=verdict.num_generated_tokens,
            kept_generated_tokens=verdict.yield_.kept_generated_tokens,
            ids_match_engine=all(audit.ids_match for audit in audits),
            max_abs_logprob_diff=max(audit.max_abs_logprob_diff for audit in audits),
            weight_versions=list(row.weight_versions),
            retokenization_drift=retokenization_drift(tokenizer, row.token_ids),
            rollout_s=round(rollout_s, 3),
            total_s=round(time.monotonic() - t_start, 1),
            startup_s={k: round(v, 1) for k, v in stack.timings_s.items()},
            worker_capture_stats=stack.workers.capture_stats()[0],
        )
        return summary
    finally:
        await stack.aclose()
        if link is not None:
            await link.stop()


if __name__ == "__main__":
    summary = asyncio.run(main(parse_args()))
    print(json.dumps(summary, sort_keys=True))
    sys.exit(0 if summary.get("verified") and summary.get("ids_match_engine") else 1)
