"""The shipped deployment starts: what deploy/ runs, run here as the uids it names.

Each test reads the command, paths and uids from the manifests (so it checks what is shipped),
maps the container paths to fresh directories under /tmp, and runs the real thing: the init
container's shell command under the capabilities it is given, the daemon as the pod's
runAsUser (dropped with ``setpriv``), a client as the engine's uid. Needs root, which the test
set-up has, to act as those uids.
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
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from kvsidecar.client import SidecarClient
from kvsidecar.exitcodes import EXIT_CONFIG
from kvsidecar.node.config import Config
from tests.support import ROOT
from tests.support.daemons import DaemonProcess
from tests.support.deploy import K8S, sidecar_runtime_dir, yaml_documents

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as the manifests' uids"),
]

CPU_OVERRIDES: dict[str, Any] = {
    # What this 2-core machine without a GPU needs instead of the node-sized values.
    "host_pool_bytes": 16 << 20,
    "metrics_port": 0,
    "require_cuda": False,
}


def _docs(name: str) -> list[dict[str, Any]]:
    return [doc for _, doc in yaml_documents([K8S / name])]


def _one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    (doc,) = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    return doc


def _toml(config_map: dict[str, Any], directory: Path) -> Path:
    path = directory / "kvsidecar.toml"
    path.write_text(config_map["data"]["kvsidecar.toml"])
    return path


@pytest.fixture
def node_dir() -> Iterator[Path]:
    """A fresh directory under /tmp standing for a node path (kept short: socket paths)."""
    path = Path(tempfile.mkdtemp(prefix="kvs-node-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _engine_reaches_daemon(uid: int, config: Config) -> dict[str, Any]:
    """Hello and the fd channel from a process running as ``uid`` (the engine's)."""
    helper = [sys.executable, "-m", "tests.procs.uid_client", str(uid)]
    proc = subprocess.run(
        [*helper, config.endpoint, config.fd_socket],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _serve_as(uid: int, config: Config, log: Path) -> DaemonProcess:
    """The daemon as ``uid``; the test's own client (root) is let in too, to see it is ready."""
    allowed = dataclasses.replace(config, allowed_uids=f"{uid},{os.geteuid()}")
    daemon = DaemonProcess(allowed, run_as=uid, log_path=log)
    try:
        daemon.wait_ready()
    except BaseException:
        daemon.stop()
        raise
    return daemon


def test_sidecar_starts_as_its_uid_in_a_subdirectory_of_a_root_owned_emptydir(
    node_dir: Path, tmp_path: Path
) -> None:
    docs = _docs("examples/engine-pod-sidecar.yaml")
    pod = _one(docs, "Pod")["spec"]
    uid = pod["securityContext"]["runAsUser"]
    runtime = sidecar_runtime_dir(pod)
    # kubelet's emptyDir: root-owned, mode 0777, no sticky bit.
    assert os.stat(node_dir).st_uid == 0
    os.chmod(node_dir, 0o777)
    relative = PurePosixPath(runtime.runtime_dir).relative_to(runtime.mount)
    runtime_dir = node_dir / relative
    config = Config.load(
        _toml(_one(docs, "ConfigMap"), tmp_path),
        env={},
        overrides={**CPU_OVERRIDES, "runtime_dir": str(runtime_dir)},
    )
    daemon = _serve_as(uid, config, tmp_path / "daemon.log")
    try:
        st = os.stat(runtime_dir)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, uid, 0o700)
        # The engine container (same uid) reaches both sockets through the 0700 directory.
        result = _engine_reaches_daemon(uid, config)
        assert (result["zmq"], result["fd"]) == ("HelloReply", "open"), result
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_sidecar_refuses_the_emptydir_itself(node_dir: Path, tmp_path: Path) -> None:
    """The failure the subdirectory avoids: the daemon does not take a directory it does not own."""
    os.chmod(node_dir, 0o777)
    config = Config(**CPU_OVERRIDES, runtime_dir=str(node_dir))
    log = tmp_path / "daemon.log"
    daemon = DaemonProcess(config, run_as=65534, log_path=log)
    try:
        assert daemon.proc.wait(60) != 0
    finally:
        daemon.stop()
    assert f"{node_dir} belongs to uid 0" in daemon.log()
    assert f"runtime_dir to a subdirectory, e.g. {node_dir}/daemon" in daemon.log()


def _init_container_run(command: list[str], capabilities: list[str]) -> None:
    """Run an init container's command as root holding only ``capabilities`` (and no way to gain
    more: allowPrivilegeEscalation false is no_new_privs)."""
    keep = ",".join(f"+{c.lower()}" for c in capabilities)
    argv = ["setpriv", f"--bounding-set=-all,{keep}", "--no-new-privs", *command]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 0, f"{command}: {proc.stderr}"


def test_daemonset_init_container_and_daemon_survive_restarts(
    node_dir: Path, tmp_path: Path
) -> None:
    docs = _docs("daemonset.yaml")
    pod = _one(docs, "DaemonSet")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (container,) = pod["containers"]
    # The hostPaths: the runtime directory, and the disk tier's cache directory.
    paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert set(paths) == {"runtime", "cache"}
    for name, path in paths.items():
        (mount,) = [m for m in init["volumeMounts"] if m["name"] == name]
        assert mount["mountPath"] == path
        assert any(m["mountPath"] == path for m in container["volumeMounts"] if m["name"] == name)
    security = init["securityContext"]
    assert security["runAsUser"] == 0 and security["capabilities"]["drop"] == ["ALL"]
    assert security["allowPrivilegeEscalation"] is False
    # The shipped command, with the node paths in place of the hostPaths.
    cache_dir = node_dir.with_name(node_dir.name + "-cache")
    cache_dir.mkdir()
    on_node = {paths["runtime"]: str(node_dir), paths["cache"]: str(cache_dir)}
    command = list(init["command"])
    for path, local in on_node.items():
        assert any(path in part for part in command)
        command = [part.replace(path, local) for part in command]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KVSIDECAR_RUNTIME_DIR"] == paths["runtime"]
    uid = pod["securityContext"]["runAsUser"]
    config = Config.load(
        _toml(_one(_docs("configmap.yaml"), "ConfigMap", "kvsidecar-config"), tmp_path),
        env={},
        overrides={**CPU_OVERRIDES, "runtime_dir": str(node_dir), "cache_dir": str(cache_dir)},
    )
    assert config.disk_tier  # the ConfigMap's cache_dir is the cache hostPath
    # kubelet's hostPath DirectoryOrCreate: root-owned, mode 0755.
    for path in (node_dir, cache_dir):
        os.chmod(path, 0o755)
    for _ in range(2):  # the pod's first start, then a restart before the daemon ran
        _init_container_run(command, security["capabilities"]["add"])
    for path in (node_dir, cache_dir):
        assert (os.stat(path).st_uid, os.stat(path).st_gid) == (uid, uid)
    daemon = _serve_as(uid, config, tmp_path / "daemon.log")
    try:
        assert stat.S_IMODE(os.stat(node_dir).st_mode) == 0o700  # the daemon's own doing
        assert stat.S_IMODE(os.stat(cache_dir).st_mode) == 0o700
        with SidecarClient(config.endpoint, heartbeat=False) as client:
            (tier,) = client.status().cache_tiers
            assert tier.up, tier
        result = _engine_reaches_daemon(uid, config)
        assert (result["zmq"], result["fd"]) == ("HelloReply", "open"), result
    finally:
        assert daemon.stop() == 0, daemon.log()
    # A restart after the daemon made its directory 0700: the init container must pass again.
    _init_container_run(command, security["capabilities"]["add"])
    daemon = _serve_as(uid, config, tmp_path / "daemon-restarted.log")
    assert daemon.stop() == 0, daemon.log()
    shutil.rmtree(cache_dir, ignore_errors=True)


@pytest.mark.parametrize(
    ("manifest", "config_map"),
    [
        ("configmap.yaml", "kvsidecar-config"),
        ("examples/engine-pod-sidecar.yaml", "kvsidecar-sidecar-config"),
    ],
)
def test_shipped_gpu_configs_refuse_to_start_without_cuda(
    node_dir: Path, tmp_path: Path, manifest: str, config_map: str
) -> None:
    """require_cuda = true in the shipped GPU configs: on this CPU-only machine the daemon stops
    at start with the configuration exit code and says why; without it, it starts (above)."""
    toml = _toml(_one(_docs(manifest), "ConfigMap", config_map), tmp_path)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvsidecar.cli",
            "serve",
            "--config",
            str(toml),
            "--runtime-dir",
            str(node_dir / "d"),
            "--host-pool-bytes",
            "0",
            "--metrics-port",
            "0",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == EXIT_CONFIG, proc.stderr
    assert "require_cuda is set but CUDA is not usable here" in proc.stderr
    assert "is a CPU build" in proc.stderr  # this machine's torch: the cause, named
    assert not (node_dir / "d").exists()  # failed before touching anything
