"""``bench local``: block moves on one node, through a daemon and in process, side by side.

This process is the engine worker of two engines, A and B: each is ``layers`` K-or-V tensors of
``(num_blocks, *block_shape)`` in shared memory, all layers in one region (so they stack), as
`kvsidecar.memory.allocate_kv_caches` allocates them. ``blocks`` ids move per layer. Per id set
(``random`` and runs of each ``--run-lengths``), the methods take turns, one call each per round:

- daemon w2w: one ``Move`` A -> B through the daemon, wall time of the blocking call;
- daemon offload: one ``Move`` A -> A's host mirror in the daemon's pool;
- in-process run copy: ``validate_move`` + ``plan_runs`` + ``copy_runs`` A -> B in this process,
  and A -> a host-mirror replica laid out like the daemon's (the offload baseline);
- naive ``index_copy_(index_select)`` per layer at torch's default thread count and at 1 (the
  faster median is the baseline: on a busy machine the default count is often the slower);
- numpy memcpy of the same bytes between contiguous buffers: the machine's limit.

Every method's result is checked once before timing (an offload by moving it back into B).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from kvsidecar.bench import procs
from kvsidecar.bench.common import Figure, Options, Progress, note, round_robin, torch_dtype
from kvsidecar.bench.workload import (
    IdPair,
    check_blocks,
    id_sets,
    mark_blocks,
    memcpy,
    naive_copy,
    reset_marks,
    run_copy,
    run_length_of,
)
from kvsidecar.client import BufferSetRef, SidecarClient
from kvsidecar.core import copier
from kvsidecar.memory import allocate_kv_caches

NAIVE = "naive index_copy_"
MEMCPY = "numpy memcpy"
RUN_COPY = "in-process run copy"


@dataclass
class Engines:
    """Two engines' caches registered with one daemon; A may write B's blocks."""

    a: list[torch.Tensor]
    b: list[torch.Tensor]
    client_a: SidecarClient
    client_b: SidecarClient
    a_dev: BufferSetRef
    b_dev: BufferSetRef
    a_host: BufferSetRef
    host_ids: np.ndarray


@contextlib.contextmanager
def engines(
    endpoint: str,
    opts: Options,
    num_blocks: int,
    *,
    host_blocks: int = 0,
    layers: int | None = None,
    prefix: str = "",
) -> Iterator[Engines]:
    """Allocate, mark and register engines A and B (A with ``host_blocks`` in the pool).

    ``prefix`` makes the engine ids distinct from those of engines released just before (the
    daemon may not have seen the previous clients go yet).
    """
    n_layers = opts.layers if layers is None else layers
    shape = (num_blocks, *opts.block_shape)
    dtype = torch_dtype(opts.dtype)
    a = allocate_kv_caches(n_layers, shape, dtype)  # zeroed, i.e. touched, by the allocator
    b = allocate_kv_caches(n_layers, shape, dtype)
    mark_blocks(a)
    names = [f"layer{i}" for i in range(n_layers)]
    client_a = SidecarClient(endpoint, timeout_s=300, name="bench-a")
    client_b = SidecarClient(endpoint, timeout_s=300, name="bench-b")
    try:
        wa = client_a.register_kv_caches(
            dict(zip(names, a, strict=True)),
            engine_id=f"{prefix}A",
            arrangement="split",
            host_blocks=host_blocks,
        ).worker
        wb = client_b.register_kv_caches(
            dict(zip(names, b, strict=True)), engine_id=f"{prefix}B", arrangement="split"
        ).worker
        client_b.grant(
            f"{prefix}A", read=False, write=True
        )  # engine A's moves may write B's blocks
        host_ids = client_a.host_alloc(f"{prefix}A", host_blocks) if host_blocks else np.empty(0)
        yield Engines(
            a,
            b,
            client_a,
            client_b,
            BufferSetRef(wa, "device"),
            BufferSetRef(wb, "device"),
            BufferSetRef(wa, "host"),
            np.asarray(host_ids, dtype=np.int64),
        )
    finally:
        client_a.close()
        client_b.close()


def run(opts: Options) -> list[Figure]:
    """Start a daemon, measure every id set, return the figures."""
    host_bytes = opts.moved_bytes + (16 << 20)  # A's mirror, with room for alignment
    note(
        f"local: {opts.layers} layers x ({opts.num_blocks}, "
        f"{', '.join(map(str, opts.block_shape))}) {opts.dtype}, {opts.blocks} blocks/layer = "
        f"{opts.moved_bytes / 2**20:.1f} MiB per move; torch threads {torch.get_num_threads()}, "
        f"mover threads {copier.default_copy_threads()}, {opts.repeat} rounds"
    )
    with (
        procs.daemon(host_pool_bytes=host_bytes, peer_data_plane=opts.peer_data_plane) as (ep, _),
        engines(ep, opts, opts.num_blocks, host_blocks=opts.blocks) as eng,
    ):
        sets = id_sets(opts.blocks, opts.num_blocks, opts.run_lengths, opts.seed)
        progress = Progress(len(sets) * opts.repeat, "local", enabled=opts.progress)
        try:
            figures: list[Figure] = []
            for name, ids in sets.items():
                figures += _id_set(opts, eng, name, ids, progress)
        finally:
            progress.close()
    return figures


def _id_set(
    opts: Options, eng: Engines, ids_name: str, ids: IdPair, progress: Progress
) -> list[Figure]:
    src_ids, dst_ids = ids
    host_ids = eng.host_ids
    nbytes = opts.moved_bytes
    # The daemon's host mirror is layer-major in one region; the replica too, touched now.
    mirror = list(
        torch.zeros((opts.layers, opts.blocks, *opts.block_shape), dtype=eng.a[0].dtype).unbind(0)
    )
    s32, d32, h32 = (x.astype("<i4") for x in (src_ids, dst_ids, host_ids))
    s_idx, d_idx = torch.from_numpy(src_ids), torch.from_numpy(dst_ids)
    default_threads = torch.get_num_threads()

    def daemon_w2w() -> None:
        eng.client_a.move(eng.a_dev, eng.b_dev, s32, d32)

    def daemon_offload() -> None:
        eng.client_a.move(eng.a_dev, eng.a_host, s32, h32)

    methods: list[tuple[str, Callable[[], object]]] = [
        ("daemon w2w", daemon_w2w),
        ("daemon offload", daemon_offload),
        (RUN_COPY, run_copy(eng.a, eng.b, src_ids, dst_ids)),
        ("run copy to host mirror", run_copy(eng.a, mirror, src_ids, host_ids)),
        (f"{NAIVE} {default_threads}t", naive_copy(eng.a, eng.b, s_idx, d_idx, default_threads)),
        (f"{NAIVE} 1t", naive_copy(eng.a, eng.b, s_idx, d_idx, 1)),
        (MEMCPY, memcpy(nbytes)),
    ]
    for label, fn in methods:  # warm-up and check, untimed
        if label == MEMCPY:
            fn()
        elif label == "daemon offload":
            fn()
            reset_marks(eng.b)
            back = np.arange(host_ids.size, dtype=np.int64)
            eng.client_a.move(eng.a_host, eng.b_dev, host_ids, back)
            check_blocks(eng.b, src_ids, back)
        else:
            dst = mirror if "mirror" in label else eng.b
            reset_marks(dst)
            fn()
            check_blocks(dst, src_ids, host_ids if dst is mirror else dst_ids)
    progress.step(0, f"local {ids_name}")
    rates = round_robin(methods, opts.repeat, nbytes, progress)
    naive_label = max((k for k in rates if k.startswith(NAIVE)), key=lambda k: _med(rates[k]))
    naive = f"{NAIVE} (faster of {default_threads}t/1t: {naive_label.rsplit(' ', 1)[1]})"
    run = run_length_of(ids_name)
    group = f"local, {ids_name} ids, {nbytes / 2**20:.1f} MiB per move"

    def fig(name: str, what: str, base_name: str, base: str) -> Figure:
        return Figure(
            name=f"local/{ids_name}/{name}",
            unit="GB/s",
            samples=rates[what],
            baseline=base_name,
            baseline_samples=rates[base],
            group=group,
            chart="run_length",
            series=name,
            x=run,
        )

    return [
        fig("daemon w2w", "daemon w2w", RUN_COPY, RUN_COPY),
        fig("daemon w2w", "daemon w2w", naive, naive_label),
        fig(
            "daemon offload", "daemon offload", "run copy to host mirror", "run copy to host mirror"
        ),
        fig(RUN_COPY, RUN_COPY, naive, naive_label),
        fig(RUN_COPY, RUN_COPY, MEMCPY, MEMCPY),
    ]


def _med(values: list[float]) -> float:
    return float(np.median(values))
