"""Two daemons and their engine workers, as real processes, for the peer tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvsidecar.daemon.config import Config
from tests.harness import DaemonProcess, WorkerProcess, make_config
from tests.helpers.peer_worker import global_layer, rank_heads, rank_values


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_CLUSTER_KEY: list[str] = []


def cluster_key() -> str:
    """One CurveZMQ key pair for every test daemon (the cluster-key deployment)."""
    if not _CLUSTER_KEY:
        import atexit
        import tempfile

        from kvsidecar.wire.curve import keygen

        keys = tempfile.mkdtemp(prefix="kvs-keys-")
        atexit.register(shutil.rmtree, keys, ignore_errors=True)
        _, secret = keygen(keys, "cluster")
        _CLUSTER_KEY.append(str(secret))
    return _CLUSTER_KEY[0]


def peer_config(**overrides: Any) -> Config:
    """A daemon config with a loopback peer endpoint (CURVE, cluster key) and short bounds."""
    values: dict[str, Any] = {
        "peer_endpoint": f"tcp://127.0.0.1:{free_port()}",
        "curve_secret_key": cluster_key(),
        "peer_data_plane": "zmq",
        "peer_pull_timeout_s": 10.0,
        "peer_handshake_timeout_s": 2.0,
        "host_pool_bytes": 0,
        "lease_s": 5.0,
    }
    values.update(overrides)
    return make_config(**values)


@contextlib.contextmanager
def daemon(config: Config) -> Iterator[DaemonProcess]:
    """A daemon process (UCX kept on loopback); stopped and its runtime dir removed at exit."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    d = DaemonProcess(config)
    try:
        d.wait_ready(30)
        yield d
    finally:
        d.stop()
        shutil.rmtree(config.runtime_dir, ignore_errors=True)


class PeerWorkers(WorkerProcess):
    """A ``tests.helpers.peer_worker`` process (several engines and ranks in one process)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__(spec, module="peer_worker")

    def dump_all(self, directory: Path, timeout: float = 60.0) -> dict[str, np.ndarray]:
        """Every engine/rank/layer's logical values, keyed ``<engine>.r<rank>.l<layer>``."""
        self._ask_dump(directory, timeout)
        return {p.stem: np.load(p) for p in directory.glob("*.npy")}


@contextlib.contextmanager
def peer_workers(spec: dict[str, Any]) -> Iterator[PeerWorkers]:
    """Start a worker process, wait until it registered everything, always stop it."""
    w = PeerWorkers(spec)
    try:
        w.wait_ready(120)
        yield w
    finally:
        w.stop()


def expected_rank(
    producer: dict[str, Any],
    consumer: dict[str, Any],
    rank: int,
    layer: int,
    remote_ids: Sequence[int],
    local_ids: Sequence[int],
    before: np.ndarray | None = None,
) -> np.ndarray:
    """A consumer rank's layer after the pull, by plain indexing of the producer's values."""
    out = (rank_values(consumer, rank, layer) if before is None else before).copy()
    g = global_layer(producer, layer)
    ratio = consumer["block_size"] // producer["block_size"]
    n = producer["block_size"]
    mla = consumer.get("arrangement", "kv_first") == "mla"
    for j, lb in enumerate(local_ids):
        rb = list(remote_ids[j * ratio : (j + 1) * ratio])
        if not rb:
            continue
        if mla:
            out[lb, : len(rb) * n] = np.concatenate([g[b] for b in rb], axis=0)
        else:
            tokens = np.concatenate([g[:, b] for b in rb], axis=1)
            out[:, lb, : len(rb) * n] = tokens[:, :, rank_heads(consumer, rank)]
    return out
