"""Exact-token capture for agentic GRPO, laid out like NeMo-RL."""

import os

# Ray 2.60 re-runs every worker through `uv run` (rebuilding a venv per job from an upload of the
# working dir) when the driver was started by `uv run`. Our actors pick their interpreter
# explicitly (flavored venvs), so that hook only costs minutes and disk; it must be off before
# `ray` is imported.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
