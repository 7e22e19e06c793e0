"""``bench scaling``: how throughput and command time grow with blocks, layers, workers.

And how the per-command cost holds as the daemon's registry grows.

Four curves, each point timed side by side with its baseline (methods take turns per round):

- **blocks per move** (1..4096, random ids, 8 layers): one daemon ``Move`` A -> B against the
  in-process run copy of the same move. Throughput (charted by transfer size) and command time.
- **layers** (8..128, 64 random blocks): the same, with engines of that many layers.
- **workers** (1..16): N threads of this process, each with its own `SidecarClient` and its own
  registered worker (8 layers), all moving 64 random blocks within their own cache at once;
  aggregate throughput and the median command time, against the same N threads each running
  the in-process run copy of its move. Threads, not processes: 16 Python processes with torch
  would swamp a 2-core machine; each thread still has its own socket and fd channel.
- **registry**: the 1-block move round trip (1 layer, and all 128 layers) on one worker of a
  daemon where 1, 8 and then 64 workers x 128 layers are registered, against the same move on a
  second daemon where only that one worker is registered, in alternating batches. The layers are
  small (``16 x 1 x 16`` elements per block, 16 blocks): only the registry's size matters here.
  Target: with 64 workers the p50 stays within 1.5x of the one-worker daemon's.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from kvsidecar.bench import procs
from kvsidecar.bench.common import Figure, Options, Progress, note, percentile, torch_dtype
from kvsidecar.bench.local import RUN_COPY, Engines, engines
from kvsidecar.bench.workload import check_blocks, mark_blocks, reset_marks, run_copy
from kvsidecar.client import BufferSetRef, SidecarClient
from kvsidecar.memory import allocate_kv_caches

BLOCK_COUNTS = (1, 4, 16, 64, 256, 1024, 4096)
LAYER_COUNTS = (8, 16, 32, 64, 128)
WORKER_COUNTS = (1, 2, 4, 8, 16)
REGISTRY_WORKERS = (1, 8, 64)
REGISTRY_LAYERS = 128
FIXED_LAYERS = 8
FIXED_BLOCKS = 64
DAEMON = "daemon move"


def run(opts: Options) -> list[Figure]:
    """Measure the four curves against one daemon (two for the registry curve)."""
    note(
        f"scaling: blocks {BLOCK_COUNTS[0]}..{BLOCK_COUNTS[-1]}, layers {LAYER_COUNTS[0]}.."
        f"{LAYER_COUNTS[-1]}, workers {WORKER_COUNTS[0]}..{WORKER_COUNTS[-1]}, registry up to "
        f"{REGISTRY_WORKERS[-1]} workers x {REGISTRY_LAYERS} layers; block "
        f"{'x'.join(map(str, opts.block_shape))} {opts.dtype}, {opts.repeat} rounds"
    )
    total = len(BLOCK_COUNTS) + len(LAYER_COUNTS) + len(WORKER_COUNTS) + len(REGISTRY_WORKERS)
    progress = Progress(total, "scaling", enabled=opts.progress)
    figures: list[Figure] = []
    try:
        with procs.daemon(peer_data_plane=opts.peer_data_plane) as (endpoint, _):
            figures += _blocks_curve(opts, endpoint, progress)
            figures += _layers_curve(opts, endpoint, progress)
            figures += _workers_curve(opts, endpoint, progress)
        figures += _registry_curve(opts, progress)
    finally:
        progress.close()
    return figures


def _pair(
    group: str,
    *,
    chart: str,
    x: float,
    name: str,
    nbytes: int,
    daemon_s: list[float],
    local_s: list[float],
) -> list[Figure]:
    """Throughput (charted) and command time of the daemon against the in-process copy."""
    common = {"group": group, "baseline": RUN_COPY}
    return [
        Figure(
            name=f"{name}: throughput",
            unit="GB/s",
            samples=[nbytes / s / 1e9 for s in daemon_s],
            baseline_samples=[nbytes / s / 1e9 for s in local_s],
            chart=chart,
            series=DAEMON,
            x=x,
            **common,  # type: ignore[arg-type]
        ),
        Figure(
            name=f"{name}: command time",
            unit="ms",
            samples=[s * 1e3 for s in daemon_s],
            baseline_samples=[s * 1e3 for s in local_s],
            higher_is_better=False,
            **common,  # type: ignore[arg-type]
        ),
    ]


def _turns(methods: list[Callable[[], object]], rounds: int, per_round: int) -> list[list[float]]:
    """Return seconds per call of each method, one median of ``per_round`` calls per round.

    Small moves take microseconds: one call per round would be mostly noise.
    """
    out: list[list[float]] = [[] for _ in methods]
    for _ in range(rounds):
        for i, fn in enumerate(methods):
            times = []
            for _ in range(per_round):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            out[i].append(statistics.median(times))
    return out


def _per_round(nbytes: int) -> int:
    # Enough calls that a round of a tiny move lasts a few ms; one call for the big ones.
    return max(1, min(50, (8 << 20) // max(nbytes, 1)))


def _move_point(
    opts: Options, eng: Engines, blocks: int, seed: int
) -> tuple[int, list[float], list[float]]:
    """(bytes, daemon seconds per move, in-process seconds per move) of one random-id move."""
    num_blocks = eng.a[0].shape[0]
    rng = np.random.default_rng(seed)
    s_ids = rng.choice(num_blocks, blocks, replace=False).astype(np.int64)
    d_ids = rng.choice(num_blocks, blocks, replace=False).astype(np.int64)
    s32, d32 = s_ids.astype("<i4"), d_ids.astype("<i4")

    def via_daemon() -> None:
        eng.client_a.move(eng.a_dev, eng.b_dev, s32, d32)

    local = run_copy(eng.a, eng.b, s_ids, d_ids)
    for fn in (via_daemon, local):  # warm-up and check
        reset_marks(eng.b)
        fn()
        check_blocks(eng.b, s_ids, d_ids)
    nbytes = len(eng.a) * blocks * opts.block_bytes
    daemon_s, local_s = _turns([via_daemon, local], opts.repeat, _per_round(nbytes))
    return nbytes, daemon_s, local_s


def _blocks_curve(opts: Options, endpoint: str, progress: Progress) -> list[Figure]:
    figures: list[Figure] = []
    group = f"scaling: blocks per move ({FIXED_LAYERS} layers, random ids)"
    # One pair of engines for the whole curve: allocating and touching is the slow part.
    with engines(endpoint, opts, max(BLOCK_COUNTS), layers=FIXED_LAYERS, prefix="sb") as eng:
        for blocks in BLOCK_COUNTS:
            progress.step(0, f"scaling: {blocks} blocks")
            nbytes, d, loc = _move_point(opts, eng, blocks, opts.seed + blocks)
            name = f"scaling/blocks/{blocks} blocks ({nbytes / 2**20:g} MiB)"
            figures += _pair(
                group,
                chart="size",
                x=nbytes / 2**20,
                name=name,
                nbytes=nbytes,
                daemon_s=d,
                local_s=loc,
            )
            progress.step()
    return figures


def _layers_curve(opts: Options, endpoint: str, progress: Progress) -> list[Figure]:
    figures: list[Figure] = []
    group = f"scaling: layers ({FIXED_BLOCKS} random blocks per move)"
    for i, layers in enumerate(LAYER_COUNTS):
        progress.step(0, f"scaling: {layers} layers")
        with engines(endpoint, opts, 2 * FIXED_BLOCKS, layers=layers, prefix=f"sl{i}") as eng:
            nbytes, d, loc = _move_point(opts, eng, FIXED_BLOCKS, opts.seed)
        name = f"scaling/layers/{layers} layers ({nbytes / 2**20:g} MiB)"
        figures += _pair(
            group, chart="layers", x=layers, name=name, nbytes=nbytes, daemon_s=d, local_s=loc
        )
        progress.step()
    return figures


def _workers_curve(opts: Options, endpoint: str, progress: Progress) -> list[Figure]:
    figures: list[Figure] = []
    num_blocks = 4 * FIXED_BLOCKS
    shape = (num_blocks, *opts.block_shape)
    dtype = torch_dtype(opts.dtype)
    nbytes = FIXED_LAYERS * FIXED_BLOCKS * opts.block_bytes
    moves = max(3, _per_round(nbytes) // 4)  # per worker per phase
    names = [f"layer{i}" for i in range(FIXED_LAYERS)]
    rng = np.random.default_rng(opts.seed)
    # Disjoint source and destination ids in one cache: a worker moves within its own blocks.
    perm = rng.permutation(num_blocks)
    s_ids, d_ids = perm[:FIXED_BLOCKS].astype(np.int64), perm[-FIXED_BLOCKS:].astype(np.int64)
    s32, d32 = s_ids.astype("<i4"), d_ids.astype("<i4")
    caches: list[list[torch.Tensor]] = []
    clients: list[SidecarClient] = []
    refs: list[BufferSetRef] = []

    def daemon_job(i: int) -> Callable[[], None]:
        def go() -> None:
            clients[i].move(refs[i], refs[i], s32, d32)

        return go

    def local_job(i: int) -> Callable[[], None]:
        return run_copy(caches[i], caches[i], s_ids, d_ids)

    try:
        for n_workers in WORKER_COUNTS:
            progress.step(0, f"scaling: {n_workers} workers")
            while len(clients) < n_workers:  # registrations persist into the next, larger point
                i = len(clients)
                cache = allocate_kv_caches(FIXED_LAYERS, shape, dtype)
                mark_blocks(cache)
                client = SidecarClient(endpoint, timeout_s=120, name=f"bench-w{i}")
                clients.append(client)
                ref = client.register_kv_caches(
                    dict(zip(names, cache, strict=True)), engine_id=f"W{i}", arrangement="split"
                ).worker
                caches.append(cache)
                refs.append(BufferSetRef(ref, "device"))
                client.move(refs[i], refs[i], s32, d32)  # warm-up and check
                check_blocks([v[d_ids] for v in cache], s_ids, np.arange(FIXED_BLOCKS))
            daemon = [daemon_job(i) for i in range(n_workers)]
            local = [local_job(i) for i in range(n_workers)]
            figures += _workers_point(opts, daemon, local, moves, nbytes)
            progress.step()
    finally:
        for client in clients:
            client.close()
    return figures


def _workers_point(
    opts: Options,
    daemon: list[Callable[[], None]],
    local: list[Callable[[], None]],
    moves: int,
    nbytes: int,
) -> list[Figure]:
    """Aggregate throughput and p50 command time of ``len(daemon)`` workers moving at once."""
    n_workers = len(daemon)
    d_tput: list[float] = []
    d_lat: list[float] = []
    l_tput: list[float] = []
    l_lat: list[float] = []
    for _ in range(opts.repeat):
        for jobs, tput, lat in ((daemon, d_tput, d_lat), (local, l_tput, l_lat)):
            wall, times = _concurrently(jobs, moves)
            tput.append(n_workers * moves * nbytes / wall / 1e9)
            lat.append(statistics.median(times) * 1e3)
    name = f"scaling/workers/{n_workers} workers"
    group = f"scaling: concurrent workers ({FIXED_LAYERS} layers, {FIXED_BLOCKS} blocks each)"
    common = {"group": group, "baseline": f"{RUN_COPY} ({n_workers} threads)"}
    return [
        Figure(
            name=f"{name}: aggregate throughput",
            unit="GB/s",
            samples=d_tput,
            baseline_samples=l_tput,
            chart="workers",
            series=DAEMON,
            x=n_workers,
            **common,  # type: ignore[arg-type]
        ),
        Figure(
            name=f"{name}: command time p50",
            unit="ms",
            samples=d_lat,
            baseline_samples=l_lat,
            higher_is_better=False,
            **common,  # type: ignore[arg-type]
        ),
    ]


def _concurrently(jobs: list[Callable[[], None]], count: int) -> tuple[float, list[float]]:
    """Run every job ``count`` times in its own thread, all released at once.

    Returns the wall time from release to the last finish and every call's seconds.
    """
    barrier = threading.Barrier(len(jobs) + 1)
    times: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(job: Callable[[], None]) -> None:
        mine = []
        try:
            barrier.wait()
            for _ in range(count):
                start = time.perf_counter()
                job()
                mine.append(time.perf_counter() - start)
        except BaseException as exc:  # re-raised in the caller
            errors.append(exc)
        with lock:
            times.extend(mine)

    threads = [threading.Thread(target=worker, args=(job,), daemon=True) for job in jobs]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join(300)
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return wall, times


@contextlib.contextmanager
def _registered(
    endpoint: str, name: str
) -> Iterator[tuple[SidecarClient, Callable[[int], BufferSetRef], list[list[torch.Tensor]]]]:
    """Yield a client that registers small 128-layer workers on demand: ``add(i)`` -> ref."""
    client = SidecarClient(endpoint, timeout_s=120, name=name)
    held: list[list[torch.Tensor]] = []  # keep the memory alive while registered

    def add(i: int) -> BufferSetRef:
        cache = allocate_kv_caches(REGISTRY_LAYERS, (16, 16, 1, 16), torch.float16)
        mark_blocks(cache)
        held.append(cache)
        ref = client.register_kv_caches(
            {f"layer{j}": t for j, t in enumerate(cache)},
            engine_id="R",
            tp_rank=i,
            tp_size=REGISTRY_WORKERS[-1],
            arrangement="split",
        ).worker
        return BufferSetRef(ref, "device")

    try:
        yield client, add, held
    finally:
        client.close()


def _registry_curve(opts: Options, progress: Progress) -> list[Figure]:
    figures: list[Figure] = []
    group = f"scaling: registry size ({REGISTRY_LAYERS} small layers per worker)"
    src, dst = np.array([3], dtype="<i4"), np.array([5], dtype="<i4")
    with (
        procs.daemon(peer_data_plane=opts.peer_data_plane) as (ep_one, _),
        procs.daemon(peer_data_plane=opts.peer_data_plane) as (ep_many, _),
        _registered(ep_one, "bench-reg-1") as (one, add_one, held_one),
        _registered(ep_many, "bench-reg-n") as (many, add_many, held_many),
    ):
        ref_one, ref_many = add_one(0), add_many(0)
        layer0 = ["layer0"]
        for n in REGISTRY_WORKERS:
            progress.step(0, f"scaling: {n} registered")
            while len(many.workers) < n:
                add_many(len(many.workers))
            methods: dict[str, Callable[[], object]] = {
                "one, 1 layer": lambda: one.move(ref_one, ref_one, src, dst, layers=layer0),
                "many, 1 layer": lambda: many.move(ref_many, ref_many, src, dst, layers=layer0),
                "one, all": lambda: one.move(ref_one, ref_one, src, dst),
                "many, all": lambda: many.move(ref_many, ref_many, src, dst),
            }
            samples = _rounds_us(methods, opts.rounds, opts.batch)
            for layers, label in (("1 layer", "1 layer"), ("all", f"{REGISTRY_LAYERS} layers")):
                figures.append(
                    Figure(
                        name=(
                            f"scaling/registry/{n} workers x {REGISTRY_LAYERS} layers registered:"
                            f" 1-block move, {label}, p50"
                        ),
                        unit="µs",
                        samples=[percentile(r, 50) for r in samples[f"many, {layers}"]],
                        baseline=f"same move, 1 worker registered, {label}, p50",
                        baseline_samples=[percentile(r, 50) for r in samples[f"one, {layers}"]],
                        higher_is_better=False,
                        group=group,
                        chart="registry",
                        series=f"daemon with N registered, {label}",
                        x=n,
                    )
                )
            progress.step()
        # The timed moves ran on the first worker of each daemon: check they really moved.
        for cache in (held_one[0], held_many[0]):
            check_blocks(
                [v[dst.astype(np.int64)] for v in cache],
                src.astype(np.int64),
                np.zeros(1, np.int64),
            )
    return figures


def _rounds_us(
    methods: dict[str, Callable[[], object]], rounds: int, batch: int
) -> dict[str, list[list[float]]]:
    for fn in methods.values():  # warm-up
        for _ in range(min(batch, 20)):
            fn()
    out: dict[str, list[list[float]]] = {k: [] for k in methods}
    for _ in range(rounds):
        for name, fn in methods.items():
            times = []
            for _ in range(batch):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e6)
            out[name].append(times)
    return out
