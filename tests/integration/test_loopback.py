"""On the embedded single-machine default, what the run listens on (one stack start, shared).

`reliability_probe` lists every listening TCP socket of the driver and all its descendants (Ray's
daemons and workers, our actors, the vLLM engine core, the Gym server processes) and names each
socket's owner from the ports our servers report.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
OURS = {"vllm_worker_http", "gym_gate", "gym_resources", "gym_agent", "transfer_queue"}


def _sockets(report: dict, owners: set[str]) -> list[dict]:
    return [s for s in report["sockets"] if s["owner"] in owners]


def test_every_server_we_start_listens_only_on_loopback(reliability_probe):
    ours = _sockets(reliability_probe, OURS)
    assert {s["owner"] for s in ours} == OURS, reliability_probe["sockets"]
    assert [s for s in ours if s["ip"] not in LOOPBACK] == []
    assert reliability_probe["tq_bind_ips"] == ["127.0.0.1"]


def test_no_listener_outside_ray_is_unaccounted_for(reliability_probe):
    # Anything that is neither one of our servers nor Ray's (vLLM's engine core, a library's
    # metrics server, ...) must at least be loopback-only.
    unattributed = _sockets(reliability_probe, {"unattributed"})
    assert [s for s in unattributed if s["ip"] not in LOOPBACK] == []


def test_ray_listens_only_on_loopback(reliability_probe):
    ray = _sockets(reliability_probe, {"ray_daemon", "ray_worker", "driver"})
    assert ray, reliability_probe["sockets"]
    assert [s for s in ray if s["ip"] not in LOOPBACK] == []
