"""The fd channel cannot exhaust the daemon's descriptors, and their shortage punishes nobody.

Attacks from outside the client: a hoarder process (`tests.procs.attacker`, raw Unix sockets
with SCM_RIGHTS) that opens hundreds of connections, sends thousands of fds it never claims and
leaves half-open connections; and a daemon process whose ``RLIMIT_NOFILE`` the test lowers under
it (``prlimit``), so that the kernel truncates a worker's message and ``accept`` meets EMFILE.
Careful: while the daemon is out of descriptors no new ZeroMQ connection may reach it, since
libzmq 4.3 aborts the process when its ipc listener meets EMFILE (docs/reliability.md).
"""

from __future__ import annotations

import os
import resource
import socket
import time

import pytest
import torch

from kvsidecar.client import SidecarClient, SidecarError
from kvsidecar.memory import allocate_kv_caches
from tests.support.attack import Attacker, defence_events
from tests.support.children import WorkerProcess
from tests.support.daemons import daemon_process, make_config

pytestmark = pytest.mark.timeout(150)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def set_nofile(pid: int, soft: int) -> None:
    _, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))


def test_fd_hoarder_cannot_take_the_daemons_descriptors() -> None:
    """One process opens 300 connections with 4 x 200 unclaimed fds each and 20 half-open ones,
    and keeps connecting, against a daemon limited to 1024 descriptors: the daemon keeps its
    reserve, a worker registers meanwhile, and everything the hoarder holds is closed after
    ``fd_unclaimed_s`` (its idle connections a third of that later)."""
    config = make_config(lease_s=30.0, fd_unclaimed_s=3.0)
    with daemon_process(config) as d:
        pid = d.proc.pid
        set_nofile(pid, 1024)
        baseline = open_fds(pid)
        lines_before = len(d.log().splitlines())
        hoard = Attacker(
            {
                "attack": "fd_hoard",
                "path": config.fd_socket,
                "connections": 300,
                "fds": 200,
                "messages": 4,
                "half_open": 20,
                "reconnect_s": 2.0,
            }
        )
        try:
            peak = open_fds(pid)
            worker = WorkerProcess(
                {
                    "endpoint": config.endpoint,
                    "engine": "honest",
                    "layers": 2,
                    "blocks": 8,
                    "block_size": 4,
                    "heads": 2,
                    "head_size": 8,
                    "seed": 3,
                }
            )
            try:
                worker.wait_ready(60)  # registered while the hoarder holds what it may
                time.sleep(config.fd_unclaimed_s * 4 / 3 + 2.0)  # expiry, idle close, a sweep
                after = open_fds(pid)
                with SidecarClient(config.endpoint, heartbeat=False) as c:
                    engines = [e.engine_id for e in c.status().engines]
                    events = defence_events(c.daemon.metrics_port)
                counts = hoard.finish()
            finally:
                worker.stop()
        finally:
            hoard.stop()
        alive = d.proc.poll() is None
        log_lines = len(d.log().splitlines()) - lines_before
    print(
        f"\nfd hoard: {counts}; daemon fds {baseline} -> peak {peak} -> {after} after expiry; "
        f"{log_lines} log lines"
    )
    assert alive, "the daemon died"
    assert engines == ["honest"], engines
    assert counts["sent"] > 0 and counts["connections"] > 64, counts
    assert peak <= 1024 - 200, f"the hoarder took the daemon to {peak} of 1024 descriptors"
    assert counts["kept"] == 0, f"{counts['kept']} hoarder connections still open"
    assert after <= baseline + 8, f"daemon fds {baseline} -> {after}: the hoard was not released"
    assert log_lines < 100, f"{log_lines} log lines"
    fd = {event: n for (plane, event), n in events.items() if plane == "fd_channel"}
    assert fd["refused_connections"] + fd["refused_deliveries"] > 0, fd  # per-process limits
    # Released by expiry, idle close or eviction (which one depends on the descriptor budget).
    assert fd["expired_deliveries"] + fd["idle_closed"] + fd["evicted"] > 0, fd


def _register(c: SidecarClient, engine: str, layers: int) -> None:
    # One storage per layer: a registration with ``layers`` fds.
    caches = {
        f"l{i}": allocate_kv_caches(1, (2, 4, 4, 2, 8), torch.float16)[0] for i in range(layers)
    }
    c.register_kv_caches(caches, engine_id=engine)


