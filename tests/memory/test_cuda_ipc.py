"""CUDA IPC as far as it can be observed without a GPU (the GPU half is test_gpu.py).

The wire format with the device UUID, the UUID -> index mapping, typed refusals of malformed
handles (checked before any CUDA call, so a CPU-only daemon gives the same answers), one open and
one release per storage, the opening off the event loop, and the per-move events on the wire.
Where the CUDA call itself is needed, a `FakeIpc` backend stands in for torch's: "GPU memory" is
CPU memory whose release is counted when its last view is freed, as torch drops the IPC count.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from typing import Any

import msgspec
import pytest
import torch

from kvsidecar.client import AsyncSidecarClient, BufferSetRef, SidecarError, WorkerRef
from kvsidecar.client.calls import _reply
from kvsidecar.daemon.server import Daemon
from kvsidecar.memory import HandleError, allocate_kv_caches
from kvsidecar.memory.cuda_ipc import (
    CudaIpcHandle,
    canonical_uuid,
    check_cuda_handle,
    legacy_ipc_handle,
    local_index,
    plan_opens,
)
from kvsidecar.memory.cuda_sync import check_events
from kvsidecar.memory.fd_client import FdChannelClient
from kvsidecar.wire.cache import CacheLoad, CacheStore
from kvsidecar.wire.protocol import PROTOCOL_VERSION, Error, Move, Register, Registered
from kvsidecar.wire.pulls import Pull
from kvsidecar.wire.types import BufferDescriptor, CudaIpcRef, LayerSpec, MoveEvents
from tests.procs import cuda_engine
from tests.support.daemons import daemon_process, make_config, run_daemon
from tests.support.raw import raw_call

pytestmark = pytest.mark.timeout(60)

GPU0 = "GPU-0a1b2c3d-0000-1111-2222-333344445555"
GPU1 = "GPU-ffeeddcc-9999-8888-7777-666655554444"
DESC = BufferDescriptor("kv_first", "NHD", "float16", 4, 4, 2, 8)  # 1024 bytes a layer
LAYER = 1024


def handle(**changes: object) -> CudaIpcHandle:
    """A well-formed handle of layer 0 of an 8 KiB storage on GPU0; ``changes`` override."""
    base = CudaIpcHandle(
        device=0,
        ipc_handle=bytes(range(64)),
        storage_nbytes=8 * LAYER,
        storage_offset=0,
        ref_counter_handle=b"/torch_1_2",
        ref_counter_offset=4,
        event_handle=None,
        event_sync_required=False,
        offset=0,
        nbytes=LAYER,
        device_uuid=GPU0,
    )
    return msgspec.structs.replace(base, **changes)


# --- device identity (wire format, UUID -> index) ---------------------------------------------


def test_uuid_forms_are_one_and_garbage_is_refused() -> None:
    hex32 = "0a1b2c3d00001111222233334444" + "5555"
    for form in (GPU0, GPU0.upper(), GPU0[4:], hex32, f"  {GPU0}\n"):
        assert canonical_uuid(form) == GPU0
    for bad in ("", "GPU-", "GPU-xyz", hex32[:-1], hex32 + "00", "MIG-" + hex32):
        with pytest.raises(HandleError) as info:
            canonical_uuid(bad)
        assert info.value.code == "bad_handle"


def test_uuid_maps_to_the_daemons_own_index_or_is_refused() -> None:
    # The worker sees its GPU as cuda:0; the daemon sees both GPUs, that one second.
    assert local_index(GPU1, [GPU0, GPU1]) == 1
    assert local_index(GPU1[4:].upper(), [GPU1]) == 0
    with pytest.raises(HandleError) as info:
        local_index(GPU1, [GPU0])
    assert info.value.code == "device_not_visible" and GPU1 in str(info.value)
    with pytest.raises(HandleError) as info:
        local_index(GPU0, [])
    assert info.value.code == "device_not_visible"


def test_handle_wire_format_carries_the_uuid_and_reads_older_encodings() -> None:
    h = handle()
    wire = msgspec.msgpack.encode(h)
    assert msgspec.msgpack.decode(wire, type=CudaIpcRef) == h
    assert GPU0.encode() in wire
    # An older client's handle (no device_uuid) still decodes, with the documented default.
    raw = msgspec.msgpack.decode(wire)
    del raw["device_uuid"]
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=CudaIpcRef)
    assert decoded.device_uuid == "" and decoded.ipc_handle == h.ipc_handle


# --- malformed handles: typed refusals before any CUDA call -----------------------------------


def test_torch_handle_formats_become_the_bare_64_bytes() -> None:
    bare = bytes(range(64))
    assert legacy_ipc_handle(bare) is bare
    assert legacy_ipc_handle(b"\x02c" + bare) == bare  # torch >= 2.3, cudaMalloc
    assert legacy_ipc_handle(b"\x01c" + bare) == bare
    with pytest.raises(HandleError) as info:
        legacy_ipc_handle(b"\x02e" + bytes(100))  # an expandable segment
    assert info.value.code == "not_shareable"
    for bad in (b"", bare[:63], b"\x02x" + bare, bare + b"\0"):
        with pytest.raises(HandleError) as info:
            legacy_ipc_handle(bad)
        assert info.value.code == "bad_handle"


@pytest.mark.parametrize(
    "changes",
    [
        {"event_sync_required": True},  # the event handle is missing
        {"event_sync_required": True, "event_handle": b"\x01" * 63},
        {"ipc_handle": b"\x00" * 10},
        {"storage_nbytes": 0},
        {"offset": 8 * LAYER - 10},  # runs past the storage
        {"storage_offset": -1},
        {"ref_counter_handle": b""},
        {"ref_counter_handle": b"/torch\0x"},
        {"device_uuid": "GPU-not-a-uuid"},
    ],
)
def test_malformed_handles_are_bad_handle(changes: dict[str, object]) -> None:
    with pytest.raises(HandleError) as info:
        check_cuda_handle(handle(**changes))
    assert info.value.code == "bad_handle", info.value


async def test_daemon_answers_malformed_cuda_handles_with_typed_errors() -> None:
    """Through a real (CPU-only) daemon: handle_error naming the fault, then it keeps serving."""
    async with (
        run_daemon(make_config()) as daemon,
        AsyncSidecarClient(daemon.config.endpoint, heartbeat=False) as client,
    ):
        bad = handle(event_sync_required=True)  # torch would raise TypeError on this one
        reply = await raw_call(daemon.config.endpoint, [register_frame("bad", [bad])])
        assert isinstance(reply, Error) and reply.code == "handle_error"
        assert "bad_handle" in reply.message and "event_handle" in reply.message
        # A handle with the event_handle field missing altogether: a typed invalid_message.
        raw = msgspec.msgpack.decode(register_frame("m", [handle()]))
        del raw["layers"][0]["handle"]["event_handle"]
        reply = await raw_call(daemon.config.endpoint, [msgspec.msgpack.encode(raw)])
        assert isinstance(reply, Error) and reply.code == "invalid_message", reply
        # A well-formed handle of no real allocation: cuda_unavailable on this CPU-only daemon
        # (on a GPU: the open fails), typed either way.
        reply = await raw_call(daemon.config.endpoint, [register_frame("ok", [handle()])])
        assert isinstance(reply, Error) and reply.code == "handle_error"
        expected = "bad_handle" if torch.cuda.is_available() else "cuda_unavailable"
        assert expected in reply.message, reply.message
        assert (await client.status()).engines == []


def register_frame(engine: str, handles: list[CudaIpcHandle]) -> bytes:
    layers = [LayerSpec(f"l{i}", DESC, h) for i, h in enumerate(handles)]
    req = Register(id=1, protocol_version=PROTOCOL_VERSION, worker=WorkerRef(engine), layers=layers)
    return msgspec.msgpack.encode(req)


# --- one open and one release per storage -----------------------------------------------------


def test_plan_opens_one_storage_once_and_gives_back_second_exports() -> None:
    a0, a1 = handle(offset=0), handle(offset=LAYER)  # two layers of one export
    again = handle(offset=2 * LAYER, ref_counter_offset=9)  # a second export of that storage
    other = handle(ipc_handle=bytes(64), ref_counter_offset=5)
    opens, releases = plan_opens([a0, a1, again, other, again])
    assert opens == [0, 3] and releases == [2]


class FakeIpc:
    """`IpcBackend` without a GPU: storages are CPU tensors; a count drops when one is freed."""

    def __init__(self, visible: list[str], fail_on: bytes | None = None) -> None:
        self.visible = visible
        self.fail_on = fail_on
        self.threads: set[int] = set()
        self.opened: list[tuple[int, int]] = []  # (index, storage offset) per open
        self.given_back: list[int] = []  # counter slots released at once
        self.freed: list[int] = []  # counter slots released as their storage was freed

    def visible_uuids(self) -> list[str]:
        self.threads.add(threading.get_ident())
        return list(self.visible)

    def open_storage(self, index: int, h: CudaIpcHandle) -> torch.Tensor:
        self.threads.add(threading.get_ident())
        if h.ipc_handle == self.fail_on:
            raise HandleError("bad_handle", "cudaIpcOpenMemHandle failed (fake)")
        self.opened.append((index, h.storage_offset))
        flat = torch.zeros(h.storage_nbytes, dtype=torch.uint8)
        weakref.finalize(flat, self.freed.append, h.ref_counter_offset)
        return flat

    def release_counter(self, h: CudaIpcHandle) -> None:
        self.given_back.append(h.ref_counter_offset)


@pytest.fixture
async def fake_daemon() -> object:
    fake = FakeIpc([GPU0, GPU1])
    async with run_daemon(make_config(lease_s=60.0)) as daemon:  # no release by lease here
        assert daemon.registrations is not None
        daemon.registrations.cuda_backend = fake
        yield daemon, fake


async def test_each_storage_opened_once_on_its_uuids_gpu_and_released_once(
    fake_daemon: tuple[Daemon, FakeIpc],
) -> None:
    daemon, fake = fake_daemon
    loop_thread = threading.get_ident()
    layers = [handle(offset=i * LAYER, device=0, device_uuid=GPU1) for i in range(4)]
    layers.append(handle(offset=4 * LAYER, ref_counter_offset=9, device_uuid=GPU1))
    reply = await raw_call(daemon.config.endpoint, [register_frame("e", layers)])
    assert isinstance(reply, Registered) and reply.num_layers == 5, reply
    # The worker said device 0; its UUID is the daemon's GPU 1.
    assert fake.opened == [(1, 0)]
    assert fake.given_back == [9] and fake.freed == []
    # CUDA initialisation and the IPC opens ran on a helper thread, not on the event loop.
    assert fake.threads and loop_thread not in fake.threads
    async with AsyncSidecarClient(daemon.config.endpoint, heartbeat=False) as admin:
        await admin.unregister(WorkerRef("e"))
    for _ in range(50):
        gc.collect()
        if fake.freed:
            break
        await asyncio.sleep(0.02)
    assert fake.freed == [4] and fake.given_back == [9]  # each count given back exactly once


async def test_unseen_gpu_and_failed_opens_leave_no_count_behind(
    fake_daemon: tuple[Daemon, FakeIpc],
) -> None:
    daemon, fake = fake_daemon
    unseen = "GPU-12345678-1234-1234-1234-123456789abc"
    reply = await raw_call(
        daemon.config.endpoint, [register_frame("u", [handle(device_uuid=unseen)])]
    )
    assert isinstance(reply, Error) and reply.code == "handle_error"
    assert "device_not_visible" in reply.message and unseen in reply.message
    assert fake.opened == []
    # The second storage fails to open: the first is freed (count dropped as it goes), the
    # failed one and the not-yet-opened duplicate give their counts back at once.
    fake.fail_on = b"\x07" * 64
    layers = [
        handle(offset=0, ref_counter_offset=1),
        handle(ipc_handle=b"\x07" * 64, ref_counter_offset=2),
        handle(offset=LAYER, ref_counter_offset=3),
    ]
    reply = await raw_call(daemon.config.endpoint, [register_frame("f", layers)])
    assert isinstance(reply, Error) and reply.code == "handle_error" and "fake" in reply.message
    gc.collect()
    assert sorted(fake.freed + fake.given_back) == [1, 2, 3]


async def test_gpu_worker_released_when_its_process_goes(
    fake_daemon: tuple[Daemon, FakeIpc],
) -> None:
    """A registration of GPU memory sends a token without fds: its channel's end releases it."""
    daemon, fake = fake_daemon
    channel = FdChannelClient(daemon.config.fd_socket)
    (token,) = channel.send_all([])
    req = msgspec.msgpack.decode(register_frame("g", [handle(), handle(offset=LAYER)]))
    req["fd_token"] = token
    reply = await raw_call(daemon.config.endpoint, [msgspec.msgpack.encode(req)])
    assert isinstance(reply, Registered), reply
    assert fake.opened == [(0, 0)]
    channel.close()  # the worker process is gone
    for _ in range(50):
        gc.collect()
        if fake.freed:
            break
        await asyncio.sleep(0.02)
    assert fake.freed == [4]  # released now, not at the end of its lease (config.lease_s)
    assert "g" not in daemon.registry.engines


