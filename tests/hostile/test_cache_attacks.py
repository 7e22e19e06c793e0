"""A client that pins what it stored cannot make the daemon's loop work for everyone else.

Attacks on a real daemon process from a second client of the same node: it fills a large cache
namespace, pins every block of it, then sends stores of new keys, each of which finds no slot to
evict. The daemon must answer those stores (nothing stored, every key dropped) in time bounded by
the keys they name, while another client's ``status`` round trips stay short; and one owner's
pins are bounded, so a lookup past the bound is answered without a pin rather than held.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvsidecar.client import SidecarClient
from kvsidecar.daemon.cache.prefix import MAX_PINS_PER_OWNER
from kvsidecar.memory import allocate_kv_caches
from tests.support.daemons import StartDaemon

pytestmark = pytest.mark.timeout(180)

BLOCKS, N, H, C = 16, 4, 2, 8
BLOCK_BYTES = 2 * (2 * N * H * C * 4)  # two kv_first float32 layers
SLOTS = 20_000
"""The attacker's namespace: every slot stored, then pinned."""


def key(i: int, salt: int = 0) -> bytes:
    return (i + (salt << 32)).to_bytes(8, "little") * 4  # 32 bytes, like vLLM's block hashes


def _engine(endpoint: str, name: str) -> tuple[SidecarClient, list[torch.Tensor]]:
    caches = allocate_kv_caches(2, (2, BLOCKS, N, H, C), torch.float32)
    client = SidecarClient(endpoint, name=name, timeout_s=60)
    client.register_kv_caches({f"layer{i}": t for i, t in enumerate(caches)}, engine_id=name)
    return client, caches


def test_stores_into_a_fully_pinned_namespace_cost_what_they_name(
    daemon_factory: StartDaemon,
) -> None:
    room = SLOTS * BLOCK_BYTES + 2 * 4096  # the namespace pads each layer to 4 KiB
    daemon = daemon_factory(host_pool_bytes=64 << 20, cache_bytes=48 << 20)
    attacker, _caches = _engine(daemon.config.endpoint, "attacker")
    victim = SidecarClient(daemon.config.endpoint, name="victim", timeout_s=60)
    try:
        ids = [i % BLOCKS for i in range(SLOTS)]
        stored = attacker.submit_cache_store(
            "fp", [key(i) for i in range(SLOTS)], ids, capacity_bytes=room
        ).result()
        assert stored.stored == SLOTS
        pin = attacker.cache_lookup("fp", [key(i) for i in range(SLOTS)], pin_s=60)
        assert pin.hits == SLOTS and pin.pin_id

        worst = [0.0]
        stop = threading.Event()

        def probe() -> None:  # another client's command while the attack runs
            while not stop.is_set():
                t0 = time.perf_counter()
                victim.status()
                worst[0] = max(worst[0], time.perf_counter() - t0)

        thread = threading.Thread(target=probe)
        thread.start()
        store_times = []
        try:
            for salt in range(1, 6):
                new = [key(i, salt) for i in range(5000)]
                t0 = time.perf_counter()
                out = attacker.submit_cache_store("fp", new, [0] * len(new)).result()
                store_times.append(time.perf_counter() - t0)
                # Every slot is pinned: nothing evicted, nothing stored, every key dropped.
                assert (out.stored, out.evicted, out.dropped) == (0, 0, len(new))
        finally:
            stop.set()
            thread.join(10)
        # Each store of 5000 keys walked 20,000 pinned slots per key before (seconds of loop).
        assert max(store_times) < 1.0, store_times
        assert worst[0] < 1.0, worst
        # The pinned blocks are all still there.
        assert attacker.cache_lookup("fp", [key(i) for i in range(SLOTS)]).hits == SLOTS
    finally:
        victim.close()
        attacker.close()


def test_one_owners_pins_are_bounded(daemon_factory: StartDaemon) -> None:
    daemon = daemon_factory(host_pool_bytes=16 << 20, cache_bytes=4 << 20)
    client, _caches = _engine(daemon.config.endpoint, "pinner")
    try:
        room = 32 * BLOCK_BYTES + 2 * 4096
        client.submit_cache_store("fp", [key(1)], [1], capacity_bytes=room).result()
        pins = [client.cache_lookup("fp", [key(1)], pin_s=60) for _ in range(MAX_PINS_PER_OWNER)]
        assert all(p.hits == 1 and p.pin_id for p in pins)
        past = client.cache_lookup("fp", [key(1)], pin_s=60)
        assert past.hits == 1 and past.pin_id == 0  # answered, not pinned
        # A load under one of the pins releases it: the next lookup pins again.
        assert client.submit_cache_load("fp", [key(1)], [5], pin_id=pins[0].pin_id).result()
        assert client.cache_lookup("fp", [key(1)], pin_s=60).pin_id
    finally:
        client.close()
