"""Warnings a run must not log, found in its output: Ray's blocked event loop, vLLM's raw prompts.

Contract:
- Ray logs `RAY_BLOCKING_GET_WARNING` once per actor process, the first time a blocking `ray.get`
  runs inside an async actor (also from a thread of that actor). The actor's log file holds it;
  with `log_to_driver` the driver's output carries it too, prefixed by the actor
  (`(VllmGenerationWorker pid=123) Using blocking ...`).
- `blocking_get_warnings` returns those lines; `actor_lines` returns an actor's forwarded lines, so
  a caller can show the actors' output reached the text at all before trusting an empty answer.
- `tests/unit/distributed/test_blocking_get_warning.py` builds the warning with a real async actor,
  so a Ray upgrade that rewords it fails there instead of silencing this check.
- `raw_prompt_warnings`: vLLM's deprecation of raw prompts, logged once per worker that passes one;
  `vllm_main_process_warnings` shows vLLM's warnings from the worker's own process reached the text.
- `reload_failed_warnings`: vLLM's "<Layer>: Failed to load weights" from a refit; the worker keeps
  the rotary embedding's (benign) one out of the log, so a run that refits must show none.
"""

from __future__ import annotations

RAY_BLOCKING_GET_WARNING = "Using blocking ray.get inside async actor"
VLLM_RAW_PROMPT_WARNING = "Passing raw prompts to InputProcessor is deprecated"
VLLM_RELOAD_FAILED = ": Failed to load weights"
VLLM_MAIN_PROCESS = "(MainProcess pid="  # vLLM's prefix on its log lines in the actor's own process


def blocking_get_warnings(text: str) -> list[str]:
    """The lines of `text` that carry Ray's blocking-get warning."""
    return [line for line in text.splitlines() if RAY_BLOCKING_GET_WARNING in line]


def actor_lines(text: str, actor_class: str) -> list[str]:
    """The lines of `text` forwarded from an actor of `actor_class` (Ray's `(<class> pid=N)` prefix)."""
    prefix = f"({actor_class} pid="
    return [line for line in text.splitlines() if prefix in line]


def raw_prompt_warnings(text: str) -> list[str]:
    """The lines of `text` where vLLM says it was handed a raw prompt, not a rendered engine input."""
    return [line for line in text.splitlines() if VLLM_RAW_PROMPT_WARNING in line]


def vllm_main_process_warnings(text: str) -> list[str]:
    """vLLM's WARNING lines from a generation worker's own process (where the raw-prompt warning would be)."""
    return [line for line in text.splitlines() if VLLM_MAIN_PROCESS in line and " WARNING " in line]


def reload_failed_warnings(text: str) -> list[str]:
    """The lines of `text` where vLLM's layerwise reload says a layer got no weights."""
    return [line for line in text.splitlines() if VLLM_RELOAD_FAILED in line and "[layerwise.py" in line]
