"""The node's shared prefix cache: its index, and a daemon process serving real clients.

Blocks are checked element by element against what the storing engine held, read here with
plain indexing; the index is checked against a model written here (a dict and a list).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsidecar.client import BufferSetRef, SidecarClient, SidecarError, WorkerRef
from kvsidecar.daemon.cache.index import CacheIndex
from kvsidecar.memory import allocate_kv_caches
from kvsidecar.wire.cache import CacheHits, CacheLoad, CacheLookup, CacheStore, TakeWorkerEvents
from kvsidecar.wire.protocol import Error, Reply, Request
from tests.support.daemons import DaemonProcess, StartDaemon, daemon_process, make_config
from tests.support.prometheus import scrape

pytestmark = pytest.mark.timeout(120)

BLOCKS, N, H, C = 16, 4, 2, 8
BLOCK_BYTES = 2 * (2 * N * H * C * 4)  # two kv_first float32 layers


ROOM = 32 * BLOCK_BYTES + 2 * 4096
"""Each test namespace's size: 32 blocks (the namespace pads each layer to 4 KiB)."""


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8  # 32 bytes, like vLLM's sha256 block hashes


# ------------------------------------------------------------------ the index, against a model


def test_index_publishes_only_committed_keys_in_leading_order() -> None:
    index = CacheIndex(4)
    res = index.reserve([key(0), key(1), key(2)])
    assert res.slots and res.present == 0 and index.lookup([key(0)]) == 0  # filling: invisible
    index.commit([key(0), key(1), key(2)], res.slots, ok=True)
    assert index.lookup([key(0), key(1), key(9), key(2)]) == 2
    again = index.reserve([key(1), key(3)])
    assert again.present == 1 and len(again.slots) == 1
    index.commit([key(3)], again.slots, ok=False)  # a failed copy frees its slot
    assert index.lookup([key(3)]) == 0 and index.used == 3


def test_index_evicts_least_recently_used_never_pinned_or_filling() -> None:
    index = CacheIndex(3)
    res = index.reserve([key(0), key(1), key(2)])
    index.commit([key(0), key(1), key(2)], res.slots, ok=True)
    index.slots([key(0)])  # used: key 1 is now the oldest
    pinned = index.slots([key(1)])
    index.pin([s for s in pinned if s is not None])  # and now key 2 is the oldest, key 1 pinned
    res = index.reserve([key(5)])
    assert res.evicted == 1
    assert index.lookup([key(2)]) == 0 and index.lookup([key(1)]) == 1
    # Key 5 is filling, key 1 pinned: the only victim left is key 0.
    res2 = index.reserve([key(6), key(7)])
    assert res2.evicted == 1 and res2.dropped == 1
    assert index.lookup([key(0)]) == 0 and index.lookup([key(1)]) == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "fail", "pin", "unpin"]), st.integers(0, 7))))
def test_index_matches_a_model(ops: list[tuple[str, int]]) -> None:
    """Random stores, failed stores, pins: what is ready, and every slot holds one key."""
    index = CacheIndex(3)
    ready: dict[bytes, int] = {}
    pins: list[int] = []
    for op, i in ops:
        k = key(i)
        if op in ("store", "fail"):
            res = index.reserve([k])
            for slot in res.slots:
                assert slot not in pins  # a pinned slot is never handed out
            ready = {rk: s for rk, s in ready.items() if s not in res.slots}
            index.commit([k] * len(res.slots), res.slots, ok=op == "store")
            if op == "store" and res.slots:
                ready[k] = res.slots[0]
        elif op == "pin" and k in ready:
            index.pin([ready[k]])
            pins.append(ready[k])
        elif op == "unpin" and pins:
            index.unpin([pins.pop()])
        assert {rk for rk in ready if index.lookup([rk]) == 1} == set(ready)
        assert len(set(ready.values())) == len(ready) <= 3


# ------------------------------------------------------------------ a daemon and two engines


