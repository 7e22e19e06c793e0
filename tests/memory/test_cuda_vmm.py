"""The CUDA VMM path without a GPU: planning, refusals, ctypes plumbing, fd bookkeeping.

`kvsidecar.memory.cuda_driver` is exercised against ``tests/memory/stub_libcuda.c``, compiled
here: a library with the driver's CUDA 12 prototypes whose "device memory" is memfd-backed host
memory, so that an export, the fds crossing a real fd channel, the import, the mapping and the
unmapping run end to end with real fds and real bytes. The real driver is test_gpu.py's.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import shutil
import subprocess
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvsidecar.client import AsyncSidecarClient, SidecarError
from kvsidecar.memory import HandleError, allocate_shared
from kvsidecar.memory import cuda_driver as cd
from kvsidecar.memory.cuda_vmm import (
    Mapping,
    choose_export,
    export_vmm_tensors,
    import_chunks,
    open_cuda_vmm_all,
    plan_chunks,
)
from kvsidecar.memory.fd_channel import FdChannelServer
from kvsidecar.memory.fd_client import MAX_FDS, FdChannelClient, materialize
from tests.support.daemons import make_config, run_daemon

pytestmark = pytest.mark.timeout(60)

STUB_SOURCE = Path(__file__).parent / "stub_libcuda.c"
GPU0 = "GPU-0a1b2c3d-0000-1111-2222-333344445555"
GPU1 = "GPU-ffeeddcc-9999-8888-7777-666655554444"
CHUNK = 64 << 10
POSIX_FD = cd.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


# --- pure parts ---------------------------------------------------------------------------------


def test_struct_layouts_match_cuda_h() -> None:
    assert ctypes.sizeof(cd.MemLocation) == 8
    assert ctypes.sizeof(cd.MemAccessDesc) == 12
    assert ctypes.sizeof(cd.AllocationProp) == 32
    assert cd.AllocationProp.location.offset == 8
    assert cd.AllocationProp.win32HandleMetaData.offset == 16
    assert cd.AllocationProp.allocFlags.offset == 24
    assert cd.MemAccessDesc.flags.offset == 8


def test_choose_export_names_the_setting_that_blocks_sharing() -> None:
    assert choose_export(legacy_capable=True, allowed_handle_types=0, daemon_has_vmm=False) == (
        "cuda_ipc"
    )
    assert (
        choose_export(legacy_capable=False, allowed_handle_types=POSIX_FD, daemon_has_vmm=True)
        == "cuda_vmm"
    )
    # vLLM's sleep-mode allocator asks for no handle type: nobody can map it.
    with pytest.raises(HandleError) as info:
        choose_export(legacy_capable=False, allowed_handle_types=0, daemon_has_vmm=True)
    message = str(info.value)
    assert info.value.code == "not_shareable"
    assert "expandable_segments" in message and "enable_sleep_mode" in message
    # Exportable, but the daemon does not import VMM fds.
    with pytest.raises(HandleError) as info:
        choose_export(legacy_capable=False, allowed_handle_types=POSIX_FD, daemon_has_vmm=False)
    assert info.value.code == "not_shareable" and "cuda_vmm" in str(info.value)


def test_plan_chunks_walks_back_to_back_mappings() -> None:
    mappings = [(0x10000, 0x1000), (0x11000, 0x4000), (0x15000, 0x1000), (0x20000, 0x1000)]

    def mapping_range(ptr: int) -> tuple[int, int]:
        for base, size in mappings:
            if base <= ptr < base + size:
                return base, size
        raise HandleError("cuda_error", f"{ptr:#x} not mapped")

    # Starts inside the first chunk, ends inside the third.
    assert plan_chunks(0x10800, 0x15010, mapping_range) == mappings[:3]
    assert plan_chunks(0x11000, 0x15000, mapping_range) == [mappings[1]]
    with pytest.raises(HandleError) as info:  # 0x16000 is a gap
        plan_chunks(0x15000, 0x20010, mapping_range)
    assert info.value.code == "cuda_error"
    with pytest.raises(HandleError) as info:  # a driver answer that does not contain the pointer
        plan_chunks(0x10000, 0x10010, lambda p: (p + 1, 16))
    assert info.value.code == "not_shareable"
    with pytest.raises(HandleError):
        plan_chunks(0x10000, 0x10000, mapping_range)


def test_materialize_closes_what_it_made_when_an_export_fails() -> None:
    made: list[int] = []

    def export() -> int:
        fd = os.memfd_create("t")
        made.append(fd)
        return fd

    def broken() -> int:
        raise HandleError("cuda_error", "cuMemExportToShareableHandle failed")

    fds, owned = materialize([5, export, 7])
    assert fds == [5, made[0], 7] and owned == [made[0]]
    os.close(made[0])
    gc.collect()
    n0 = fd_count()
    with pytest.raises(HandleError):
        materialize([export, export, broken])
    assert fd_count() == n0  # the two made before the failure were closed


# --- the driver through ctypes, against the stub ------------------------------------------------


@pytest.fixture(scope="module")
def stub_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, (
        "a C compiler is needed to build the stub driver (scripts/install-system-tools)"
    )
    out = tmp_path_factory.mktemp("stub") / "libcuda_stub.so"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", "-o", str(out), str(STUB_SOURCE)],
        check=True,
        timeout=60,
    )
    return out


@pytest.fixture
def stub(
    stub_library: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[cd.Driver, ctypes.CDLL]]:
    """A fresh stub (its own copy: fresh counters) loaded as the process's driver."""
    copy = stub_library.with_name(f"libcuda_stub_{os.urandom(4).hex()}.so")
    shutil.copy(stub_library, copy)
    monkeypatch.setenv(cd.LIBRARY_ENV, str(copy))
    lib = ctypes.CDLL(str(copy))
    lib.stub_alloc.restype = ctypes.c_uint64
    lib.stub_alloc.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
    yield cd.driver(), lib
    copy.unlink()


