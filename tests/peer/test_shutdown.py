"""A drained daemon exits 0 with every data plane, a NIXL agent made or not.

The libraries the NIXL wheel bundles crash in their exit handlers (SIGSEGV in libnl-route's
destructors, whatever was done with the agent first: `kvsidecar.peer.process_exit`), so a daemon
that made an agent, at start or at its first pull, drained on SIGTERM and was reported killed by
signal 11: systemd marks the unit failed, Kubernetes counts a crash. Each case here starts a real
daemon process (both entry points), stops it with SIGTERM, and requires exit status 0 and the
log's last word from the daemon.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from kvsidecar.client import SidecarClient
from kvsidecar.peer.nixl_plane import nixl_available
from tests.support import ROOT
from tests.support.daemons import DaemonProcess, config_env, peer_config
from tests.support.ports import tcp_endpoint

pytestmark = pytest.mark.timeout(120)

NIXL = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")

CASES = [
    pytest.param({"peer_data_plane": "zmq"}, False, id="zmq"),
    # The default plane: no agent unless the peers are trusted (docs/reliability.md).
    pytest.param({"peer_data_plane": "auto"}, False, id="auto"),
    pytest.param(
        {"peer_data_plane": "auto", "peer_nixl_trusted": True}, True, id="auto-trusted", marks=NIXL
    ),
    pytest.param(
        {"peer_data_plane": "nixl", "peer_nixl_trusted": True}, True, id="nixl", marks=NIXL
    ),
    # No peer endpoint: the agent is made at the first pull.
    pytest.param(
        {"peer_data_plane": "auto", "peer_nixl_trusted": True, "peer_endpoint": ""},
        True,
        id="auto-trusted-agent-at-first-pull",
        marks=NIXL,
    ),
]


def _pull_somewhere(endpoint: str) -> None:
    """A pull to an endpoint where nothing listens: it makes the NIXL agent first, then fails."""
    with SidecarClient(endpoint, timeout_s=30, heartbeat=False) as client:
        import torch

        from kvsidecar.memory import allocate_kv_caches

        caches = allocate_kv_caches(1, (2, 8, 4, 2, 8), torch.float16)
        client.register_kv_caches({"l0": caches[0]}, engine_id="c")
        out = client.pull("c", tcp_endpoint(), "p", {"r": ([1], [1])}, tp_rank=0, timeout_s=3)
        assert out.failed == ["r"], out


@pytest.mark.parametrize(("settings", "agent"), CASES)
def test_a_drained_daemon_exits_0(settings: dict[str, Any], agent: bool) -> None:
    daemon = DaemonProcess(peer_config(**settings))
    try:
        daemon.wait_ready()
        if settings.get("peer_endpoint") == "":
            _pull_somewhere(daemon.config.endpoint)
        time.sleep(0.3)
        code = daemon.stop()
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait(5)
        log = daemon.log()
        shutil.rmtree(daemon.config.runtime_dir, ignore_errors=True)
    assert code == 0, f"exit status {code}:\n{log[-2000:]}"
    assert ("Initialized NIXL agent" in log) == agent, log[-2000:]
    assert log.rstrip().splitlines()[-1].endswith("kvsidecar stopped"), log[-2000:]


@NIXL
def test_kvsidecar_serve_with_a_nixl_agent_exits_0_on_sigterm() -> None:
    config = peer_config(peer_data_plane="nixl", peer_nixl_trusted=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvsidecar.cli", "serve"],
        env=config_env(config),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                SidecarClient(config.endpoint, timeout_s=0.5, heartbeat=False).close()
                break
            except Exception:
                time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        shutil.rmtree(config.runtime_dir, ignore_errors=True)
    assert "Initialized NIXL agent" in out, out[-2000:]
    assert proc.returncode == 0, f"exit status {proc.returncode}:\n{out[-2000:]}"