class Engine:
    """One in-process engine worker: KV caches in shared memory, registered with the daemon."""

    def __init__(self, endpoint: str, name: str, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.caches = allocate_kv_caches(2, (2, BLOCKS, N, H, C), torch.float32)
        for t in self.caches:
            t.copy_(torch.randn(t.shape, generator=gen))
        self.client = SidecarClient(endpoint, name=name)
        self.client.register_kv_caches(
            {f"layer{i}": t for i, t in enumerate(self.caches)}, engine_id=name
        )

    def block(self, b: int) -> list[torch.Tensor]:
        return [t[:, b].clone() for t in self.caches]

    def close(self) -> None:
        self.client.close()


@pytest.fixture(scope="module")
def daemon(module_daemon_factory: StartDaemon) -> DaemonProcess:
    return module_daemon_factory(host_pool_bytes=8 << 20, cache_bytes=1 << 20)


@pytest.fixture
def engines(daemon: DaemonProcess) -> Iterator[tuple[Engine, Engine]]:
    a, b = Engine(daemon.config.endpoint, "a", 1), Engine(daemon.config.endpoint, "b", 2)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def samples(d: DaemonProcess, name: str, **labels: str) -> float:
    port = d.config.metrics_port or SidecarClient(d.config.endpoint).daemon.metrics_port  # type: ignore[union-attr]
    return scrape(port).get((name, tuple(sorted(labels.items()))), 0.0)


def test_one_engine_stores_another_loads(
    daemon: DaemonProcess, engines: tuple[Engine, Engine]
) -> None:
    a, b = engines
    fp = "model-x/bs4"
    keys = [key(100 + i) for i in range(4)]
    stored = a.client.submit_cache_store(fp, keys, [3, 7, 1, 12], capacity_bytes=ROOM).result()
    assert (stored.stored, stored.present, stored.dropped) == (4, 0, 0)
    assert stored.nbytes == 4 * BLOCK_BYTES
    # Leading blocks only: the third key is unknown, so two hit.
    hits = b.client.cache_lookup(fp, [keys[0], keys[1], key(999), keys[2]])
    assert hits.hits == 2 and hits.pin_id == 0
    before = [b.block(i) for i in range(BLOCKS)]
    loaded = b.client.submit_cache_load(fp, [keys[1], key(999), keys[3]], [5, 6, 9]).result()
    assert loaded.loaded == 2 and loaded.missing_block_ids == [6]
    for dst, src in ((5, 7), (9, 12)):
        for got, want in zip(b.block(dst), a.block(src), strict=True):
            assert torch.equal(got, want)
    for i in range(BLOCKS):  # nothing else changed, the missing block included
        if i not in (5, 9):
            for got, want in zip(b.block(i), before[i], strict=True):
                assert torch.equal(got, want)
    # Storing the same keys again copies nothing.
    again = b.client.submit_cache_store(fp, keys[:2], [0, 1]).result()
    assert (again.stored, again.present) == (0, 2)
    port = a.client.daemon.metrics_port  # type: ignore[union-attr]
    metrics = scrape(port)
    assert metrics[("kvsidecar_cache_transferred_bytes_total", (("direction", "load"),))] >= (
        2 * BLOCK_BYTES
    )
    assert metrics[("kvsidecar_cache_lookup_blocks_total", (("result", "hit"),))] >= 2
    assert metrics[("kvsidecar_cache_load_missing_blocks_total", ())] >= 1


def test_a_store_that_ends_after_not_after_is_never_published(
    engines: tuple[Engine, Engine],
) -> None:
    a, _ = engines
    fp = "model-late"
    late = a.client.submit_cache_store(
        fp, [key(1)], [2], not_after=time.monotonic() - 1, capacity_bytes=ROOM
    ).result()
    assert (late.stored, late.dropped) == (0, 1)
    assert a.client.cache_lookup(fp, [key(1)]).hits == 0
    fresh = a.client.submit_cache_store(fp, [key(1)], [2], not_after=time.monotonic() + 30)
    assert fresh.result().stored == 1
    assert a.client.cache_lookup(fp, [key(1)]).hits == 1


def test_a_full_namespace_evicts_the_least_recently_used_but_not_the_pinned(
    engines: tuple[Engine, Engine],
) -> None:
    a, b = engines
    fp = "model-small"
    room = 3 * BLOCK_BYTES + 2 * 4096  # three blocks (the namespace pads each layer to 4 KiB)
    a.client.submit_cache_store(
        fp, [key(1), key(2), key(3)], [1, 2, 3], capacity_bytes=room
    ).result()
    hits = b.client.cache_lookup(fp, [key(1)], pin_s=30)  # key 1 pinned (and used)
    assert hits.hits == 1 and hits.pin_id
    b.client.cache_lookup(fp, [key(3)])  # a plain lookup changes nothing: key 2 stays the oldest
    out = a.client.submit_cache_store(fp, [key(4), key(5)], [4, 5]).result()
    assert (out.stored, out.evicted) == (2, 2)
    assert [b.client.cache_lookup(fp, [key(i)]).hits for i in (1, 2, 3, 4, 5)] == [1, 0, 0, 1, 1]
    # The load under the pin releases it; key 1 is then evictable like any other.
    assert b.client.submit_cache_load(fp, [key(1)], [8], pin_id=hits.pin_id).result().loaded == 1
    for got, want in zip(b.block(8), a.block(1), strict=True):
        assert torch.equal(got, want)
    out = a.client.submit_cache_store(fp, [key(6), key(7), key(8)], [6, 7, 8]).result()
    assert out.stored == 3 and b.client.cache_lookup(fp, [key(1)]).hits == 0


def test_same_fingerprint_other_layers_and_other_engines_blocks_are_refused(
    daemon: DaemonProcess, engines: tuple[Engine, Engine]
) -> None:
    a, b = engines
    a.client.submit_cache_store("model-y", [key(1)], [1], capacity_bytes=ROOM).result()
    caches = allocate_kv_caches(2, (2, BLOCKS, N, H, 2 * C), torch.float32)
    with SidecarClient(daemon.config.endpoint) as other:
        other.register_kv_caches({f"layer{i}": t for i, t in enumerate(caches)}, engine_id="c")
        with pytest.raises(SidecarError) as err:
            other.submit_cache_store("model-y", [key(2)], [1]).result()
        assert err.value.code == "incompatible_buffers"
        with pytest.raises(SidecarError) as err:
            other.submit_cache_load("model-y", [key(1)], [1]).result()
        assert err.value.code == "incompatible_buffers"
    # A worker's blocks go into the cache from its own engine's connection only.
    with pytest.raises(SidecarError) as err:
        b.client.submit_cache_store("model-y", [key(3)], [1], worker=a.client.worker).result()
    assert err.value.code == "forbidden"


@contextlib.contextmanager
def engine_of_a_daemon_to_kill() -> Iterator[tuple[DaemonProcess, Engine]]:
    """A daemon of its own (the test kills it) and an engine that stored one block there."""
    d = DaemonProcess(make_config(host_pool_bytes=8 << 20))
    try:
        d.wait_ready()
        eng = Engine(d.config.endpoint, "a", 3)
        try:
            eng.client.submit_cache_store("m", [key(1)], [1]).result()
            yield d, eng
        finally:
            eng.close()
    finally:
        d.stop()
        shutil.rmtree(d.config.runtime_dir, ignore_errors=True)


def test_a_pin_nobody_loads_is_gone_at_its_lease_with_no_further_command() -> None:
    """A scheduler's pin whose load never comes (its request went elsewhere) holds its blocks
    until ``cache_pin_s``, then status and metrics show nothing pinned, though no lookup or
    store came since to sweep it: an idle node does not report a leak."""
    d = DaemonProcess(make_config(host_pool_bytes=8 << 20, cache_pin_s=0.5))
    try:
        d.wait_ready()
        eng = Engine(d.config.endpoint, "a", 3)
        try:
            eng.client.submit_cache_store("m", [key(1), key(2)], [1, 2]).result()
            pin = eng.client.cache_lookup("m", [key(1), key(2)], pin_s=30.0)
            assert pin.hits == 2 and pin.pin_id
            with SidecarClient(d.config.endpoint, heartbeat=False) as watcher:

                def pinned_now() -> int:
                    return sum(n.pinned_blocks for n in watcher.status().cache_namespaces)

                pinned = [pinned_now()]
                deadline = time.monotonic() + 2.0  # the lease (0.5 s) and one sweep period
                while pinned[-1] and time.monotonic() < deadline:
                    time.sleep(0.05)
                    pinned.append(pinned_now())
            assert pinned[0] == 2 and pinned[-1] == 0, pinned
            assert samples(d, "kvsidecar_cache_pinned_blocks") == 0
        finally:
            eng.close()
    finally:
        d.stop()
        shutil.rmtree(d.config.runtime_dir, ignore_errors=True)


def test_submitted_calls_fail_fast_when_the_daemon_dies() -> None:
    """A load in flight when the daemon is killed ends as connection_lost, long before timeout."""
    with engine_of_a_daemon_to_kill() as (d, eng):
        os.kill(d.proc.pid, signal.SIGSTOP)  # the daemon cannot answer now
        pending = eng.client.submit_cache_load("m", [key(1)], [2], timeout=60)
        assert not pending.wait(0.3)
        started = time.monotonic()
        os.kill(d.proc.pid, signal.SIGKILL)
        with pytest.raises(SidecarError) as err:
            pending.result()
        assert err.value.code == "connection_lost"
        assert time.monotonic() - started < 5
        assert not eng.client.available


def test_a_call_submitted_to_a_dead_daemon_fails_as_connection_lost() -> None:
    """A submit does not look for the daemon's death itself: sent after it, the call fails with
    ``connection_lost`` at its first poll, long before its timeout; once the death is known, a
    submit refuses at once."""
    with engine_of_a_daemon_to_kill() as (d, eng):
        d.proc.kill()
        d.proc.wait(10)
        started = time.monotonic()
        pending = eng.client.submit_cache_store("m", [key(2)], [2], timeout=60)
        with pytest.raises(SidecarError) as err:
            pending.result()
        assert err.value.code == "connection_lost" and time.monotonic() - started < 1
        with pytest.raises(SidecarError) as err:
            eng.client.submit_cache_store("m", [key(3)], [3], timeout=60)
        assert err.value.code == "connection_lost"


# ------------------------------------------------------------- the wire: round trips, bad input

cache_requests = st.one_of(
    st.builds(
        CacheLookup,
        id=st.integers(0, 2**63 - 1),
        fingerprint=st.text(max_size=40),
        tp_size=st.integers(1, 64),
        key_size=st.integers(1, 64),
        pin_s=st.floats(0, 100),
        loads=st.integers(1, 64),
    ),
    st.builds(
        CacheStore,
        id=st.integers(0, 2**63 - 1),
        source=st.builds(BufferSetRef, st.builds(WorkerRef, st.text(min_size=1, max_size=8))),
        fingerprint=st.text(max_size=40),
        not_after=st.floats(0, 1e9),
        capacity_bytes=st.integers(0, 2**40),
    ),
    st.builds(
        CacheLoad,
        id=st.integers(0, 2**63 - 1),
        target=st.builds(BufferSetRef, st.builds(WorkerRef, st.text(min_size=1, max_size=8))),
        fingerprint=st.text(max_size=40),
        pin_id=st.integers(0, 2**40),
    ),
    st.builds(
        TakeWorkerEvents,
        id=st.integers(0, 2**63 - 1),
        worker=st.builds(WorkerRef, st.text(min_size=1, max_size=8)),
    ),
)


@given(cache_requests)
def test_cache_messages_round_trip(req: Request) -> None:
    assert msgspec.msgpack.Decoder(Request).decode(msgspec.msgpack.encode(req)) == req


def test_bad_cache_requests_get_typed_errors_and_the_daemon_serves_on(
    daemon: DaemonProcess,
) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.config.endpoint)
    decoder = msgspec.msgpack.Decoder(Reply)

    def ask(req: Request, *frames: bytes) -> Reply:
        sock.send_multipart([msgspec.msgpack.encode(req), *frames])
        assert sock.poll(5000, zmq.POLLIN)
        return decoder.decode(sock.recv_multipart()[0])

    try:
        cases = [
            (CacheLookup(id=1, fingerprint="f"), [b"x" * 33], "bad_frame"),
            (CacheLookup(id=2, fingerprint="f", key_size=0), [b""], "invalid_message"),
            (CacheLookup(id=3, fingerprint="f", tp_size=0), [b"x" * 32], "invalid_message"),
            (CacheLookup(id=6, fingerprint="f", loads=0), [b"x" * 32], "invalid_message"),
            (CacheLookup(id=7, fingerprint="f", loads=1025), [b"x" * 32], "invalid_message"),
            (CacheLookup(id=4, fingerprint="f"), [], "bad_frame"),
            (
                CacheStore(id=5, source=BufferSetRef(WorkerRef("nobody")), fingerprint="f"),
                [b"x" * 32, np.zeros(1, np.int64).tobytes()],
                "unknown_engine",
            ),
        ]
        for req, frames, code in cases:
            reply = ask(req, *frames)
            assert isinstance(reply, Error) and reply.code == code, (req, reply)
        hits = ask(CacheLookup(id=9, fingerprint="f"), b"x" * 64)
        assert isinstance(hits, CacheHits) and hits.hits == 0
    finally:
        sock.close()
        ctx.term()


