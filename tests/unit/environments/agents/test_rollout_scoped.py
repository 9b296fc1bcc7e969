"""The runner that carries the rollout prefix for Gym agents whose model calls drop it (langgraph flavours)."""

from __future__ import annotations

import asyncio

import pytest

from nemo_gym.rollout_correlation import current_rollout_id, rollout_context
from nemo_rl.environments import nemo_gym_launch as launch
from nemo_rl.environments.agents import rollout_scoped
from nemo_rl.environments.agents.rollout_scoped import RolloutIdFromPath, rollout_id_in_path, scoped_path


def test_model_routes_in_a_rollout_get_the_capture_prefix() -> None:
    assert scoped_path("/v1/responses", "r-1") == "/ng-rollout/r-1/training-token-capture/v1/responses"
    assert scoped_path("/v1/chat/completions", "r-1") == "/ng-rollout/r-1/training-token-capture/v1/chat/completions"


@pytest.mark.parametrize(
    ("path", "rollout_id"),
    [
        ("/v1/responses", None),  # outside a rollout
        ("/v1/responses", ""),
        ("/seed_session", "r-1"),  # resources-server routes keep their path
        ("/verify", "r-1"),
        ("/ng-rollout/r-1/training-token-capture/v1/responses", "r-1"),  # already prefixed
        ("/ng-rollout/other/v1/responses", "r-1"),
    ],
)
def test_other_paths_and_calls_outside_a_rollout_are_unchanged(path: str, rollout_id: str | None) -> None:
    assert scoped_path(path, rollout_id) == path


def test_the_rollout_id_is_read_from_a_prefixed_path_only() -> None:
    assert rollout_id_in_path("/ng-rollout/r-1/training-token-capture/v1/responses") == "r-1"
    assert rollout_id_in_path("/ng-rollout/r-2/v1/responses") == "r-2"
    assert rollout_id_in_path("/v1/responses") is None and rollout_id_in_path("/ng-rollout/") is None


def test_a_prefixed_request_is_served_inside_its_rollout_context_with_its_path_unchanged() -> None:
    seen: list[tuple[str | None, str]] = []

    async def app(scope, receive, send):
        seen.append((current_rollout_id(), scope["path"]))

    middleware = RolloutIdFromPath(app)
    path = "/ng-rollout/r-9/training-token-capture/v1/responses"
    asyncio.run(middleware({"type": "http", "path": path}, None, None))
    asyncio.run(middleware({"type": "http", "path": "/run"}, None, None))
    assert seen == [("r-9", path), (None, "/run")]


def test_install_wraps_gyms_client_so_calls_in_a_rollout_carry_the_prefix(monkeypatch) -> None:
    from nemo_gym.base_responses_api_agent import SimpleResponsesAPIAgent
    from nemo_gym.server_utils import ServerClient

    sent: list[str] = []

    async def fake_request(self, server_name, url_path, method, **kwargs):
        sent.append(url_path)

    monkeypatch.setattr(ServerClient, "request", fake_request)
    monkeypatch.setattr(SimpleResponsesAPIAgent, "setup_webserver", SimpleResponsesAPIAgent.setup_webserver)
    rollout_scoped.install()
    client = object.__new__(ServerClient)

    async def calls() -> None:
        await ServerClient.post(client, server_name="policy_model", url_path="/v1/responses")
        with rollout_context("r-3"):
            await ServerClient.post(client, server_name="policy_model", url_path="/v1/responses")
            await ServerClient.post(client, server_name="rs", url_path="/verify")

    asyncio.run(calls())
    assert sent == ["/v1/responses", "/ng-rollout/r-3/training-token-capture/v1/responses", "/verify"]


def test_the_runner_needs_its_module_and_the_launcher_names_the_same_variable(monkeypatch) -> None:
    assert launch.ROLLOUT_SCOPED_MODULE_ENV == rollout_scoped.MODULE_ENV
    assert launch.ROLLOUT_SCOPED_MODULE == rollout_scoped.__name__
    monkeypatch.delenv(rollout_scoped.MODULE_ENV, raising=False)
    with pytest.raises(rollout_scoped.RolloutScopedLaunchError, match="NRL_ROLLOUT_SCOPED_MODULE must name"):
        rollout_scoped.main()
