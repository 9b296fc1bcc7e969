"""Session-wide test settings (applied before any test module imports Ray)."""

import os

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
