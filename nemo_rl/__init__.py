"""Exact-token capture for agentic GRPO, laid out like NeMo-RL."""

import os

# Ray 2.60 re-runs every worker through `uv run` (rebuilding a venv per job from an upload of the
# working dir) when the driver was started by `uv run`. Our actors pick their interpreter
# explicitly (flavored venvs), so that hook only costs minutes and disk; it must be off before
# `ray` is imported.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

# A private single-machine cluster (no RAY_ADDRESS from a launcher) binds every Ray socket (GCS,
# raylet, agents, this driver's own gRPC servers) to 127.0.0.1: Ray reads this flag once, when
# `ray` is first imported, so it is set here, before any module of this package imports ray. A
# launcher that joins the driver to a cluster sets RAY_ADDRESS and the flag stays Ray's default.
if not os.environ.get("RAY_ADDRESS"):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
