"""Our Gym resources server for the chained arithmetic task (the long-tail workload).

Contract (beyond `resources.ArithResourcesServer`, whose input limits and 4xx rules it keeps):
- `/seed_session` reads the chain from the /run body's extra fields (`chain.build_chain_row`) and
  keeps it for the rollout's Gym session, with the rollout's start time. A row whose chain is
  malformed or whose answer disagrees is refused (HTTP 422 naming the field).
- `/calculator` answers with `chain.chain_tool_output` for that session: the value, then the next
  link while links remain. Without a seeded session it is the plain calculator.
- `/verify` scores the final assistant text with `chain.verify_chain` and prints one line
  `chain_rollout {json}` to stdout (the run's `gym_<name>.log`): `calls` (k), `tool_calls`,
  `model_calls`, `reward`, `seconds` (seed_session to verify). `rollout_stats` reads them back.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, PrivateAttr

from examples.arith.chain import Chain, InvalidChainError, chain_from_fields, chain_tool_output, verify_chain
from examples.arith.resources import ArithResourcesServer, CalculatorRequest
from examples.arith.rows import calculator_tool_output, final_assistant_text
from nemo_gym.base_resources_server import BaseSeedSessionResponse, BaseVerifyRequest, BaseVerifyResponse
from nemo_gym.server_utils import SESSION_ID_KEY

ROLLOUT_LOG_PREFIX = "chain_rollout "


class ChainSeedRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    chain_start: int
    chain_links: list[tuple[str, int]]
    answer: int


class ChainVerifyRequest(BaseVerifyRequest):
    chain_start: int
    chain_links: list[tuple[str, int]]
    answer: int


class ChainVerifyResponse(BaseVerifyResponse):
    chain_start: int
    chain_links: list[tuple[str, int]]
    answer: int
    final_text: str
    tool_calls: int
    model_calls: int


@dataclass
class _Session:
    chain: Chain
    started: float
    calls_done: int = 0


def _unprocessable(e: InvalidChainError, value: Any) -> HTTPException:
    return HTTPException(
        status_code=422,
        detail=[{"type": "ground_truth_mismatch", "loc": ["body", "chain_links"], "msg": str(e), "input": value}],
    )


def call_counts(output_items: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
    """(tool calls, model calls) of a Responses output: a model call starts at the first item and after each tool result."""
    tool_calls = sum(1 for item in output_items if item.get("type") == "function_call")
    model_calls, after_tool = 0, True
    for item in output_items:
        is_result = item.get("type") == "function_call_output"
        if not is_result and after_tool:
            model_calls += 1
        after_tool = is_result
    return tool_calls, model_calls


def rollout_stats(log_lines: Iterable[str]) -> list[dict[str, Any]]:
    """The `chain_rollout` records of a server log (the server's name prefix before them is ignored)."""
    out = []
    for line in log_lines:
        _, sep, rest = line.partition(ROLLOUT_LOG_PREFIX)
        if sep:
            out.append(json.loads(rest))
    return out


class ChainResourcesServer(ArithResourcesServer):
    # Gym session id -> the rollout's chain, start time and good calls so far.
    _sessions: dict[str, _Session] = PrivateAttr(default_factory=dict)

    async def seed_session(self, request: Request, body: ChainSeedRequest) -> BaseSeedSessionResponse:
        try:
            chain = chain_from_fields(body.chain_start, body.chain_links, body.answer)
        except InvalidChainError as e:
            raise _unprocessable(e, body.chain_links) from e
        self._sessions[request.session[SESSION_ID_KEY]] = _Session(chain=chain, started=time.monotonic())
        return BaseSeedSessionResponse()

    async def calculator(self, request: Request, body: CalculatorRequest) -> PlainTextResponse:
        session = self._sessions.get(request.session[SESSION_ID_KEY])
        if session is None:
            return PlainTextResponse(calculator_tool_output(body.expression))
        text, session.calls_done = chain_tool_output(body.expression, session.chain, session.calls_done)
        return PlainTextResponse(text)

    async def verify(self, request: Request, body: ChainVerifyRequest) -> ChainVerifyResponse:
        try:
            chain = chain_from_fields(body.chain_start, body.chain_links, body.answer)
        except InvalidChainError as e:
            raise _unprocessable(e, body.chain_links) from e
        session = self._sessions.pop(request.session[SESSION_ID_KEY], None)
        output = body.response.model_dump(mode="json")["output"]
        text = final_assistant_text(output)
        tool_calls, model_calls = call_counts(output)
        reward = verify_chain(text, chain)
        record = {
            "calls": chain.calls,
            "tool_calls": tool_calls,
            "model_calls": model_calls,
            "reward": reward,
            "seconds": None if session is None else round(time.monotonic() - session.started, 3),
        }
        print(ROLLOUT_LOG_PREFIX + json.dumps(record, sort_keys=True), file=sys.stdout, flush=True)
        return ChainVerifyResponse(
            **body.model_dump(), reward=reward, final_text=text, tool_calls=tool_calls, model_calls=model_calls
        )


if __name__ == "__main__":
    ChainResourcesServer.run_webserver()