def stats(lib: ctypes.CDLL) -> dict[str, int]:
    out = (ctypes.c_longlong * 7)()
    lib.stub_stats(out)
    names = ["imports", "maps", "reservations", "access_calls", "access_ordinal", "ctx", "retained"]
    return dict(zip(names, out, strict=True))


def device_tensor(base: int, nbytes: int) -> torch.Tensor:
    """A tensor over stub "device memory" (host addresses), as a CUDA tensor would be."""
    return torch.frombuffer((ctypes.c_ubyte * nbytes).from_address(base), dtype=torch.uint8)


def cpu_wrap(mapping: Mapping) -> torch.Tensor:
    """What `_as_tensor` does on a GPU, for the stub's host memory: unmapped when freed."""
    array = (ctypes.c_ubyte * mapping.nbytes).from_address(mapping.base)
    weakref.finalize(array, mapping.close)
    return torch.frombuffer(array, dtype=torch.uint8)


def test_missing_driver_or_symbols_are_cuda_unavailable(
    stub_library: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cd.LIBRARY_ENV, "/nonexistent/libcuda.so.1")
    with pytest.raises(HandleError) as info:
        cd.driver()
    assert info.value.code == "cuda_unavailable"
    libc = ctypes.CDLL(None)  # a library without the driver's functions
    with pytest.raises(HandleError) as info:
        cd.Driver(libc)
    assert info.value.code == "cuda_unavailable" and "cuInit" in str(info.value)


async def test_vmm_export_fd_channel_import_map_and_release(
    stub: tuple[cd.Driver, ctypes.CDLL], tmp_path: Path
) -> None:
    """Two storages (one over 3 chunks, from mid-chunk) exported, sent, imported, read, freed."""
    drv, lib = stub
    base = lib.stub_alloc(4, CHUNK, POSIX_FD)
    region = device_tensor(base + 100, 3 * CHUNK - 200)  # chunks 0..2, not chunk-aligned
    other = device_tensor(lib.stub_alloc(1, CHUNK, POSIX_FD), CHUNK)
    region.copy_(torch.randint(0, 255, region.shape, dtype=torch.uint8))
    other.fill_(7)
    layers = [region[:1000], region[1000:3000], region[5000 : 5000 + 2 * CHUNK], other[64:]]
    assert not drv.legacy_ipc_capable(region.data_ptr())
    assert drv.allowed_handle_types(region.data_ptr()) == POSIX_FD
    handles, sources = export_vmm_tensors(layers, first_fd_index=2, drv=drv, uuid_of=lambda i: GPU1)
    assert [h.fd_index for h in handles] == [2, 2, 2, 5]
    assert handles[0].chunk_nbytes == [CHUNK] * 3 and handles[3].chunk_nbytes == [CHUNK]
    assert [h.offset for h in handles] == [100, 1100, 5100, 64]
    assert stats(lib)["retained"] == 0  # nothing exported yet: fds are made as they are sent
    gc.collect()  # garbage of earlier tests must not close fds in the middle of the count
    n_before = fd_count()
    async with FdChannelServer(tmp_path / "fd.sock") as server:
        with FdChannelClient(tmp_path / "fd.sock") as client:
            borrowed = os.open("/dev/null", os.O_RDONLY)  # e.g. an shm storage's fd
            await asyncio.sleep(0.05)  # the server accepted
            n_sending = fd_count()
            tokens = client.send_all([borrowed, borrowed, *sources])
            assert len(tokens) == 1 and stats(lib)["retained"] == 0
            _, fds = await server.take(tokens[0], 5)
            assert len(fds) == 6
            # The worker closed every fd it exported, and kept the borrowed one.
            assert fd_count() == n_sending + len(fds) and os.fstat(borrowed)
            buffers = open_cuda_vmm_all(handles, fds, visible=[GPU0, GPU1], drv=drv, wrap=cpu_wrap)
            for fd in fds:
                os.close(fd)
            os.close(borrowed)
    s = stats(lib)
    assert s["maps"] == 4 and s["reservations"] == 2 and s["imports"] == 0
    assert s["access_calls"] == 2 and s["access_ordinal"] == 1  # GPU1 is index 1 here
    for got, want in zip(buffers, layers, strict=True):
        assert torch.equal(got.flat, want)
    buffers[2].flat[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)  # daemon writes ...
    assert region[5000:5004].tolist() == [1, 2, 3, 4]  # ... the worker sees it
    for b in buffers:
        b.close()
    del got
    gc.collect()
    s = stats(lib)
    assert (s["maps"], s["reservations"], s["imports"]) == (0, 0, 0)
    assert fd_count() == n_before


