"""A daemon's NIXL agent does not spend a core while nothing moves.

NIXL's Python agent sets its UCX progress thread's poll timeout (``pthrDelay``) to 0: the thread
busy-polls a core for the agent's whole life. The daemon creates its agent with a timeout of
``peer_nixl_wakeup_ms`` (`kvsidecar.peer.nixl_plane.new_agent`), so that the thread sleeps on its
workers' event fds between transfers. Measured here on a real daemon process: its CPU time
over an idle second and a half, with the default and with 0 (NIXL's own busy poll, the control
that shows the measurement can tell the two apart). That pulls over NIXL still arrive, byte by
byte, is `tests/peer/test_pulls.py`'s part (its NIXL cases run with the default).
"""

from __future__ import annotations

import os
import time

import pytest

from kvsidecar.client import SidecarClient
from kvsidecar.peer.nixl_plane import WAKEUP_MS, nixl_available
from tests.support.daemons import peer_daemon

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"),
]

IDLE_S = 1.5


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of every thread of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize(
    ("wakeup_ms", "idle"),
    [(WAKEUP_MS, True), (0, False)],
    ids=["default wake-up: sleeps", "0: NIXL's busy poll"],
)
def test_an_idle_daemons_nixl_agent_sleeps(wakeup_ms: int, idle: bool) -> None:
    # peer_data_plane=nixl with a peer endpoint: the agent exists from the start (a daemon
    # whose agent fails exits instead of serving).
    with peer_daemon(
        peer_data_plane="nixl", peer_nixl_trusted=True, peer_nixl_wakeup_ms=wakeup_ms
    ) as daemon:
        with SidecarClient(daemon.config.endpoint, timeout_s=30) as client:
            client.status()
        time.sleep(0.5)  # start-up work done
        before = _cpu_seconds(daemon.proc.pid)
        time.sleep(IDLE_S)
        used = (_cpu_seconds(daemon.proc.pid) - before) / IDLE_S
    if idle:
        assert used < 0.15, f"an idle daemon used {used:.2f} of a core"
    else:
        assert used > 0.5, f"the busy-polling control used only {used:.2f} of a core"