# --- per-move events on the wire --------------------------------------------------------------


def test_move_events_round_trip_and_older_moves_decode() -> None:
    events = MoveEvents(GPU0, b"\x01" * 64, b"\x02" * 64)
    move = Move(id=3, src=BufferSetRef(WorkerRef("a")), dst=BufferSetRef(WorkerRef("b")))
    with_events = msgspec.structs.replace(move, events=events)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(with_events), type=Move) == with_events
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(move))
    del raw["events"]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=Move).events is None
    # The connector's copies carry the same events; older senders' messages decode without.
    for msg in (
        CacheStore(id=4, source=BufferSetRef(WorkerRef("a")), fingerprint="fp"),
        CacheLoad(id=5, target=BufferSetRef(WorkerRef("a")), fingerprint="fp"),
        Pull(id=6, engine_id="a", remote_endpoint="", remote_engine_id="p", items=[]),
    ):
        typed = type(msg)
        carried = msgspec.structs.replace(msg, events=events)
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(carried), type=typed) == carried
        old = msgspec.msgpack.decode(msgspec.msgpack.encode(msg))
        del old["events"]
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=typed).events is None
    check_events(events)
    check_events(MoveEvents(GPU0, b"\x01" * 64))  # done is optional
    for bad in (
        MoveEvents(GPU0, b""),
        MoveEvents(GPU0, b"\x01" * 63),
        MoveEvents(GPU0, b"\x01" * 64, b"x"),
    ):
        with pytest.raises(HandleError) as info:
            check_events(bad)
        assert info.value.code == "bad_handle"