def test_failed_import_leaves_no_mapping_and_bad_handles_are_refused(
    stub: tuple[cd.Driver, ctypes.CDLL],
) -> None:
    drv, lib = stub
    t = device_tensor(lib.stub_alloc(2, CHUNK, POSIX_FD), 2 * CHUNK)
    (handle,), sources = export_vmm_tensors([t], first_fd_index=0, drv=drv, uuid_of=lambda i: GPU0)
    fds, owned = materialize(sources)
    try:
        # The second chunk claims a size its fd does not have: cuMemMap fails, all is undone.
        with pytest.raises(HandleError) as info:
            import_chunks(drv, 0, fds, [CHUNK, 2 * CHUNK])
        assert info.value.code == "cuda_error" and "cuMemMap" in str(info.value)
        s = stats(lib)
        assert (s["maps"], s["reservations"], s["imports"]) == (0, 0, 0)
        bad = [
            {"fd_index": 1},  # its chunks run past the fds sent
            {"chunk_nbytes": []},
            {"chunk_nbytes": [CHUNK, 0]},
            {"offset": 2 * CHUNK},
            {"device_uuid": "nope"},
        ]
        import msgspec

        for changes in bad:
            with pytest.raises(HandleError) as info:
                open_cuda_vmm_all(
                    [msgspec.structs.replace(handle, **changes)], fds, visible=[GPU0], drv=drv
                )
            assert info.value.code == "bad_handle", changes
        with pytest.raises(HandleError) as info:
            open_cuda_vmm_all([handle], fds, visible=[GPU1], drv=drv, wrap=cpu_wrap)
        assert info.value.code == "device_not_visible"
    finally:
        for fd in owned:
            os.close(fd)


def test_export_refused_for_memory_without_a_shareable_handle_type(
    stub: tuple[cd.Driver, ctypes.CDLL],
) -> None:
    drv, lib = stub
    t = device_tensor(lib.stub_alloc(1, CHUNK, 0), CHUNK)  # like vLLM's CuMemAllocator
    allowed = drv.allowed_handle_types(t.data_ptr())
    with pytest.raises(HandleError) as info:
        choose_export(
            legacy_capable=drv.legacy_ipc_capable(t.data_ptr()),
            allowed_handle_types=allowed,
            daemon_has_vmm=True,
        )
    assert info.value.code == "not_shareable"
    # Even if asked, the driver refuses, and the retained handle is released.
    with pytest.raises(HandleError) as info:
        drv.export_fd(t.data_ptr())
    assert info.value.code == "cuda_error" and stats(lib)["retained"] == 0


# --- more fds than one message carries ----------------------------------------------------------


async def test_registration_with_more_fds_than_one_message() -> None:
    n = MAX_FDS + 47
    tensors = [allocate_shared(1024).view(torch.float16).view(2, 4, 4, 2, 8) for _ in range(n)]
    for i, t in enumerate(tensors):
        t.fill_(i)
    async with run_daemon(make_config()) as daemon:
        async with AsyncSidecarClient(daemon.config.endpoint, heartbeat=False) as client:
            await client.status()
            gc.collect()
            n0 = fd_count()
            reg = await client.register_kv_caches(
                {f"l{i}": t for i, t in enumerate(tensors)}, engine_id="many"
            )
            assert reg.num_layers == n
            status = await client.status()
            assert len(status.engines[0].workers[0].layers) == n
            await client.unregister()
            gc.collect()
            # Both ends of the fd channel stay open; every fd the daemon received is closed.
            assert fd_count() == n0 + 2
        # A daemon that does not announce fd_tokens is not sent more than one message.
        assert daemon.registrations is not None
        daemon.registrations.capabilities = ()
        async with AsyncSidecarClient(daemon.config.endpoint, heartbeat=False) as old:
            with pytest.raises(SidecarError) as info:
                await old.register_kv_caches(
                    {f"l{i}": t for i, t in enumerate(tensors)}, engine_id="x"
                )
            assert info.value.code == "handle_error" and "at most 253" in str(info.value)
    assert np.all([float(t[0, 0, 0, 0, 0]) == i for i, t in enumerate(tensors)])
