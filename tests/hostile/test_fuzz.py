"""Fuzzing a live daemon process: random and mutated frames, every reply typed, no crash or hang.

Inputs come from hypothesis in batches of `BATCH` multipart messages, sent pipelined on a fresh
DEALER socket: random frames, structurally plausible msgpack maps with random field values, and
valid requests of every kind (with real engines, ids and frames) mutated byte by byte, frame by
frame. Every message must get exactly one reply that decodes as `Reply`, within a bound; the
daemon process must stay alive, keep its memory and afterwards still move bytes correctly.

The default run is `DEFAULT_INPUTS` inputs (CI); ``-m slow`` runs `SLOW_INPUTS`, and
``KVSIDECAR_FUZZ_INPUTS`` overrides either.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsidecar.client import BufferSetRef, SidecarClient, WorkerRef
from kvsidecar.memory import allocate_kv_caches
from kvsidecar.wire.protocol import (
    PROTOCOL_VERSION,
    REQUEST_TAGS,
    Collect,
    FixLayout,
    Grant,
    Heartbeat,
    Hello,
    HostAlloc,
    HostFree,
    Move,
    Register,
    Reply,
    Report,
    Status,
    Unregister,
)
from kvsidecar.wire.pulls import Publish, Pull, PullItem, TakePeerEvents
from kvsidecar.wire.types import BufferDescriptor, CudaIpcRef, LayerSpec, LayoutSpec, ShmRef
from tests.support.daemons import DaemonProcess, daemon_process, make_config
from tests.support.ids import id_frame
from tests.support.procfs import rss_mib

BATCH = 50
DEFAULT_INPUTS = 10_000
SLOW_INPUTS = 100_000
SHAPE = (2, 16, 4, 2, 8)


A, B = WorkerRef("a"), WorkerRef("b")
DESC = BufferDescriptor("kv_first", "NHD", "float16", 16, 4, 2, 8)
CUDA = CudaIpcRef(0, b"\x00" * 64, 4096, 0, b"\x01" * 64, 0, None, False, 0, 4096)

TEMPLATES: list[list[bytes]] = [
    [msgspec.msgpack.encode(m), *frames]
    for m, frames in [
        (Hello(id=1, protocol_version=PROTOCOL_VERSION), []),
        (Status(id=2), []),
        (Heartbeat(id=3, workers=[A, B], epochs=[0, 7]), []),
        (HostAlloc(id=4, engine_id="a", count=2), []),
        (HostFree(id=5, engine_id="a"), [id_frame(0, 1)]),
        (Move(id=6, src=BufferSetRef(A), dst=BufferSetRef(B)), [id_frame(1, 2), id_frame(3, 4)]),
        (
            Move(id=7, src=BufferSetRef(A), dst=BufferSetRef(A, "host"), checksum=True),
            [id_frame(5), id_frame(0)],
        ),
        (FixLayout(id=8, target=BufferSetRef(B), remote=LayoutSpec("HND", 4)), [id_frame(9)]),
        (Grant(id=9, owner=A, grantee="b", read=True, write=True), []),
        (
            Register(
                id=10,
                protocol_version=PROTOCOL_VERSION,
                worker=WorkerRef("fz"),
                layers=[LayerSpec("l0", DESC, CUDA)],
            ),
            [],
        ),
        (
            Register(
                id=11,
                protocol_version=PROTOCOL_VERSION,
                worker=WorkerRef("fz2"),
                layers=[LayerSpec("l0", DESC, ShmRef(0, 4096, 0, 4096))],
                fd_token=b"x" * 16,
            ),
            [],
        ),
        (Unregister(id=12, worker=WorkerRef("nobody-here")), []),
        (
            Pull(
                id=13,
                engine_id="a",
                remote_endpoint="tcp://127.0.0.1:9",
                remote_engine_id="r",
                items=[PullItem("q", 1, 1)],
                timeout_s=0.3,
            ),
            [id_frame(1), id_frame(2)],
        ),
        (Publish(id=14, engine_id="a", request_id="q", lease_s=0.5), [id_frame(3)]),
        (TakePeerEvents(id=15, engine_id="a"), []),
        (Report(id=16, worker=A, epoch=1, step=3, finished_sending=frozenset({"r"})), []),
        (Collect(id=17, engine_id="a", step=1, timeout_s=0.01), []),
    ]
]

field_values = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=40),
    st.none(),
    st.booleans(),
    st.lists(st.integers(min_value=-5, max_value=40), max_size=5),
    st.just({"engine_id": "a"}),
    st.just({"worker": {"engine_id": "a"}, "medium": "host"}),
)
FIELDS = [
    "id",
    "engine_id",
    "worker",
    "workers",
    "src",
    "dst",
    "count",
    "layers",
    "ids_dtype",
    "protocol_version",
    "target",
    "remote",
    "owner",
    "grantee",
    "step",
    "timeout_s",
    "items",
    "epoch",
    "epochs",
    "checksum",
    "fd_token",
    "medium",
]

random_frames = st.lists(st.binary(max_size=300), min_size=1, max_size=4)
plausible = st.builds(
    lambda tag, body, data: [msgspec.msgpack.encode({"type": tag, **body}), *data],
    st.one_of(st.sampled_from(sorted(REQUEST_TAGS)), st.text(max_size=12)),
    st.dictionaries(st.sampled_from(FIELDS), field_values, max_size=6),
    st.lists(st.binary(max_size=64), max_size=3),
)


@st.composite
def mutated(draw: st.DrawFn) -> list[bytes]:
    frames = [bytearray(f) for f in draw(st.sampled_from(TEMPLATES))]
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "drop", "add", "dup"]))
        i = draw(st.integers(0, len(frames) - 1))
        f = frames[i]
        if op == "flip" and f:
            pos = draw(st.integers(0, len(f) - 1))
            f[pos] = draw(st.integers(0, 255))
        elif op == "cut" and f:
            del f[draw(st.integers(0, len(f) - 1)) :]
        elif op == "insert":
            pos = draw(st.integers(0, len(f)))
            f[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "drop" and len(frames) > 1:
            del frames[i]
        elif op == "add":
            frames.append(bytearray(draw(st.binary(max_size=64))))
        elif op == "dup":
            frames.insert(i, bytearray(f))
    return [bytes(f) for f in frames]


@st.composite
def field_mutated(draw: st.DrawFn) -> list[bytes]:
    """A valid request with one or two fields replaced, removed or added (gets past msgpack)."""
    frames = list(draw(st.sampled_from(TEMPLATES)))
    header = msgspec.msgpack.decode(frames[0])
    for _ in range(draw(st.integers(1, 2))):
        key = draw(st.sampled_from(sorted(header) + FIELDS))
        if draw(st.booleans()) and key in header and key != "type":
            del header[key]
        else:
            header[key] = draw(field_values)
    frames[0] = msgspec.msgpack.encode(header)
    return frames


message = st.one_of(random_frames, plausible, mutated(), field_mutated(), field_mutated())


@dataclass
class Stats:
    inputs: int = 0
    replies: int = 0
    seconds: float = 0.0
    codes: dict[str, int] = field(default_factory=dict)


@dataclass
class Target:
    daemon: DaemonProcess
    worker: SidecarClient
    owner_b: SidecarClient
    caches: dict[str, list[torch.Tensor]]
    ctx: zmq.Context[zmq.Socket[bytes]]
    stats: Stats


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    config = make_config(
        max_message_bytes=256 << 10,
        max_header_bytes=16 << 10,
        max_ids_per_command=4096,
        fd_wait_s=0.2,
        host_pool_bytes=32 << 20,
        lease_s=30.0,
        peer_handshake_timeout_s=0.3,
        peer_pull_timeout_s=1.0,
    )
    caches = {e: allocate_kv_caches(1, SHAPE, torch.float16) for e in ("a", "b")}
    with daemon_process(config) as d:
        a = SidecarClient(config.endpoint)
        b = SidecarClient(config.endpoint)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            a.register_kv_caches({"l0": caches["a"][0]}, engine_id="a", host_blocks=8)
            b.register_kv_caches({"l0": caches["b"][0]}, engine_id="b", host_blocks=8)
            yield Target(d, a, b, caches, ctx, Stats())
        finally:
            a.close()
            b.close()
            ctx.term()


def _send_batch(t: Target, batch: list[list[bytes]]) -> None:
    sock = t.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(t.daemon.config.endpoint)
        t0 = time.perf_counter()
        for frames in batch:
            sock.send_multipart(frames)
        got = 0
        # A collect may legitimately wait up to its own bound (60 s) before answering.
        deadline = time.monotonic() + 70.0
        while got < len(batch):
            left = deadline - time.monotonic()
            assert left > 0, f"hang: {len(batch) - got} of {len(batch)} inputs got no reply"
            if not sock.poll(int(min(left, 1.0) * 1000)):
                assert t.daemon.proc.poll() is None, f"daemon died:\n{t.daemon.log()[-3000:]}"
                continue
            reply_frames = sock.recv_multipart()
            reply = msgspec.msgpack.decode(reply_frames[0], type=Reply)  # typed, or it raises
            code = getattr(reply, "code", type(reply).__name__)
            t.stats.codes[code] = t.stats.codes.get(code, 0) + 1
            got += 1
        t.stats.inputs += len(batch)
        t.stats.replies += got
        t.stats.seconds += time.perf_counter() - t0
    finally:
        sock.close()


def _fuzz(target: Target, inputs: int) -> None:
    @settings(
        max_examples=max(1, inputs // BATCH),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(message, min_size=BATCH, max_size=BATCH))
    def run(batch: list[list[bytes]]) -> None:
        _send_batch(target, batch)

    run()
    assert target.daemon.proc.poll() is None, "the daemon crashed"


def _check_still_moves(t: Target) -> None:
    """After the storm: the daemon serves, and a move copies exactly the right bytes.

    A fresh engine, since the fuzz may have unregistered "a" or taken its host blocks.
    """
    src = allocate_kv_caches(1, SHAPE, torch.float16)[0]
    src.copy_(torch.randn(SHAPE, generator=torch.Generator().manual_seed(7)).half())
    with SidecarClient(t.daemon.config.endpoint) as c:
        c.register_kv_caches({"l0": src}, engine_id="after-fuzz", host_blocks=4)
        host = c.host_alloc("after-fuzz", 3)
        c.offload(c.worker, [2, 5, 7], host)
        before = src.clone()
        src[:, [10, 11, 12]] = 0
        moved = c.onboard(c.worker, host, [10, 11, 12])
        assert moved.blocks == 3
        assert torch.equal(src[:, [10, 11, 12]], before[:, [2, 5, 7]])
        assert torch.equal(src[:, :10], before[:, :10])


def _report(t: Target, label: str) -> None:
    s = t.stats
    rate = s.inputs / s.seconds if s.seconds else 0.0
    top = sorted(s.codes.items(), key=lambda kv: -kv[1])[:8]
    print(
        f"\nfuzz[{label}]: {s.inputs} inputs, {s.replies} typed replies, {rate:.0f} inputs/s; {top}"
    )


@pytest.mark.timeout(150)
def test_fuzz_live_daemon(target: Target) -> None:
    inputs = int(os.environ.get("KVSIDECAR_FUZZ_INPUTS", DEFAULT_INPUTS))
    rss0 = rss_mib(target.daemon.proc.pid)
    _fuzz(target, inputs)
    assert target.stats.inputs >= inputs and target.stats.replies == target.stats.inputs
    _check_still_moves(target)
    grown = rss_mib(target.daemon.proc.pid) - rss0
    _report(target, f"default, RSS +{grown:.0f} MiB")
    assert grown < 128, f"daemon RSS grew {grown:.0f} MiB during the fuzz"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fuzz_live_daemon_long(target: Target) -> None:
    inputs = int(os.environ.get("KVSIDECAR_FUZZ_INPUTS", SLOW_INPUTS))
    _fuzz(target, inputs)
    _check_still_moves(target)
    _report(target, "slow")
