"""Run a Gym agent whose model calls drop the rollout prefix, with the prefix carried (Gym's code untouched).

    NRL_ROLLOUT_SCOPED_MODULE=<agent module> python -m nemo_rl.environments.agents.rollout_scoped

Gym 0.7.0's langgraph flavours post to a fixed `/v1/responses` (to themselves, then to the model
server) instead of `url_path_for_request`, so on the capture path their calls reach the gate
without the rollout prefix, are served uncaptured, and every rollout is `empty_manifest`. Before
running the module as `__main__`, this runner adds `RolloutIdFromPath` to Gym's agent app (a
prefixed self-call then sets Gym's `current_rollout_id()` for its handler, as `/run` does; the
path is left as is, Gym routes it) and wraps `ServerClient.request` with `scoped_path`, the pure
rule: a `/v1/...` path sent while a rollout id is current gets the capture prefix. Invariant: a
prefixed path, any other path (`/seed_session`, `/verify`) and a call outside a rollout are unchanged.
"""

from __future__ import annotations

import os
import re
import runpy
from functools import wraps
from typing import Any

from nemo_gym.base_responses_api_agent import SimpleResponsesAPIAgent
from nemo_gym.rollout_correlation import current_rollout_id, rollout_context
from nemo_gym.server_utils import ROLLOUT_PATH_PREFIX, ServerClient, rollout_path_prefix
from nemo_rl.data.errors import FatalError

MODULE_ENV = "NRL_ROLLOUT_SCOPED_MODULE"
MODEL_ROUTES = "/v1/"
_PREFIXED = re.compile(rf"^/{re.escape(ROLLOUT_PATH_PREFIX)}/(?P<rollout_id>[^/]+)/")


class RolloutScopedLaunchError(FatalError, RuntimeError):
    """The runner was started without the agent module to run."""


def scoped_path(url_path: str, rollout_id: str | None) -> str:
    """`url_path` with the rollout's capture prefix when it is an unprefixed `/v1/` route in a rollout (pure)."""
    if not rollout_id or not url_path.startswith(MODEL_ROUTES) or url_path.startswith(f"/{ROLLOUT_PATH_PREFIX}/"):
        return url_path
    return rollout_path_prefix(rollout_id, token_capture=True) + url_path


def rollout_id_in_path(path: str) -> str | None:
    """The rollout id of a `/ng-rollout/<id>/...` path, else None (pure)."""
    match = _PREFIXED.match(path)
    return match.group("rollout_id") if match else None


class RolloutIdFromPath:
    """Pure ASGI: serve a prefixed request inside Gym's `rollout_context(<its id>)`, path unchanged."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        rollout_id = rollout_id_in_path(str(scope.get("path") or "")) if scope.get("type") == "http" else None
        if rollout_id is None:
            await self.app(scope, receive, send)
            return
        with rollout_context(rollout_id):
            await self.app(scope, receive, send)


def install() -> None:
    """Wrap `ServerClient.request` and Gym's agent `setup_webserver` in this process (see the docstring)."""
    request = ServerClient.request
    setup_webserver = SimpleResponsesAPIAgent.setup_webserver

    @wraps(request)
    async def scoped_request(self: ServerClient, server_name: str, url_path: str, method: str, **kwargs: Any) -> Any:
        return await request(self, server_name, scoped_path(url_path, current_rollout_id()), method, **kwargs)

    @wraps(setup_webserver)
    def scoped_setup_webserver(self: SimpleResponsesAPIAgent) -> Any:
        app = setup_webserver(self)
        app.add_middleware(RolloutIdFromPath)
        return app

    ServerClient.request = scoped_request  # type: ignore[method-assign]
    SimpleResponsesAPIAgent.setup_webserver = scoped_setup_webserver  # type: ignore[method-assign]


def main() -> None:
    module = os.environ.get(MODULE_ENV)
    if not module:
        raise RolloutScopedLaunchError(f"${MODULE_ENV} must name the Gym agent module to run")
    install()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
