"""One user's cache namespaces never take the room another user needs.

A real daemon serves root and ``nobody`` with a host-pool quota per user. ``nobody``, a
`tests.procs.cache_hog` process, creates as many cache namespaces as it can, asking for more
room than its quota each time, and pins all of them so that none is idle. Its namespaces must
stay within its quota, or without one within its share of ``cache_bytes``; root's engine,
registered afterwards, must then get a namespace of its own and store into it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvsidecar.client import SidecarClient
from kvsidecar.daemon.cache.disk_format import HEADER_BYTES, META_DECODER
from kvsidecar.memory import allocate_kv_caches
from kvsidecar.wire.protocol import Status, StatusReply
from tests.support.children import LineChild
from tests.support.daemons import DaemonProcess, daemon_process, make_config, open_to_every_uid
from tests.support.disk import slot_of, space_files
from tests.support.raw import Raw

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid"),
]

NOBODY = 65534
QUOTA = 4 << 20
CACHE = 32 << 20


@pytest.fixture(params=[QUOTA, 0], ids=["quota", "shares"])
def daemon(request: pytest.FixtureRequest) -> Iterator[DaemonProcess]:
    """With a quota per user, and without one: then each of the two uids has half the pool
    and half of ``cache_bytes``."""
    config = make_config(
        allowed_uids=f"{os.geteuid()},{NOBODY}",
        host_pool_bytes=64 << 20,
        host_pool_user_bytes=request.param,
        cache_bytes=CACHE,
        lease_s=60.0,
        cache_pin_s=600.0,
    )
    with daemon_process(config) as d:
        open_to_every_uid(config)
        yield d


def _hog(endpoint: str, *, capacity_bytes: int) -> LineChild:
    """``nobody``'s `tests.procs.cache_hog`: 16 namespaces of ``capacity_bytes``, all pinned."""
    spec = {
        "uid": NOBODY,
        "endpoint": endpoint,
        "engine": "hog",
        "namespaces": 16,
        "capacity_bytes": capacity_bytes,
    }
    return LineChild("cache_hog", json.dumps(spec), name="cache hog")


def _namespace_bytes(daemon: DaemonProcess) -> dict[str, int]:
    """Bytes of cache namespaces per owner, as the administrator's status describes them."""
    with Raw(daemon.config.endpoint) as admin:
        status = admin.call(Status(id=1))
    assert isinstance(status, StatusReply)
    out: dict[str, int] = {}
    for ns in status.cache_namespaces:
        out[ns.owner] = out.get(ns.owner, 0) + ns.capacity_blocks * ns.block_bytes
    return out


def test_one_users_namespaces_leave_another_users_room(daemon: DaemonProcess) -> None:
    bound = daemon.config.host_pool_user_bytes or CACHE // 2
    hog = _hog(daemon.config.endpoint, capacity_bytes=8 << 20)
    try:
        took = json.loads(hog.line(120))["outcomes"]
        assert "stored" in took, took  # the attack ran: it got room of its own
        held = _namespace_bytes(daemon).get(f"uid:{NOBODY}", 0)
        assert 0 < held <= bound, (held, took)
        caches = allocate_kv_caches(2, (2, 16, 4, 2, 8), torch.float32)
        with SidecarClient(daemon.config.endpoint, heartbeat=False, timeout_s=30) as root:
            root.register_kv_caches(
                {f"layer{i}": t for i, t in enumerate(caches)}, engine_id="honest"
            )
            key = bytes(range(1, 33))
            stored = root.submit_cache_store("mine", [key], [3], capacity_bytes=1 << 20).result()
            assert stored.stored == 1, stored
            assert root.cache_lookup("mine", [key]).hits == 1
        assert _namespace_bytes(daemon).get(f"uid:{NOBODY}", 0) <= bound
    finally:
        hog.stop()


DISK = 8 << 20


def _disk_bytes(cache_dir: Path) -> dict[str, int]:
    """Bytes of disk-tier spaces per owner, from the meta files in ``cache_dir``."""
    out: dict[str, int] = {}
    for meta_file in cache_dir.glob("*.meta"):
        meta = META_DECODER.decode(meta_file.read_bytes())
        out[meta.owner] = out.get(meta.owner, 0) + meta.capacity * (meta.slot_bytes + HEADER_BYTES)
    return out


def test_one_users_disk_spaces_stay_within_its_share(tmp_path: Path) -> None:
    """The disk tier has the same shares: ``nobody``'s 16 namespaces, all in use and written
    through to disk, hold at most half of ``cache_disk_bytes`` there (before, each new one took
    an equal share from the others, until it held all of it); root's namespace then gets a
    space of its own on disk and its block is written into it."""
    cache_dir = tmp_path / "disk"
    config = make_config(
        allowed_uids=f"{os.geteuid()},{NOBODY}",
        host_pool_bytes=64 << 20,
        cache_bytes=CACHE,
        cache_dir=str(cache_dir),
        cache_disk_bytes=DISK,
        cache_disk_admit="all",
        cache_disk_direct=False,  # tmp_path may be a tmpfs, which refuses O_DIRECT
        lease_s=60.0,
        cache_pin_s=600.0,
    )
    with daemon_process(config):
        open_to_every_uid(config)
        hog = _hog(config.endpoint, capacity_bytes=64 << 10)
        try:
            took = json.loads(hog.line(120))["outcomes"]
            assert took.count("stored") == 16, took  # in memory: 16 namespaces in use
            held = [0]
            deadline = time.monotonic() + 3.0  # its write-throughs land meanwhile
            while time.monotonic() < deadline:
                held.append(_disk_bytes(cache_dir).get(f"uid:{NOBODY}", 0))
                time.sleep(0.1)
            assert 0 < max(held) <= DISK // 2, held
            caches = allocate_kv_caches(2, (2, 16, 4, 2, 8), torch.float32)
            with SidecarClient(config.endpoint, heartbeat=False, timeout_s=30) as root:
                root.register_kv_caches(
                    {f"layer{i}": t for i, t in enumerate(caches)}, engine_id="honest"
                )
                key = bytes(range(1, 33))
                stored = root.submit_cache_store("mine", [key], [3], capacity_bytes=1 << 20)
                assert stored.result().stored == 1
                files = space_files(cache_dir, f"uid:{os.geteuid()}", "mine")
                deadline = time.monotonic() + 10.0
                while time.monotonic() < deadline and not _on_disk(files, key):
                    time.sleep(0.1)
                assert _on_disk(files, key), sorted(p.name for p in cache_dir.iterdir())
            assert _disk_bytes(cache_dir).get(f"uid:{NOBODY}", 0) <= DISK // 2
        finally:
            hog.stop()


def _on_disk(files: dict[str, Path], key: bytes) -> bool:
    try:
        slot_of(files, f"uid:{os.geteuid()}", "mine", key)
    except (KeyError, FileNotFoundError):
        return False
    return True