class RecordingSync:
    """A client GPU `Sync` that records its calls (the CUDA calls need a GPU: test_gpu.py)."""

    def __init__(self) -> None:
        self.device = torch.device("cuda", 0)
        self.calls: list[str] = []
        self.events = MoveEvents(GPU0, b"\x05" * 64, b"\x06" * 64)

    def before(self) -> MoveEvents:
        self.calls.append("before")
        return self.events

    def after(self) -> None:
        self.calls.append("after")


async def test_events_go_with_gpu_moves_only_and_cpu_memory_refuses_them() -> None:
    caches = allocate_kv_caches(2, (2, 4, 4, 2, 8), torch.float16)
    for i, t in enumerate(caches):
        t.copy_(torch.arange(t.numel(), dtype=torch.float16).view(t.shape) + i)
    before = [t.clone() for t in caches]
    async with (
        run_daemon(make_config()) as daemon,
        AsyncSidecarClient(daemon.config.endpoint, heartbeat=False) as client,
    ):
        vmm = {"cuda_vmm"} if torch.cuda.is_available() else set()
        assert set(client.daemon.capabilities) == {"cuda_events", "fd_tokens", *vmm}
        reg = await client.register_kv_caches(
            {"l0": caches[0], "l1": caches[1]}, engine_id="c", host_blocks=4
        )
        dev, host = BufferSetRef(reg.worker), BufferSetRef(reg.worker, "host")
        requests = client._requests
        # CPU memory: no events, and the reply goes back untouched (no extra call per move).
        call = requests.move(dev, host, [0, 1], [2, 3], None)
        assert call.req.events is None and call.finish is _reply
        # As if this worker's memory were on a GPU: events recorded before, waited on after.
        sync = RecordingSync()
        client._session.cuda_syncs[reg.worker] = sync
        call = requests.move(host, dev, [0], [1], None)
        assert call.req.events == sync.events and sync.calls == ["before"]
        assert requests.move(host, host, [0], [1], None).req.events is None  # no device side
        # A CPU daemon refuses them on CPU buffers: typed, and nothing moved.
        with pytest.raises(SidecarError) as info:
            await client._run(call)
        assert info.value.code == "invalid_message" and "CPU memory" in info.value.message
        assert sync.calls == ["before"]  # `after` only on success
        assert all(torch.equal(now, was) for now, was in zip(caches, before, strict=True))


