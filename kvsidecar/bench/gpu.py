"""``bench gpu``: moves of GPU KV caches through the daemon against the worker's own copies.

Needs a CUDA device; without one it stops at once with a clear message (never measured on the
project's CPU machines). This process is the engine worker of two engines, A and B, each
``layers`` x ``(num_blocks, *block_shape)`` on ``cuda:0`` in one allocation, registered with the
daemon by CUDA IPC; A has ``blocks`` blocks in the daemon's host pool (pinned on CUDA machines).
Per id set, methods take turns, one call each per round, every one synchronised before the clock
stops:

- offload: daemon ``Move`` A -> A's host mirror, against the worker's own torch copy into a
  pinned buffer (per layer ``index_select`` on the device, ``copy_(non_blocking=True)`` to pinned
  host memory, synchronise);
- onboard: daemon ``Move`` A's host mirror -> A, against the worker's pinned -> device copy
  (``to(device, non_blocking=True)`` + ``index_copy_``);
- engine to engine: daemon ``Move`` A -> B (CUDA IPC on both sides), against the in-process
  device copy (per layer ``index_copy_(index_select)`` on the device).

Every method's result is checked once before timing. Target: each daemon path >= 0.9x of its
in-process baseline.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvsidecar.bench import procs
from kvsidecar.bench.common import (
    BenchUnavailable,
    Figure,
    Options,
    Progress,
    note,
    round_robin,
    torch_dtype,
)
from kvsidecar.bench.workload import check_blocks, id_sets, mark_blocks, reset_marks
from kvsidecar.client import BufferSetRef, SidecarClient


def require_cuda() -> torch.device:
    """Return the first CUDA device, or raise `BenchUnavailable` saying why there is none."""
    if not torch.cuda.is_available():
        built = torch.version.cuda or "none (a CPU-only build)"
        raise BenchUnavailable(
            f"bench gpu needs a CUDA device: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA {built})"
        )
    return torch.device("cuda", 0)


def run(opts: Options) -> list[Figure]:
    """Start a daemon with a pinned host pool, register two GPU engines, time every path."""
    device = require_cuda()
    dtype = torch_dtype(opts.dtype)
    shape = (opts.num_blocks, *opts.block_shape)
    note(
        f"gpu: {torch.cuda.get_device_name(device)}; {opts.layers} layers x {shape} {opts.dtype}, "
        f"{opts.blocks} blocks/layer = {opts.moved_bytes / 2**20:.1f} MiB per move"
    )
    a = list(torch.zeros((opts.layers, *shape), dtype=dtype, device=device).unbind(0))
    b = list(torch.zeros((opts.layers, *shape), dtype=dtype, device=device).unbind(0))
    mark_blocks(a)
    pinned = list(
        torch.zeros((opts.layers, opts.blocks, *opts.block_shape), dtype=dtype)
        .pin_memory()
        .unbind(0)
    )
    names = [f"layer{i}" for i in range(opts.layers)]
    figures: list[Figure] = []
    sets = id_sets(opts.blocks, opts.num_blocks, opts.run_lengths[:1], opts.seed)
    progress = Progress(len(sets) * opts.repeat, "gpu", enabled=opts.progress)
    with procs.daemon(host_pool_bytes=opts.moved_bytes + (16 << 20)) as (endpoint, _):
        ca = SidecarClient(endpoint, timeout_s=300, name="bench-gpu-a")
        cb = SidecarClient(endpoint, timeout_s=300, name="bench-gpu-b")
        try:
            wa = ca.register_kv_caches(
                dict(zip(names, a, strict=True)),
                engine_id="GA",
                arrangement="split",
                host_blocks=opts.blocks,
            ).worker
            wb = cb.register_kv_caches(
                dict(zip(names, b, strict=True)), engine_id="GB", arrangement="split"
            ).worker
            cb.grant("GA", read=False, write=True)
            host_ids = np.asarray(ca.host_alloc("GA", opts.blocks), dtype=np.int64)
            refs = (BufferSetRef(wa, "device"), BufferSetRef(wb, "device"))
            for ids_name, ids in sets.items():
                figures += _id_set(
                    opts,
                    ids_name=ids_name,
                    ids=ids,
                    host_ids=host_ids,
                    a=a,
                    b=b,
                    pinned=pinned,
                    client=ca,
                    refs=refs,
                    progress=progress,
                )
        finally:
            progress.close()
            ca.close()
            cb.close()
    return figures


def _id_set(
    opts: Options,
    *,
    ids_name: str,
    ids: tuple[np.ndarray, np.ndarray],
    host_ids: np.ndarray,
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    pinned: list[torch.Tensor],
    client: SidecarClient,
    refs: tuple[BufferSetRef, BufferSetRef],
    progress: Progress,
) -> list[Figure]:
    a_dev, b_dev = refs
    a_host = BufferSetRef(a_dev.worker, "host")
    src_ids, dst_ids = ids
    device = a[0].device
    s_idx = torch.from_numpy(src_ids).to(device)
    d_idx = torch.from_numpy(dst_ids).to(device)
    s32, d32, h32 = (x.astype("<i4") for x in (src_ids, dst_ids, host_ids))
    sync = torch.cuda.synchronize

    def d_offload() -> None:
        client.move(a_dev, a_host, s32, h32)

    def d_onboard() -> None:
        client.move(a_host, b_dev, h32, d32)

    def d_w2w() -> None:
        client.move(a_dev, b_dev, s32, d32)

    def t_offload() -> None:
        for src, host in zip(a, pinned, strict=True):
            host.copy_(src.index_select(0, s_idx), non_blocking=True)
        sync()

    def t_onboard() -> None:
        for host, dst in zip(pinned, b, strict=True):
            dst.index_copy_(0, d_idx, host.to(device, non_blocking=True))
        sync()

    def t_w2w() -> None:
        for src, dst in zip(a, b, strict=True):
            dst.index_copy_(0, d_idx, src.index_select(0, s_idx))
        sync()

    # Checks, untimed: offloads are checked by onboarding them into B.
    for offload, onboard in ((d_offload, d_onboard), (t_offload, t_onboard)):
        reset_marks(b)
        offload()
        onboard()
        check_blocks(b, src_ids, dst_ids)
    reset_marks(b)
    d_w2w()
    check_blocks(b, src_ids, dst_ids)
    reset_marks(b)
    t_w2w()
    check_blocks(b, src_ids, dst_ids)

    methods: list[tuple[str, Callable[[], object]]] = [
        ("daemon offload", d_offload),
        ("torch pinned offload", t_offload),
        ("daemon onboard", d_onboard),
        ("torch pinned onboard", t_onboard),
        ("daemon w2w (CUDA IPC)", d_w2w),
        ("in-process device copy", t_w2w),
    ]
    return _figures(opts, ids_name, round_robin(methods, opts.repeat, opts.moved_bytes, progress))


def _figures(opts: Options, ids_name: str, rates: dict[str, list[float]]) -> list[Figure]:
    """Each daemon method against the in-process torch copy that does the same."""
    group = f"gpu, {ids_name} ids, {opts.moved_bytes / 2**20:.1f} MiB per move"
    pairs = [
        ("daemon offload", "torch pinned offload"),
        ("daemon onboard", "torch pinned onboard"),
        ("daemon w2w (CUDA IPC)", "in-process device copy"),
    ]
    return [
        Figure(
            name=f"gpu/{ids_name}/{name}",
            unit="GB/s",
            samples=rates[name],
            baseline=base,
            baseline_samples=rates[base],
            group=group,
        )
        for name, base in pairs
    ]