def test_an_idle_namespace_gives_its_room_to_a_new_one() -> None:
    """Namespaces outlive their engines, until a new one needs the room and nobody uses them."""
    room = 24 * BLOCK_BYTES + 2 * 4096
    with daemon_process(make_config(host_pool_bytes=8 << 20, cache_bytes=room + room // 2)) as d:
        old = Engine(d.config.endpoint, "old", 1)
        old.client.submit_cache_store("fp-old", [key(1)], [1], capacity_bytes=room).result()
        with SidecarClient(d.config.endpoint, heartbeat=False) as c:
            # A restarted engine would find the block: the namespace stays after its engine left.
            old.close()
            assert c.cache_lookup("fp-old", [key(1)]).hits == 1
            new = Engine(d.config.endpoint, "new", 2)
            try:
                # Not room for both: fp-old, whose engine left, gives its room to fp-new.
                new.client.submit_cache_store("fp-new", [key(2)], [2], capacity_bytes=room).result()
                assert c.cache_lookup("fp-old", [key(1)]).hits == 0  # dropped for the room
                assert [n.fingerprint for n in c.status().cache_namespaces] == ["fp-new"]
                assert c.cache_lookup("fp-new", [key(2)]).hits == 1
            finally:
                new.close()


def test_a_namespace_its_engine_moved_away_from_gives_its_room_to_the_next() -> None:
    """An engine that resets its cache stores under a new fingerprint: its old namespace is no
    longer its own, so the next namespace that needs room gets it although the engine lives."""
    room = 24 * BLOCK_BYTES + 2 * 4096
    with daemon_process(make_config(host_pool_bytes=8 << 20, cache_bytes=room + room // 2)) as d:
        engine = Engine(d.config.endpoint, "resets", 1)
        try:
            engine.client.submit_cache_store("fp-gen0", [key(1)], [1], capacity_bytes=room).result()
            stored = engine.client.submit_cache_store(
                "fp-gen1", [key(1)], [1], capacity_bytes=room
            ).result()
            assert stored.stored == 1  # fp-gen0 gave its room up, its engine still registered
            spaces = engine.client.status().cache_namespaces
            assert [(n.fingerprint, n.workers) for n in spaces] == [("fp-gen1", 1)]
        finally:
            engine.close()


def test_namespaces_in_use_share_the_cache_with_a_new_one() -> None:
    """The first namespace takes all of ``cache_bytes`` by default; one of another model (or of
    an engine that reset its cache while the others kept theirs) still gets an equal share: the
    namespace in use is made again at half, empty, once nothing holds it, and from then on both
    keep what they store."""
    room = 32 * BLOCK_BYTES + 2 * 4096  # 32 blocks of two layers
    with daemon_process(make_config(host_pool_bytes=8 << 20, cache_bytes=2 * room)) as d:
        a, b = Engine(d.config.endpoint, "a", 1), Engine(d.config.endpoint, "b", 2)
        try:
            a.client.submit_cache_store("fp-a", [key(i) for i in range(8)], list(range(8))).result()
            (first,) = a.client.status().cache_namespaces
            assert first.capacity_blocks == 64 + 8  # all of it (one namespace pads once)
            evicted = samples(d, "kvsidecar_cache_evictions_total")
            # A pinned namespace keeps its room: the new one is refused, with a typed error.
            pin = a.client.cache_lookup("fp-a", [key(0)], pin_s=30.0)
            assert pin.hits == 1 and pin.pin_id
            with pytest.raises(SidecarError) as refused:
                b.client.submit_cache_store("fp-b", [key(100)], [0]).result()
            assert refused.value.code == "pool_exhausted"
            assert a.client.submit_cache_load("fp-a", [key(0)], [9], pin_id=pin.pin_id).result()
            assert [t.equal(u) for t, u in zip(a.block(9), a.block(0), strict=True)] == [True] * 2
            # Unpinned: fp-a is shrunk to an equal share (its blocks dropped), fp-b gets the rest.
            stored = b.client.submit_cache_store("fp-b", [key(100), key(101)], [0, 1]).result()
            assert stored.stored == 2
            spaces = {n.fingerprint: n for n in a.client.status().cache_namespaces}
            assert {f: (n.capacity_blocks, n.ready_blocks) for f, n in spaces.items()} == {
                "fp-a": (32, 0),
                "fp-b": (40, 2),  # the rest of cache_bytes: blocks are counted, not padding
            }
            assert samples(d, "kvsidecar_cache_evictions_total") - evicted == 8
            assert a.client.cache_lookup("fp-a", [key(0)]).hits == 0
            # Both keep what they store, each block as its engine held it.
            a.client.submit_cache_store("fp-a", [key(1), key(2)], [1, 2]).result()
            assert a.client.submit_cache_load("fp-a", [key(1), key(2)], [10, 11]).result()
            assert b.client.submit_cache_load("fp-b", [key(100), key(101)], [12, 13]).result()
            for engine, got, want in ((a, 10, 1), (a, 11, 2), (b, 12, 0), (b, 13, 1)):
                for t, u in zip(engine.block(got), engine.block(want), strict=True):
                    assert t.equal(u), (engine.client.name, got, want)
        finally:
            a.close()
            b.close()


def test_a_lookup_that_pins_counts_as_a_lookup_and_a_pin(
    daemon: DaemonProcess, engines: tuple[Engine, Engine]
) -> None:
    """A plain lookup counts as a lookup; one that pins its hits (the connector's) as both."""
    a, _ = engines
    fp = "model-pins"
    a.client.submit_cache_store(fp, [key(1), key(2)], [1, 2], capacity_bytes=ROOM).result()
    before = {
        name: samples(daemon, name, **labels)
        for name, labels in (
            ("kvsidecar_cache_lookups_total", {}),
            ("kvsidecar_cache_lookup_blocks_total", {"result": "hit"}),
            ("kvsidecar_cache_pins_total", {}),
            ("kvsidecar_cache_pinned_blocks_total", {}),
        )
    }
    assert a.client.cache_lookup(fp, [key(1), key(2), key(3)]).hits == 2
    pin = a.client.cache_lookup(fp, [key(1), key(2)], pin_s=5.0)
    assert pin.hits == 2 and pin.pin_id
    assert a.client.submit_cache_load(fp, [key(1), key(2)], [5, 6], pin_id=pin.pin_id).result()
    after = {
        name: samples(daemon, name, **labels)
        for name, labels in (
            ("kvsidecar_cache_lookups_total", {}),
            ("kvsidecar_cache_lookup_blocks_total", {"result": "hit"}),
            ("kvsidecar_cache_pins_total", {}),
            ("kvsidecar_cache_pinned_blocks_total", {}),
        )
    }
    assert {k: after[k] - before[k] for k in after} == {
        "kvsidecar_cache_lookups_total": 2,
        "kvsidecar_cache_lookup_blocks_total": 4,
        "kvsidecar_cache_pins_total": 1,
        "kvsidecar_cache_pinned_blocks_total": 2,
    }


def test_a_load_whose_not_after_passed_never_copies(
    engines: tuple[Engine, Engine],
) -> None:
    """The worker gave up on the load (and may reuse its blocks): the copy must not start."""
    a, b = engines
    fp = "model-late-load"
    a.client.submit_cache_store(fp, [key(4)], [3], capacity_bytes=ROOM).result()
    before = b.block(7)
    late = b.client.submit_cache_load(fp, [key(4)], [7], not_after=time.monotonic() - 1)
    with pytest.raises(SidecarError) as err:
        late.result()
    assert err.value.code == "timeout"
    for got, want in zip(b.block(7), before, strict=True):
        assert torch.equal(got, want)
    fresh = b.client.submit_cache_load(fp, [key(4)], [7], not_after=time.monotonic() + 30)
    assert fresh.result().loaded == 1
    for got, want in zip(b.block(7), a.block(3), strict=True):
        assert torch.equal(got, want)
