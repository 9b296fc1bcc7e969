"""A Gym agent that compacts its history mid-rollout: a real compacting harness for the yield tests.

Real harnesses rewrite their conversation mid-rollout (old tool calls replaced by a summary), so
a later call's parent cannot be resolved and our gate must open a branch instead of poisoning
the rollout. Gym's own compacting agent needs a model server with its compaction contract; this
one works against any `/v1/responses` server. `CompactingAgent` subclasses Gym's `SimpleAgent`
and overrides only `_create_episode`: after `compact_after_tool_results` tool results the
history becomes the original input plus ONE user message summarising every tool call so far.
The returned response is the last model response with every item the rollout produced, in order.
Not supported: agent sessions and trajectory observability.
See docs/design-docs/gym-environment.md, "The compacting agent".
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field, ValidationError

from nemo_gym.openai_utils import (
    NeMoGymEasyInputMessage,
    NeMoGymFunctionCallOutput,
    NeMoGymResponse,
    NeMoGymResponseCreateParamsNonStreaming,
    accumulate_response_usage,
)
from nemo_gym.server_utils import get_response_json, raise_for_status
from responses_api_agents.simple_agent.app import SimpleAgent, SimpleAgentConfig

SUMMARY_PREFIX = "Summary of the work so far: "
SUMMARY_SUFFIX = " Continue."
_KEPT_ROLES = ("system", "developer", "user")


class CompactingAgentConfig(SimpleAgentConfig):
    compact_after_tool_results: int = Field(
        default=1,
        ge=1,
        description="Replace the conversation with a compacted one after every this many tool results.",
    )


def _field(item: Any, name: str) -> Any:
    return item.get(name) if isinstance(item, Mapping) else getattr(item, name, None)


def _is_kept_input(item: Any) -> bool:
    # A message item (type "message" or an easy message without a type) from system/developer/user.
    return _field(item, "role") in _KEPT_ROLES and _field(item, "type") in (None, "message")


def summary_text(history: Sequence[Any]) -> str:
    """One sentence per tool call in `history`, each paired with its output by `call_id`."""
    outputs = {
        _field(item, "call_id"): _field(item, "output")
        for item in history
        if _field(item, "type") == "function_call_output"
    }
    parts = []
    for item in history:
        if _field(item, "type") != "function_call":
            continue
        call = f"{_field(item, 'name')}({_field(item, 'arguments')})"
        result = outputs.get(_field(item, "call_id"))
        if not isinstance(result, str):
            result = "no result" if result is None else json.dumps(result)
        parts.append(f"you called {call} and it returned {result}")
    body = "; then ".join(parts) if parts else "no tool has been called yet"
    return f"{SUMMARY_PREFIX}{body}.{SUMMARY_SUFFIX}"


def compact_history(original_input: Sequence[Any], history: Sequence[Any]) -> list[Any]:
    """The compacted conversation (pure).

    `original_input` is the rollout's request input, `history` every item produced since (model
    outputs and tool outputs, uncompacted). Kept: the original system/developer/user messages,
    as they are; then one user message summarising every tool call in `history`.
    """
    kept = [item for item in original_input if _is_kept_input(item)]
    return [*kept, NeMoGymEasyInputMessage(role="user", content=summary_text(history))]


class CompactingAgent(SimpleAgent):
    config: CompactingAgentConfig

    async def _create_episode(
        self,
        body: NeMoGymResponseCreateParamsNonStreaming,
        *,
        model_url_path: str,
        resources_server_cookies: Any = None,
        tool_access: Any = None,
        in_session: bool = False,
        execute_tools: bool = True,
        invocation_id: str = "root",
        task_id: str = "unscoped",
        rollout_id: str = "unscoped",
        collect_trajectory: bool = False,
    ) -> tuple[NeMoGymResponse, None, Any, Any]:
        if in_session or tool_access is not None:
            raise RuntimeError("CompactingAgent supports only the /run route, not agent sessions or tool grants")
        body = body.model_copy(deep=True)
        if isinstance(body.input, str):
            body.input = [NeMoGymEasyInputMessage(role="user", content=body.input)]
        original_input = list(body.input)

        conversation = list(original_input)  # what the next model call carries
        produced: list[Any] = []  # every item the rollout produced, never compacted
        since_compaction = 0
        usage = None
        model_server_cookies = None
        step = 0
        while True:
            step += 1
            raw = await self.server_client.post(
                server_name=self.config.model_server.name,
                url_path=model_url_path,
                json=body.model_copy(update={"input": conversation}),
                cookies=model_server_cookies,
            )
            await raise_for_status(raw)
            raw_json = await get_response_json(raw)
            model_server_cookies = raw.cookies
            try:
                model_response = NeMoGymResponse.model_validate(raw_json)
            except ValidationError as e:
                raise RuntimeError(f"Received an invalid response from model server: {json.dumps(raw_json)}") from e
            output = list(model_response.output)
            produced.extend(output)
            conversation.extend(output)
            usage = accumulate_response_usage(usage, model_response.usage)
            model_response.usage = None

            if model_response.incomplete_details:
                break
            calls = [item for item in output if item.type == "function_call"]
            if not calls:
                if not any(item.type == "message" and item.role == "assistant" for item in output):
                    model_response.status = "incomplete"
                break
            if not execute_tools:
                break

            for call in calls:
                tool_output, resources_server_cookies = await self._call_tool(call, resources_server_cookies)
                result = NeMoGymFunctionCallOutput(
                    type="function_call_output", call_id=call.call_id, output=tool_output
                )
                produced.append(result)
                conversation.append(result)
                since_compaction += 1

            if since_compaction >= self.config.compact_after_tool_results:
                conversation = compact_history(original_input, produced)
                since_compaction = 0

            if self.config.max_steps and step >= self.config.max_steps:
                break

        model_response.output = produced
        model_response.usage = usage
        return model_response, None, model_server_cookies, resources_server_cookies

    async def _call_tool(self, call: Any, cookies: Any) -> tuple[str, Any]:
        """Run one function call on the resources server; returns (tool output text, cookies)."""
        try:
            arguments = json.loads(call.arguments)
        except (json.JSONDecodeError, TypeError) as e:
            return json.dumps({"error": f"Invalid tool call arguments: {e!r}"}), cookies
        if self.config.resources_server is None:
            raise RuntimeError("CompactingAgent received a tool call but has no resources_server configured")
        response = await self.server_client.post(
            server_name=self.config.resources_server.name,
            url_path=f"/{call.name}",
            json=arguments,
            cookies=cookies,
        )
        text = (await response.content.read()).decode()
        merged = dict(cookies or {})
        merged.update({str(k): str(getattr(v, "value", v)) for k, v in response.cookies.items()})
        return text, merged


if __name__ == "__main__":
    CompactingAgent.run_webserver()
