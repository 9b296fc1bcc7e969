"""Our Gym resources server for the arithmetic tool task (run as its own process).

Contract:
- A subclass of Gym's `SimpleResourcesServer`, so it gets Gym's own `/seed_session`,
  `/verify` wrapping, session middleware, health routes and config loading
  (`NEMO_GYM_CONFIG_DICT` / `NEMO_GYM_CONFIG_PATH`). It needs no Ray (`ray_enabled = False`).
- `POST /calculator` with `{"expression": str}` answers 200 with the plain-text tool result
  (`nemo_gym_rows.calculator_tool_output`): the integer, or `error: <reason>`. A calculator
  error is a tool result the model sees, never an HTTP error, so the agent keeps going.
- `POST /verify` scores the final assistant text of the rollout with `arith_task.verify`
  against the problem carried in the /run body's extra fields `expression` and `answer`
  (see `nemo_gym_rows.build_row`). A row whose answer disagrees with its expression fails the
  request (HTTP 500 from Gym's exception middleware) instead of being scored.
- The handlers are thin shells over the pure functions in `nemo_gym_rows`.

Launch: `python -m nemo_rl.environments.arith_resources` with Gym's config env variables set
(see `nemo_gym_launch.server_env`).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from nemo_rl.environments.arith_task import verify as verify_final_text
from nemo_rl.environments.nemo_gym_rows import (
    calculator_tool_output,
    final_assistant_text,
    problem_from_fields,
)


class ArithResourcesServerConfig(BaseResourcesServerConfig):
    pass


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
        return app

    async def calculator(self, body: CalculatorRequest) -> PlainTextResponse:
        return PlainTextResponse(calculator_tool_output(body.expression))

    async def verify(self, body: ArithVerifyRequest) -> ArithVerifyResponse:
        problem = problem_from_fields(body.expression, body.answer)
        text = final_assistant_text(body.response.model_dump(mode="json")["output"])
        return ArithVerifyResponse(
            **body.model_dump(),
            reward=verify_final_text(text, problem),
            final_text=text,
        )


if __name__ == "__main__":
    ArithResourcesServer.run_webserver()
