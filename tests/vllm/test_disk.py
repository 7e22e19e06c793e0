"""The daemon's disk tier under real engines: prefixes that survive the daemon, and damaged disks.

Three ``vllm serve`` processes (`tests.support.vllm_serve`) of the test model (random weights:
outputs depend on the KV cache) are started once and serve every check; one daemon is stopped
and started again under them (the engines register again by themselves), on the same runtime
directory, its ``cache_dir`` on a size-limited tmpfs:

- ``ref``: no connector, the reference. A prefix hit takes another numeric path than a full
  forward on vLLM's bfloat16 CPU kernels: a prompt that ``b`` loads ``h`` blocks of is compared
  with ``ref`` serving it after computing those ``h`` blocks itself (the same cache path);
- ``a``: the docs recipe's connector: it computes each prompt first (stored, and written to disk:
  ``cache_disk_admit = "all"``, so that one request puts a prefix there);
- ``b``: the same recipe, fresh for every prompt (it never saw it): what it loads, after the
  daemon was restarted, comes from the disk.

The checks: a prefix survives a restart after SIGTERM and after SIGKILL during stores, loaded by
``b`` from disk (its hits counted as disk hits by the daemon and by ``b``'s connector); a flipped
byte, a slab truncated under the daemon, a file system that fills up and one remounted read-only
are misses where they hit, never wrong tokens, and the daemon serves on. The negative control:
blocks forged on disk with checksums that fit change ``b``'s outputs. Run on one vLLM (the
connector's version differences are the other modules'; the disk tier lies below its interface).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from kvsidecar.client import SidecarClient
from kvsidecar.daemon.cache.disk_format import (
    HEADER_BYTES,
    pack_header,
    payload_digest,
    unpack_header,
)
from kvsidecar.node.config import Config
from kvsidecar.wire.protocol import StatusReply
from tests.support.daemons import DaemonProcess, make_config
from tests.support.disk import (
    can_mount,
    flip_byte,
    record_offset,
    remount_read_only,
    slot_bytes_of,
    slot_of,
    space_files,
    tmpfs,
)
from tests.support.prometheus import scrape
from tests.support.vllm_serve import (
    CONNECTOR,
    Completion,
    VllmServer,
    block_hashes,
    make_model,
    same_outputs,
    tokens,
    vllm_venv_params,
)

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(not can_mount(), reason="the disk tier's faults need a tmpfs (root)"),
]

BLOCK = 32
OWNER = f"uid:{os.geteuid()}"
RETRY_S = 2.0
LOOKUP_TIMEOUT_S = 5.0
"""The connectors' bound on a lookup: three engines and a daemon share two cores here."""

T = TypeVar("T")