async def test_stores_loads_and_pulls_carry_the_ready_event_and_cpu_memory_refuses_it() -> None:
    """The connector's copies are ordered like moves: the ready event is recorded as each is
    built (on the caller's stream, before it is sent); a daemon refuses events on CPU memory,
    typed, storing and writing nothing."""
    caches = allocate_kv_caches(2, (2, 4, 4, 2, 8), torch.float16)
    for i, t in enumerate(caches):
        t.copy_(torch.arange(t.numel(), dtype=torch.float16).view(t.shape) + i)
    before = [t.clone() for t in caches]
    keys = [b"\x01" * 32, b"\x02" * 32]
    async with (
        run_daemon(make_config(cache_bytes=1 << 20)) as daemon,
        AsyncSidecarClient(daemon.config.endpoint, heartbeat=False) as client,
    ):
        reg = await client.register_kv_caches({"l0": caches[0], "l1": caches[1]}, engine_id="c")
        cache = client._cache_requests
        plain = cache.cache_store("fp", keys, [0, 1], worker=None, not_after=0.0, timeout=None)
        assert plain.req.events is None  # CPU memory: nothing recorded, nothing sent
        sync = RecordingSync()
        client._session.cuda_syncs[reg.worker] = sync
        store = cache.cache_store("fp", keys, [0, 1], worker=None, not_after=0.0, timeout=None)
        load = cache.cache_load("fp", keys, [2, 3], worker=None, pin_id=0, timeout=None)
        pull_args: dict[str, Any] = {
            "pp_rank": 0,
            "medium": "device",
            "timeout_s": 5.0,
            "remote_request_ids": None,
            "plane": "",
            "timeout": None,
        }
        pull = client._requests.pull
        rank_pull = pull("c", "", "p", {"r": ([0], [2])}, tp_rank=0, **pull_args)
        engine_pull = pull("c", "", "p", {"r": ([0], [2])}, tp_rank=None, **pull_args)
        assert [c.req.events for c in (store, load, rank_pull)] == [sync.events] * 3
        assert engine_pull.req.events is None  # the scheduler's pull of every rank: no one stream
        assert sync.calls == ["before"] * 3
        for call in (store, load, rank_pull):
            with pytest.raises(SidecarError) as info:
                await client._run(call)
            assert info.value.code == "invalid_message", info.value
            assert "CPU memory" in info.value.message
        hits = await client.cache_lookup("fp", keys)
        assert hits.hits == 0  # the refused store published nothing
        assert all(torch.equal(now, was) for now, was in zip(caches, before, strict=True))
        assert (await client.status()).engines  # and the daemon serves on


