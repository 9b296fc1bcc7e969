"""Ray's warning that an async actor blocked its event loop, found in a run's output.

Contract:
- Ray logs `RAY_BLOCKING_GET_WARNING` once per actor process, the first time a blocking `ray.get`
  runs inside an async actor (also from a thread of that actor). The actor's log file holds it;
  with `log_to_driver` the driver's output carries it too, prefixed by the actor
  (`(VllmGenerationWorker pid=123) Using blocking ...`).
- `blocking_get_warnings` returns those lines; `actor_lines` returns an actor's forwarded lines, so
  a caller can show the actors' output reached the text at all before trusting an empty answer.
- `tests/unit/distributed/test_blocking_get_warning.py` builds the warning with a real async actor,
  so a Ray upgrade that rewords it fails there instead of silencing this check.
"""

from __future__ import annotations

RAY_BLOCKING_GET_WARNING = "Using blocking ray.get inside async actor"


def blocking_get_warnings(text: str) -> list[str]:
    """The lines of `text` that carry Ray's blocking-get warning."""
    return [line for line in text.splitlines() if RAY_BLOCKING_GET_WARNING in line]


def actor_lines(text: str, actor_class: str) -> list[str]:
    """The lines of `text` forwarded from an actor of `actor_class` (Ray's `(<class> pid=N)` prefix)."""
    prefix = f"({actor_class} pid="
    return [line for line in text.splitlines() if prefix in line]
