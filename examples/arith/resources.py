"""Our Gym resources server for the arithmetic tool task (run as its own process).

Contract:
- A subclass of Gym's `SimpleResourcesServer`, so it gets Gym's own `/seed_session`,
  `/verify` wrapping, session middleware, health routes and config loading
  (`NEMO_GYM_CONFIG_DICT` / `NEMO_GYM_CONFIG_PATH`). It needs no Ray (`ray_enabled = False`).
- `POST /calculator` with `{"expression": str}` answers 200 with the plain-text tool result
  (`rows.calculator_tool_output`): the integer, or `error: <reason>`. A calculator
  error is a tool result the model sees, never an HTTP error, so the agent keeps going.
- `POST /verify` scores the final assistant text of the rollout with `task.verify`
  against the problem carried in the /run body's extra fields `expression` and `answer`
  (see `rows.build_row`). A row whose answer disagrees with its expression is refused
  (HTTP 422 naming `answer`, FastAPI's shape) instead of being scored, so the rollout fails loudly.
- Bad input on every route is a 4xx naming the field: FastAPI's 422 for malformed JSON, wrong
  types and missing fields (Gym's validation handler), 413 `request_too_large` for a body above
  `max_body_bytes` (`gate.app.BodyLimitMiddleware`, before anything is parsed).
- The handlers are thin shells over the pure functions in `rows`.

Launch: `python -m examples.arith.resources` with Gym's config env variables set
(see `nemo_rl.environments.nemo_gym_launch.server_env`; `gym_task.RESOURCES_SERVER` names it).
"""

from __future__ import annotations

from fastapi import FastAPI, HTTPException
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from examples.arith.rows import (
    InvalidGroundTruthError,
    calculator_tool_output,
    final_assistant_text,
    problem_from_fields,
)
from examples.arith.task import verify as verify_final_text
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from nemo_rl.environments.gate.app import BodyLimitMiddleware


class ArithResourcesServerConfig(BaseResourcesServerConfig):
    max_body_bytes: int = Field(
        default=1024 * 1024,
        ge=1024,
        description="Largest request body this server reads; larger is 413 before it is parsed.",
    )


class CalculatorRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    expression: str


class ArithVerifyRequest(BaseVerifyRequest):
    expression: str
    answer: int


class ArithVerifyResponse(BaseVerifyResponse):
    expression: str
    answer: int
    final_text: str


class ArithResourcesServer(SimpleResourcesServer):
    ray_enabled = False
    config: ArithResourcesServerConfig

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/calculator", response_class=PlainTextResponse)(self.calculator)
        app.add_middleware(
            BodyLimitMiddleware,
            max_body_bytes=self.config.max_body_bytes,
            knob=f"{self.config.name}.max_body_bytes",
        )
        return app

    async def calculator(self, body: CalculatorRequest) -> PlainTextResponse:
        return PlainTextResponse(calculator_tool_output(body.expression))

    async def verify(self, body: ArithVerifyRequest) -> ArithVerifyResponse:
        try:
            problem = problem_from_fields(body.expression, body.answer)
        except InvalidGroundTruthError as e:
            # The caller's row is inconsistent: a 4xx naming the field, in FastAPI's validation shape.
            raise HTTPException(
                status_code=422,
                detail=[{"type": "ground_truth_mismatch", "loc": ["body", "answer"], "msg": str(e), "input": body.answer}],
            ) from e
        text = final_assistant_text(body.response.model_dump(mode="json")["output"])
        return ArithVerifyResponse(
            **body.model_dump(),
            reward=verify_final_text(text, problem),
            final_text=text,
        )


if __name__ == "__main__":
    ArithResourcesServer.run_webserver()
