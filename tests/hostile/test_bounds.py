"""Bounds that are bounds: no setting or request field of infinity or NaN switches a limit off.

A daemon refuses to start with a non-finite time or size (one clear line on the command line);
a publish's lease is at most the daemon's ``peer_lease_s``, and a lease or a pull timeout of
infinity or NaN is refused with ``invalid_message``, the daemon serving on.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest
import torch

from kvsidecar.client import SidecarClient, SidecarError
from kvsidecar.memory import allocate_kv_caches
from kvsidecar.node.config import ConfigError
from kvsidecar.node.settings import SETTINGS
from tests.support.daemons import StartDaemon, make_config

pytestmark = pytest.mark.timeout(120)

FLOAT_SETTINGS = [s.name for s in SETTINGS if s.type is float]


@pytest.mark.parametrize("name", FLOAT_SETTINGS)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_non_finite_setting_is_refused(name: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"{name} must be a number from"):
        make_config(**{name: value})


def test_serve_with_an_infinite_lease_exits_with_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvsidecar.cli", "serve", "--lease-s", "inf"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "lease_s must be a number from 0.01 to 86400, not inf" in done.stderr
    assert "Traceback" not in done.stderr


def test_publish_leases_and_pull_timeouts_are_bounded(daemon_factory: StartDaemon) -> None:
    daemon = daemon_factory(host_pool_bytes=8 << 20, peer_lease_s=0.5)
    caches = allocate_kv_caches(2, (2, 8, 4, 2, 8), torch.float32)
    with SidecarClient(daemon.config.endpoint, name="p") as client:
        client.register_kv_caches({f"l{i}": t for i, t in enumerate(caches)}, engine_id="p")
        client.take_peer_events("p")
        for bad in (math.inf, math.nan):
            with pytest.raises(SidecarError) as info:
                client.publish("p", "r", [1], lease_s=bad)
            assert info.value.code == "invalid_message"
            with pytest.raises(SidecarError) as info:
                client.pull("p", "", "p", {"x": ([1], [2])}, timeout_s=bad)
            assert info.value.code == "invalid_message"
        # A lease asked far beyond the daemon's ends with the daemon's.
        client.publish("p", "long", [1, 2], lease_s=1e9)
        deadline = time.monotonic() + 5
        events = []
        while time.monotonic() < deadline and not events:
            events = client.take_peer_events("p")
            time.sleep(0.05)
        assert [e.expired_sending for e in events] == [frozenset({"long"})]
        assert client.status().engines  # serving on
