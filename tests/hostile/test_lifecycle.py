"""Starting a daemon must never damage a live one or another directory.

A second ``kvsidecar serve`` is refused while a daemon serves the same runtime directory (or the
same control endpoint); on its way out it must leave the live daemon's sockets alone, so that new
clients still reach it. And a runtime directory that someone planted as a symbolic link (the
``/tmp/kvsidecar-<uid>`` fallback lives in a world-writable directory) is refused, never followed:
the daemon must not chmod, or bind its sockets in, whatever the link points to.
"""

from __future__ import annotations

import dataclasses
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
from tests.support import ROOT
from tests.support.daemons import config_env, daemon_process, make_config
from tests.support.raw import Raw

pytestmark = pytest.mark.timeout(120)

SERVE = [sys.executable, "-m", "kvsidecar.cli", "serve"]
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
