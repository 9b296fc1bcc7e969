"""Session-wide test settings (applied before any test module imports Ray).

Hypothesis profile `ci` (`.ci/run` passes `--hypothesis-profile=ci`): `derandomize=True`, so
every run draws the same examples and a red CI run is red again on the same commit, anywhere
(`python3 -m uv run pytest --hypothesis-profile=ci <test id>`); no example database, so a run
never depends on one a previous run left behind; the failing example's reproduction blob is
printed. Without the flag, Hypothesis's own default profile explores randomly (a developer's run).

Timeouts (pytest-timeout): every test gets `timeout` from pyproject.toml; a test marked
`integration` gets `INTEGRATION_TIMEOUT_S` instead, unless it has its own `@pytest.mark.timeout`.
That is above every real-stack test's own subprocess/fixture deadline (the longest, the L1 script's,
is 2400 s), so those deadlines fail first with their named message, and pytest-timeout catches
only a hang nothing else bounds.
"""

import os

import pytest
from hypothesis import settings

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# As nemo_rl/__init__.py does for a driver without RAY_ADDRESS: Ray reads this once, at import, and
# a test module may import ray before nemo_rl. With it, clusters the tests start bind 127.0.0.1.
if not os.environ.get("RAY_ADDRESS"):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)

INTEGRATION_TIMEOUT_S = 3000


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("integration") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(INTEGRATION_TIMEOUT_S))
