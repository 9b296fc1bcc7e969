"""The OpenAI Agents SDK as a harness scenario: its driver in its own venv, against one rollout's capture route.

`run_agents_sdk(base_url, model, prompt, mode, streamed=..., ...)` builds (or reuses) the spec-hashed
`harness-openai-agents` venv, runs `examples/harness/agents_sdk_driver.py` in it as a subprocess
with a deadline, and returns the driver's JSON line (`AgentsSdkRun`). `sdk_outcome(run)` is the
Gym-`/run`-like outcome the judge reads: on the Responses API the SDK saw response ids, so the last
one is the declared terminal (`terminal_response_id`); over chat completions it saw none, so the
scored output's text is declared instead (`terminal_output_text`, the content witness).
With `streamed=True` the driver runs `Runner.run_streamed` (`stream_events`, `text_deltas`,
`first_delta_s` on the run). Used by `examples/harness_scenarios.py` (`responses_api`,
`agents_sdk_chat`, `agents_sdk_streamed`, `agents_sdk_chat_streamed`).
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_rl.token_capture.judge import TERMINAL_OUTPUT_TEXT_KEY, TERMINAL_RESPONSE_ID_KEY
from nemo_rl.utils.venvs import ensure_venv, harness_spec, venv_python

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "examples" / "harness" / "agents_sdk_driver.py"


class AgentsSdkRunError(RuntimeError):
    """The driver did not print its JSON line (it crashed or missed its deadline)."""


@dataclass(frozen=True)
class AgentsSdkRun:
    mode: str
    final_output: str | None
    response_ids: tuple[str | None, ...]
    tool_calls: int
    error: str | None
    seconds: float
    streamed: bool = False
    stream_events: int | None = None
    text_deltas: int | None = None
    first_delta_s: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("responses", "chat"):
            raise ValueError(f"AgentsSdkRun.mode={self.mode!r}: expected 'responses' or 'chat'")


def parse_driver_line(stdout: str, seconds: float) -> AgentsSdkRun:
    """The driver's last JSON line as an `AgentsSdkRun`; `AgentsSdkRunError` when there is none."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise AgentsSdkRunError(f"the Agents SDK driver printed no JSON line; stdout tail: {stdout[-1500:]!r}")
    data = json.loads(lines[-1])
    return AgentsSdkRun(data["mode"], data.get("final_output"), tuple(data.get("response_ids") or ()),
                        int(data.get("tool_calls") or 0), data.get("error"), round(seconds, 3),
                        bool(data.get("streamed")), data.get("stream_events"), data.get("text_deltas"),
                        data.get("first_delta_s"))


async def run_agents_sdk(base_url: str, model: str, prompt: str, mode: str, *, max_tokens: int, timeout_s: float,
                         streamed: bool = False, log=print) -> AgentsSdkRun:
    """Run the driver once in the harness venv (built on first use, then cached by its spec hash)."""
    venv = await asyncio.to_thread(ensure_venv, harness_spec("openai-agents"), progress=log)
    cmd = [str(venv_python(venv)), str(DRIVER), "--base-url", base_url, "--model", model, "--prompt", prompt,
           "--mode", mode, "--max-turns", "4", "--max-tokens", str(max_tokens), *(["--streamed"] if streamed else [])]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    loop = asyncio.get_running_loop()
    start = loop.time()
    proc = await asyncio.create_subprocess_exec(*cmd, cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError as e:
        proc.kill()
        await proc.wait()
        raise AgentsSdkRunError(f"the Agents SDK driver ({mode}) missed its {timeout_s:g} s deadline") from e
    if stderr:
        log(f"[agents-sdk:{mode}] stderr tail: {stderr.decode(errors='replace')[-800:]}")
    return parse_driver_line(stdout.decode(errors="replace"), loop.time() - start)


def sdk_outcome(run: AgentsSdkRun) -> dict[str, Any]:
    """The judged outcome: the declared terminal response id (Responses API) or the output witness (chat)."""
    text = (run.final_output or "").strip()
    outcome: dict[str, Any] = {"reward": 1.0 if text else 0.0, "response": {"output": []}}
    ids = [rid for rid in run.response_ids if rid]
    if ids:
        outcome["response"]["id"] = ids[-1]
        outcome[TERMINAL_RESPONSE_ID_KEY] = ids[-1]
    elif run.final_output is not None:
        outcome[TERMINAL_OUTPUT_TEXT_KEY] = run.final_output
    return outcome