# --- the GPU checks' own logic, on shared CPU memory --------------------------------------------


def test_engine_roundtrip_check_logic_on_cpu() -> None:
    """tests/procs/cuda_engine.py's roundtrip (run on GPUs by test_gpu.py and gpu_check.sh)
    passes on CPU memory and fails when a block is wrong, so a GPU verdict means something."""
    cpu = torch.device("cpu")
    with daemon_process(make_config(host_pool_bytes=16 << 20)) as daemon:
        result = cuda_engine.roundtrip(daemon.config.endpoint, cpu)
        assert result["ok"], result
        assert result["kinds"] == ["shm"]
    a, b = cuda_engine.make_cache(cpu), cuda_engine.make_cache(cpu, hnd=True)
    a[1][:, 4] = 1.0
    assert cuda_engine.compare(b, [2], a, [4]) and not cuda_engine.compare(b, [2], a, [3])
    assert cuda_engine.untouched(a, set()) and not cuda_engine.untouched(a, {4})


def test_engine_connector_check_logic_on_cpu() -> None:
    """tests/procs/cuda_engine.py's connector check (vLLM 0.31+'s GPU views through the
    connector's worker half; run on GPUs by test_gpu.py) passes on CPU memory."""
    with daemon_process(make_config(host_pool_bytes=16 << 20, cache_bytes=8 << 20)) as daemon:
        result = cuda_engine.connector(daemon.config.endpoint, torch.device("cpu"))
    assert result["ok"], result
    assert result["events"] is False  # CPU memory: nothing to order
