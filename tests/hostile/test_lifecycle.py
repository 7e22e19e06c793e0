"""Starting a daemon must never damage a live one or another directory.

A second ``kvsidecar serve`` is refused while a daemon serves the same runtime directory (or the
same control endpoint); on its way out it must leave the live daemon's sockets alone, so that new
clients still reach it. And a runtime directory that someone planted as a symbolic link (the
``/tmp/kvsidecar-<uid>`` fallback lives in a world-writable directory) is refused, never followed:
the daemon must not chmod, or bind its sockets in, whatever the link points to.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.node.config import Config
from kvsidecar.wire.protocol import Status, StatusReply
from tests.support import ROOT, python_env
from tests.support.daemons import config_env, daemon_process, make_config
from tests.support.raw import Raw

pytestmark = pytest.mark.timeout(120)

SERVE = [sys.executable, "-m", "kvsidecar.cli", "serve"]
CLIENT = [sys.executable, "-m", "tests.procs.uid_client"]
NOBODY = 65534


def _config_in(runtime_dir: str, **overrides: Any) -> Config:
    """The harness's test settings, in ``runtime_dir`` (which the test made itself)."""
    base = make_config()
    shutil.rmtree(base.runtime_dir, ignore_errors=True)
    fields = {"endpoint": "", "fd_socket": "", **overrides}
    return dataclasses.replace(base, runtime_dir=runtime_dir, **fields)


def _serve_once(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``kvsidecar serve``; one still serving after 30 s is stopped and counts as started."""
    try:
        return subprocess.run(
            SERVE, env=env, cwd=ROOT, capture_output=True, text=True, timeout=30, check=False
        )
    except subprocess.TimeoutExpired as exc:  # run() killed it
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
        return subprocess.CompletedProcess(SERVE, 0, "", "still serving after 30 s\n" + err)


def _reachable(endpoint: str) -> bool:
    with Raw(endpoint) as raw:
        try:
            return isinstance(raw.call(Status(id=1), timeout=5), StatusReply)
        except TimeoutError:
            return False


def test_refused_second_serve_leaves_the_live_daemon_reachable() -> None:
    with daemon_process(make_config()) as live:
        cfg = live.config
        second = _serve_once(config_env(cfg))
        assert second.returncode != 0, second.stderr
        assert "already" in second.stderr, second.stderr
        assert stat.S_ISSOCK(os.lstat(cfg.ipc_path or "").st_mode), "control socket deleted"
        assert stat.S_ISSOCK(os.lstat(cfg.fd_socket).st_mode), "fd socket deleted"
        assert _reachable(cfg.endpoint), "a new client cannot reach the live daemon"
        assert live.proc.poll() is None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_refused_second_serve_leaves_the_live_daemons_directory_as_it_is() -> None:
    """The live daemon's directory opened up for another allowed uid (0711, sockets 0666): a
    refused second ``serve`` must not re-mode it, nor touch its sockets or lock file, so that
    the other uid still reaches the live daemon."""
    config = make_config(allowed_uids=f"{os.geteuid()},{NOBODY}")
    with daemon_process(config) as live:
        cfg = live.config
        paths = [cfg.runtime_dir, cfg.ipc_path or "", cfg.fd_socket]
        os.chmod(paths[0], 0o711)
        for sock in paths[1:]:
            os.chmod(sock, 0o666)
        lock = os.path.join(cfg.runtime_dir, "daemon.lock")
        before = {p: os.lstat(p) for p in [*paths, lock]}
        listing = sorted(os.listdir(cfg.runtime_dir))
        second = _serve_once(config_env(cfg))
        assert second.returncode != 0, second.stderr[-2000:]
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert lines and "already serves" in lines[-1], second.stderr[-2000:]
        after = {p: os.lstat(p) for p in before}
        for path, st in before.items():
            was = (stat.S_IMODE(st.st_mode), st.st_ino, st.st_uid, st.st_mtime_ns)
            now = (
                stat.S_IMODE(after[path].st_mode),
                after[path].st_ino,
                after[path].st_uid,
                after[path].st_mtime_ns,
            )
            assert was == now, f"{path}: {was} -> {now}"
        assert sorted(os.listdir(cfg.runtime_dir)) == listing
        out = subprocess.run(
            [*CLIENT, str(NOBODY), cfg.endpoint, cfg.fd_socket],
            cwd=ROOT,
            env=python_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        reached = json.loads(out.stdout.strip().splitlines()[-1])
        assert (reached["zmq"], reached["fd"]) == ("HelloReply", "open"), reached
        assert live.proc.poll() is None


def test_second_daemon_on_the_same_endpoint_is_refused() -> None:
    """Another runtime dir (another fd socket), the live daemon's control socket: refused too."""
    with daemon_process(make_config()) as live:
        other = tempfile.mkdtemp(prefix="kvs-", dir="/tmp")
        try:
            env = config_env(_config_in(other, endpoint=live.config.endpoint))
            second = _serve_once(env)
            assert second.returncode != 0, second.stderr[-2000:]
            assert _reachable(live.config.endpoint), "the second daemon took the endpoint"
        finally:
            shutil.rmtree(other, ignore_errors=True)


def test_planted_symlink_runtime_dir_is_refused_not_followed() -> None:
    shared = Path(tempfile.mkdtemp(prefix="kvs-tmp-", dir="/tmp"))
    try:
        os.chmod(shared, 0o1777)  # like /tmp: anyone may plant an entry
        victim = shared / "victim"
        victim.mkdir(mode=0o755)
        os.chmod(victim, 0o755)
        link = shared / "kvsidecar-0"
        link.symlink_to(victim)
        os.lchown(link, NOBODY, NOBODY)  # planted by another user
        cfg = _config_in(str(link))
        second = _serve_once(config_env(cfg))
        assert second.returncode != 0, second.stderr[-2000:]
        assert "link" in second.stderr, second.stderr[-2000:]
        assert stat.S_IMODE(victim.stat().st_mode) == 0o755, "the link's target was re-moded"
        assert list(victim.iterdir()) == [], "the daemon put sockets in the link's target"
    finally:
        shutil.rmtree(shared, ignore_errors=True)
