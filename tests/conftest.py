"""Session-wide test settings (applied before any test module imports Ray)."""

import os

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# As nemo_rl/__init__.py does for a driver without RAY_ADDRESS: Ray reads this once, at import, and
# a test module may import ray before nemo_rl. With it, clusters the tests start bind 127.0.0.1.
if not os.environ.get("RAY_ADDRESS"):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