def eventually(read: Callable[[], T], done: Callable[[T], bool], timeout_s: float = 60) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        got = read()
        if done(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


class Rig:
    """The daemon and the three servers of the module (see the module doc)."""

    def __init__(self, tmp: Path, venv: Path, mount: Path) -> None:
        self.tmp = tmp
        self.venv = venv
        self.model = tmp / "model"
        make_model(venv, self.model)
        self.mount = mount
        self.config = self.disk_config(mount / "cache")
        self.daemon = DaemonProcess(self.config)
        self.servers: dict[str, VllmServer] = {}
        self.fingerprint = ""

    def disk_config(self, cache_dir: Path, **overrides: Any) -> Config:
        values: dict[str, Any] = {
            "host_pool_bytes": 64 << 20,
            "cache_bytes": 8 << 20,
            "cache_dir": str(cache_dir),
            "cache_disk_bytes": 6 << 20,
            "cache_disk_admit": "all",
            "lease_s": 3.0,
        }
        if hasattr(self, "config"):
            values["runtime_dir"] = self.config.runtime_dir
        values.update(overrides)
        return make_config(**values)

    def start(self) -> None:
        self.daemon.wait_ready()
        # disk_wait_s: bring a hit up from disk before answering, on two busy cores too.
        extra = {"lookup_timeout_s": LOOKUP_TIMEOUT_S, "retry_s": RETRY_S, "disk_wait_s": 2.0}
        connector = {
            **CONNECTOR,
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
        env = {"KVSIDECAR_RUNTIME_DIR": self.config.runtime_dir}
        venv, model, tmp = self.venv, self.model, self.tmp
        self.servers = {
            "ref": VllmServer("ref", venv, model, tmp),
            "a": VllmServer("a", venv, model, tmp, kv_transfer_config=connector, env=env),
            "b": VllmServer("b", venv, model, tmp, kv_transfer_config=connector, env=env),
        }
        for server in self.servers.values():
            server.wait_ready()
        self.servers["a"].complete(tokens(900, 40))  # its namespace exists from here on
        with self.client() as c:
            self.fingerprint = eventually(
                lambda: [n.fingerprint for n in c.status().cache_namespaces],
                lambda found: len(found) == 1,
            )[0]

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.daemon.stop()
        shutil.rmtree(self.config.runtime_dir, ignore_errors=True)

    def client(self) -> SidecarClient:
        return SidecarClient(self.config.endpoint, heartbeat=False)

    def status(self) -> StatusReply:
        with self.client() as c:
            return c.status()

    def restart(self, sig: signal.Signals = signal.SIGTERM, config: Config | None = None) -> None:
        """Stop the daemon with ``sig`` and start another on the same runtime directory; wait
        until both engines' workers are registered with it again."""
        self.daemon.proc.send_signal(sig)
        self.daemon.proc.wait(30)
        self.daemon.stop()
        self.config = config or self.config
        self.daemon = DaemonProcess(self.config)
        self.daemon.wait_ready()
        with self.client() as c:
            eventually(lambda: len(c.status().engines), lambda n: n == 2)
        time.sleep(RETRY_S)  # a side that found the daemon away asks again after retry_s

    def on_disk(self, prompt: list[int]) -> int:
        """How many leading full blocks of ``prompt`` the daemon holds (either tier)."""
        with self.client() as c:
            return c.cache_lookup(self.fingerprint, block_hashes(prompt)).hits

    def written(self, prompt: list[int]) -> None:
        """Wait until every full block of ``prompt`` is on disk."""
        want = len(prompt) // BLOCK
        files = space_files(self.config.cache_dir, OWNER, self.fingerprint)

        def count() -> int:
            found = 0
            for h in block_hashes(prompt):
                try:
                    slot_of(files, OWNER, self.fingerprint, h)
                except (KeyError, FileNotFoundError):
                    break
                found += 1
            return found

        assert eventually(count, lambda n: n == want) == want

    def metric(self, name: str, **labels: str) -> float:
        return scrape(self.status().metrics_port).get((name, tuple(sorted(labels.items()))), 0.0)

    def reference(self, prompt: list[int], hit_blocks: int) -> Completion:
        """``ref``'s completion of ``prompt`` after computing its first ``hit_blocks`` blocks."""
        ref = self.servers["ref"]
        if hit_blocks:
            ref.complete(prompt[: hit_blocks * BLOCK])
        return ref.complete(prompt)


@pytest.fixture(scope="module", params=vllm_venv_params()[:1])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    venv: Path = request.param
    keep = os.environ.get("KVSIDECAR_VLLM_LOGS")
    tmp = Path(keep) / "disk" if keep else Path(tempfile.mkdtemp(prefix="kvs-disk-", dir="/tmp"))
    tmp.mkdir(parents=True, exist_ok=True)
    with tmpfs("16m") as mount:
        rig = Rig(tmp, venv, mount)
        try:
            rig.start()
            yield rig
        finally:
            rig.stop()
            if not keep:
                shutil.rmtree(tmp, ignore_errors=True)


def loads_from_disk(rig: Rig, prompt: list[int], hit_blocks: int, *, disk: bool = True) -> None:
    """``b`` completes ``prompt``: its first ``hit_blocks`` blocks come from the daemon (from its
    disk, counted so by the daemon, where ``disk``), and its outputs are ``ref``'s on the same
    path."""
    b = rig.servers["b"]
    hits = b.metric("vllm:external_prefix_cache_hits_total")
    from_disk = rig.metric("kvsidecar_cache_tier_hit_blocks_total", medium="STORAGE")
    got = b.complete(prompt)
    assert b.metric("vllm:external_prefix_cache_hits_total") - hits == hit_blocks * BLOCK
    if disk:
        now = rig.metric("kvsidecar_cache_tier_hit_blocks_total", medium="STORAGE")
        assert now >= from_disk + hit_blocks
    same_outputs(got, rig.reference(prompt, hit_blocks))


# ------------------------------------------------------------------ restarts


def test_a_prefix_survives_a_daemon_restart(rig: Rig) -> None:
    """``a`` computes a prompt; the daemon is stopped (SIGTERM) and started again; ``b``, which
    never saw the prompt, loads all its full blocks from the disk."""
    prompt = tokens(501, 250)  # 7 full blocks: b loads them all, computes the last 26 tokens
    same_outputs(rig.servers["a"].complete(prompt), rig.reference(prompt, 0))
    rig.written(prompt)
    rig.restart(signal.SIGTERM)
    (tier,) = rig.status().cache_tiers
    assert tier.up and tier.blocks >= 7
    disk_hits = rig.servers["b"].metric("vllm:kvsidecar_blocks_total", event="disk_hit")
    loads_from_disk(rig, prompt, 7)
    assert rig.servers["b"].metric("vllm:kvsidecar_blocks_total", event="disk_hit") == (
        disk_hits + 7
    )


def test_a_daemon_killed_during_stores_serves_whole_blocks_only(rig: Rig) -> None:
    """SIGKILL while ``a`` is storing prompts: after the restart ``b`` loads what reached the
    disk (its outputs ``ref``'s on the same path), and computes the rest."""
    first = tokens(510, 200)
    rig.servers["a"].complete(first)
    rig.written(first)
    prompts = [tokens(511 + i, 230) for i in range(6)]
    done: list[Any] = []

    def compute() -> None:
        for p in prompts:
            try:
                done.append(rig.servers["a"].complete(p, timeout=120))
            except BaseException as exc:  # reported below
                done.append(exc)

    writer = threading.Thread(target=compute, daemon=True)
    writer.start()
    eventually(lambda: len(done), lambda n: n >= 2)
    rig.restart(signal.SIGKILL)
    writer.join(300)
    assert all(isinstance(c, Completion) for c in done), done  # a served on without a daemon
    assert rig.on_disk(first) == 6
    loads_from_disk(rig, first, 6)
    for p in prompts[:3]:  # stored before the kill, or by the next daemon (then in memory)
        loads_from_disk(rig, p, rig.on_disk(p), disk=False)


# ------------------------------------------------------------------ damaged disks


def test_the_comparison_catches_a_block_of_the_wrong_contents_from_disk(rig: Rig) -> None:
    """The negative control: a record rewritten with other bytes and a checksum that matches
    them (what no fault makes, and no check can tell) is served, and ``b``'s outputs are no
    longer ``ref``'s on the same path: the equalities above mean something."""
    prompt = tokens(505, 250)
    rig.servers["a"].complete(prompt)
    rig.written(prompt)
    rig.daemon.proc.send_signal(signal.SIGTERM)
    rig.daemon.proc.wait(30)
    files = space_files(rig.config.cache_dir, OWNER, rig.fingerprint)
    for h in block_hashes(prompt)[:4]:
        forge(files, rig.fingerprint, h)
    rig.restart(signal.SIGTERM)
    b = rig.servers["b"]
    hits = b.metric("vllm:external_prefix_cache_hits_total")
    got = b.complete(prompt)
    # Served (their checksums fit: the daemon cannot tell), and the outputs show it.
    assert b.metric("vllm:external_prefix_cache_hits_total") - hits == 7 * BLOCK
    with pytest.raises(AssertionError):
        same_outputs(got, rig.reference(prompt, 7))


def forge(files: dict[str, Path], fingerprint: str, key: bytes) -> None:
    """Replace block ``key``'s bytes on disk with other values, under a checksum that fits them."""
    slot = slot_of(files, OWNER, fingerprint, key)
    size = slot_bytes_of(files)
    with open(files["slab"], "r+b") as fh:
        fh.seek(slot * size)
        header = unpack_header(fh.read(HEADER_BYTES))
        assert header is not None and header.key == key
        # Other values of the model's dtype (bfloat16: the top half of float32 normals): random
        # bytes would hold NaNs, whose outputs the server refuses to encode, not wrong ones.
        normals = np.random.default_rng(slot).standard_normal(header.length // 2)
        payload = (normals.astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        fh.seek(slot * size)
        digest = payload_digest(memoryview(payload))
        fh.write(pack_header(header.space, key, header.length, digest, header.seq))
        fh.write(payload)


def test_a_flipped_byte_is_a_miss_from_its_block_on(rig: Rig) -> None:
    prompt = tokens(520, 200)  # 6 full blocks
    rig.servers["a"].complete(prompt)
    rig.written(prompt)
    files = space_files(rig.config.cache_dir, OWNER, rig.fingerprint)
    fourth = block_hashes(prompt)[3]
    rig.daemon.proc.send_signal(signal.SIGTERM)
    rig.daemon.proc.wait(30)
    flip_byte(files["slab"], record_offset(files, slot_of(files, OWNER, rig.fingerprint, fourth)))
    rig.restart(signal.SIGTERM)
    loads_from_disk(rig, prompt, 3)  # blocks 0..2; the fourth is damaged, the rest not reached
    corrupt = rig.metric("kvsidecar_cache_tier_errors_total", medium="STORAGE", kind="corrupt")
    assert corrupt == 1
    assert rig.status().cache_tiers[0].up


def test_a_slab_truncated_under_the_daemon_is_a_miss(rig: Rig) -> None:
    prompt = tokens(530, 200)
    rig.servers["a"].complete(prompt)
    rig.written(prompt)
    rig.restart(signal.SIGTERM)  # nothing of it in memory now
    files = space_files(rig.config.cache_dir, OWNER, rig.fingerprint)
    slots = [slot_of(files, OWNER, rig.fingerprint, h) for h in block_hashes(prompt)]
    keep = slots[2]  # the file ends where the prompt's third block starts
    os.truncate(files["slab"], keep * slot_bytes_of(files))
    leading = next(i for i, s in enumerate(slots) if s >= keep)
    loads_from_disk(rig, prompt, leading)
    assert rig.metric("kvsidecar_cache_tier_errors_total", medium="STORAGE", kind="truncated") >= 1
    # The daemon serves on: the next prompt is stored, written and loaded whole.
    after = tokens(531, 170)
    rig.servers["a"].complete(after)
    rig.written(after)


def test_a_file_system_that_fills_up_costs_blocks_not_tokens(rig: Rig) -> None:
    """A 1 MiB file system under a 64 MiB ``cache_disk_bytes``: the namespace gets the slots it
    holds (a few blocks); prompts past them evict earlier ones from the disk; after a restart
    ``b`` loads what the disk kept and computes the rest, right."""
    with tmpfs("1m") as small:
        config = rig.disk_config(small / "cache", cache_disk_bytes=64 << 20)
        rig.restart(signal.SIGTERM, config)
        prompts = [tokens(540 + i, 200) for i in range(10)]  # 60 blocks, 20 KiB slots each
        for p in prompts:
            rig.servers["a"].complete(p)
        rig.written(prompts[-1])
        (space,) = [n for n in rig.status().cache_namespaces if n.disk_capacity_blocks]
        assert 6 <= space.disk_capacity_blocks < 60  # what 1 MiB holds
        rig.restart(signal.SIGTERM)
        kept = [rig.on_disk(p) for p in prompts]
        assert kept[-1] == 6 and kept[0] == 0  # the oldest went for room
        for i in (0, len(prompts) - 1):
            loads_from_disk(rig, prompts[i], kept[i])
        rig.restart(signal.SIGTERM, rig.disk_config(rig.mount / "cache"))


def test_a_read_only_file_system_turns_the_tier_off_and_memory_serves(rig: Rig) -> None:
    """The cache's file system is remounted read-only between two daemons: the next daemon's
    disk tier is off (said so), ``b``'s lookups miss what the disk held, memory serves."""
    with tmpfs("4m") as spare:
        rig.restart(signal.SIGTERM, rig.disk_config(spare / "cache"))
        prompt = tokens(550, 170)
        rig.servers["a"].complete(prompt)
        rig.written(prompt)
        rig.daemon.proc.send_signal(signal.SIGTERM)
        rig.daemon.proc.wait(30)
        remount_read_only(spare)
        rig.restart(signal.SIGTERM)
        (tier,) = rig.status().cache_tiers
        assert not tier.up and "Read-only" in tier.reason
        assert rig.metric("kvsidecar_cache_tier_up", medium="STORAGE") == 0
        loads_from_disk(rig, prompt, 0)  # computed: the disk tier is off
        again = tokens(551, 170)  # memory serves: a computes, b loads from memory
        rig.servers["a"].complete(again)
        b = rig.servers["b"]
        hits = b.metric("vllm:external_prefix_cache_hits_total")
        same_outputs(b.complete(again), rig.reference(again, 5))
        assert b.metric("vllm:external_prefix_cache_hits_total") - hits == 5 * BLOCK
        rig.restart(signal.SIGTERM, rig.disk_config(rig.mount / "cache"))