def test_descriptor_shortage_punishes_nobody_and_does_not_spin() -> None:
    """The daemon runs out of descriptors under a worker: its next registration's message comes
    truncated (MSG_CTRUNC). That registration fails alone with ``busy``; the worker's first
    registration and its connection stay. Then ``accept`` meets EMFILE with connections waiting:
    the daemon backs off instead of spinning and logging; once descriptors are back, the same
    client registers and new workers connect."""
    config = make_config(lease_s=30.0)
    with daemon_process(config) as d, SidecarClient(config.endpoint, heartbeat=False) as c:
        pid = d.proc.pid
        _register(c, "first", 1)
        set_nofile(pid, open_fds(pid) + 1)  # room for one fd: the next two-fd message truncates
        t0 = time.monotonic()
        with pytest.raises(SidecarError) as info:
            _register(c, "second", 2)
        refused_after = time.monotonic() - t0
        still = [e.engine_id for e in c.status().engines]  # same connection: no new fd needed

        set_nofile(pid, open_fds(pid))  # not one fd left: accept meets EMFILE
        waiting = []
        for _ in range(8):  # connections that wait in the listener's backlog
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            s.connect_ex(config.fd_socket)
            waiting.append(s)
        lines_before, cpu_before = len(d.log().splitlines()), cpu_seconds(pid)
        time.sleep(2.0)
        cpu = (cpu_seconds(pid) - cpu_before) / 2.0
        lines = len(d.log().splitlines()) - lines_before

        set_nofile(pid, 4096)
        for s in waiting:
            s.close()
        _register(c, "second", 2)  # the same client, the same connection: served again
        with SidecarClient(config.endpoint, heartbeat=False) as fresh:
            engines = sorted(e.engine_id for e in fresh.status().engines)
        alive = d.proc.poll() is None
    print(
        f"\nfd shortage: truncated registration refused with {info.value.code} in "
        f"{refused_after * 1e3:.0f} ms; at EMFILE for 2 s: daemon CPU {cpu:.0%}, {lines} log lines"
    )
    assert alive, "the daemon died"
    assert info.value.code == "busy", info.value
    assert still == ["first"], f"the victim's other registration went: {still}"
    assert refused_after < config.fd_wait_s, "the refusal waited for the fd timeout"
    assert cpu < 0.5, f"the daemon spun at {cpu:.0%} CPU on EMFILE"
    assert lines < 10, f"{lines} log lines in 2 s at EMFILE"
    assert engines == ["first", "second"], engines


def test_a_thousand_zmq_connections_do_not_abort_the_daemon() -> None:
    """1,100 DEALER sockets from one process against a daemon limited to 1024 descriptors:
    libzmq's ipc listener aborts the process at EMFILE, so the daemon must refuse connections
    before that. It stays alive, and a client of another process is still served."""
    config = make_config()
    with daemon_process(config) as d:
        pid = d.proc.pid
        set_nofile(pid, 1024)
        attack = Attacker(
            {"attack": "many_connections", "endpoint": config.endpoint, "count": 1100}
        )
        try:
            held = open_fds(pid)
            t0 = time.monotonic()
            # The refused sockets reconnect every 100 ms: each costs an accept and a ZAP answer,
            # so a new connection waits its turn behind them (existing ones do not).
            with SidecarClient(config.endpoint, heartbeat=False, timeout_s=20) as c:
                engines = c.status().engines
                connect_s = time.monotonic() - t0
                events = defence_events(c.daemon.metrics_port)
            counts = attack.finish()
        finally:
            attack.stop()
        alive = d.proc.poll() is None
    print(
        f"\n1,100 connections: {counts}; daemon fds {held}; a new client served in "
        f"{connect_s:.2f} s; refusals {events}"
    )
    assert alive, "the daemon died"
    assert engines == []
    assert held < 1024 - 100, f"the daemon holds {held} of 1024 descriptors"
    # At most its share served (how many depends on how many were counted in flight at once).
    assert counts["answered"] <= 256, counts
    assert events[("control", "refused_connections")] > 0, events
