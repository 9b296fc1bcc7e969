"""The worker's `/tokenize` route (off the rollout path: no rollout calls it; scripts and tests do).

`tokenize(service, body)` answers as stock vLLM's `/tokenize`: a chat body (`messages`, optional
`tools`) is rendered through the model's chat template with the generation prompt, exactly as the
chat route renders a ROOT prompt; a `prompt` string is encoded without special tokens. Bad input is
an `ApiError` 400 naming the field. See docs/design-docs/vllm-worker-capture.md ("The actor shell").
"""

from __future__ import annotations

from typing import Any

from nemo_rl.data.calls import RequestFieldError, check_chat_request
from nemo_rl.data.errors import ApiError
from nemo_rl.models.generation.vllm.engine import InvalidChatRequest
from nemo_rl.models.generation.vllm.serving import ChatService, chat_tools, normalize_messages


def tokenize(service: ChatService, body: Any, *, max_model_len: int) -> dict:
    """`{"tokens", "count"}` of the body's chat (or prompt) as the chat route would render it."""
    if not isinstance(body, dict):
        raise ApiError("invalid_request", "request body must be a JSON object", param="body")
    try:
        if "messages" in body:
            check_chat_request({"messages": body["messages"], "tools": body.get("tools")}, max_model_len=max_model_len)
            ids = service.render_root(normalize_messages(body["messages"]), chat_tools(body.get("tools")))
        elif isinstance(body.get("prompt"), str):
            ids = service.tokenizer.encode(body["prompt"], add_special_tokens=False)
        else:
            raise RequestFieldError("messages", "tokenize needs `messages` (chat) or `prompt` (a string)")
    except RequestFieldError as e:
        raise ApiError("invalid_request", e.message, param=e.field) from e
    except InvalidChatRequest as e:
        raise ApiError("invalid_request", str(e)) from e
    return {"tokens": ids, "count": len(ids)}
