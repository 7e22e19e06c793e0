"""``bench latency``: command round trips through a daemon against a raw ZeroMQ echo.

From an `AsyncSidecarClient` on uvloop: a ``Status`` command, a 1-block move of one layer and of
all layers (engine A -> engine B), and a raw zmq.asyncio DEALER -> ROUTER echo of the very frames
a move request carries, served by a separate process on uvloop over the same ipc transport.
From the blocking `SidecarClient` (what engine workers call from synchronous code): the same
status and 1-layer move, against a raw blocking pyzmq DEALER -> ROUTER echo of the same frames
served by a plain blocking receive/send loop in its own process. And an engine step of 16
1-block moves, sent as 16 ``move`` commands or as one ``move_batch`` (judged against the 16
commands). All take turns in batches of ``batch`` round trips for ``rounds`` rounds, so they
share the load.

Each percentile figure is the median over rounds of that round's percentile (its min-max is the
spread between rounds), compared with its echo's figure from the same rounds: async methods with
the zmq.asyncio echo, blocking ones with the blocking echo.

With ``--pin`` every server (the daemon and both echoes) runs on the first CPU this process may
use and the benchmark itself, the client, on the second, the same for all. Unpinned, the 2-vCPU
VMs' scheduler places the client's, the server's and libzmq's I/O threads differently from one
round to the next, and the same method's rounds fall into two groups, far apart, depending on
where they landed (`benchmarks/probes/probe_placement.py`, docs/benchmarks.md).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from kvsidecar.bench import procs
from kvsidecar.bench.common import Figure, Options, Progress, note, percentile
from kvsidecar.bench.local import engines
from kvsidecar.client import AsyncSidecarClient, BatchMove, BufferSetRef, SidecarClient

ECHO = "raw zmq.asyncio echo"
ECHO_BLOCKING = "raw blocking pyzmq echo"
ECHO_BLOCKING_ASYNC = "raw blocking pyzmq client, zmq.asyncio echo server"
"""The blocking client's second baseline: the same blocking DEALER against the zmq.asyncio echo
(the server pattern the async figures are judged against)."""
BLOCKING = "blocking client: "
"""Prefix of the blocking client's methods (judged against `ECHO_BLOCKING`)."""
STEP = 16
"""1-block moves per engine step in the batch figures."""
ONE_BY_ONE = f"{STEP} 1-block moves, a command each"
BATCHED = f"{STEP} 1-block moves, one move_batch"
"""`BATCHED` is judged against `ONE_BY_ONE` (what a step costs either way), not against an echo."""
PERCENTILES = (50.0, 90.0, 99.0)

Sampler = Callable[[], Awaitable[object]]


def run(opts: Options) -> list[Figure]:
    """Start a daemon and an echo server, time the round trips, return the figures."""
    note(
        f"latency: 1-block moves of 1 and {opts.layers} layers, {opts.rounds} rounds x "
        f"{opts.batch} round trips per method"
    )
    cpus = sorted(os.sched_getaffinity(0))
    pinned = opts.pin and len(cpus) >= 2
    if opts.pin and not pinned:
        note("latency: --pin needs two CPUs; not pinned")
    runtime = tempfile.mkdtemp(prefix="kvsb-echo-", dir="/tmp")
    echo_ep = f"ipc://{runtime}/echo.sock"
    blocking_ep = f"ipc://{runtime}/echo-blocking.sock"
    try:
        with (
            procs.echo_server(echo_ep) as echo_pid,
            procs.echo_server(blocking_ep, blocking=True) as blocking_pid,
            procs.daemon(peer_data_plane=opts.peer_data_plane) as (endpoint, daemon),
            engines(endpoint, opts, num_blocks=64) as eng,
        ):
            src, dst = eng.a_dev, eng.b_dev
            measure = _measure(opts, endpoint, (echo_ep, blocking_ep), src, dst)
            if not pinned:
                samples = procs.run_async(measure)
            else:
                note(f"latency: servers pinned to CPU {cpus[0]}, the client to CPU {cpus[1]}")
                for pid in (echo_pid, blocking_pid, daemon.pid):
                    procs.pin(pid, {cpus[0]})
                procs.pin(os.getpid(), {cpus[1]})
                try:
                    samples = procs.run_async(measure)
                finally:
                    procs.pin(os.getpid(), set(cpus))
    finally:
        for name in ("echo.sock", "echo-blocking.sock"):
            Path(runtime, name).unlink(missing_ok=True)
        Path(runtime).rmdir()
    return figures_from(samples, group="latency")


def figures_from(
    samples: dict[str, list[list[float]]], group: str, chart: str = "latency"
) -> list[Figure]:
    """One figure per (method, percentile, baseline) against the baseline's same percentile."""
    figures: list[Figure] = []
    for name, rounds in samples.items():
        if name in (ECHO, ECHO_BLOCKING, ECHO_BLOCKING_ASYNC, ONE_BY_ONE):
            continue
        bases = [ECHO_BLOCKING, ECHO_BLOCKING_ASYNC] if name.startswith(BLOCKING) else [ECHO]
        bases = [ONE_BY_ONE] if name == BATCHED else bases
        for base in bases:
            if base in samples:
                figures += _percentiles(name, rounds, base, samples[base], group=group, chart=chart)
    return figures


def _percentiles(
    name: str,
    rounds: list[list[float]],
    base: str,
    echo: list[list[float]],
    *,
    group: str,
    chart: str,
) -> list[Figure]:
    figures = []
    for q in PERCENTILES:
        figures.append(
            Figure(
                name=f"{group}/{name} p{q:g}",
                unit="µs",
                samples=[percentile(r, q) for r in rounds],
                baseline=f"{base} p{q:g}",
                baseline_samples=[percentile(r, q) for r in echo],
                higher_is_better=False,
                group=group,
                chart=chart,
                series=name,
                x=q,
            )
        )
    return figures


async def timed_rounds(
    methods: dict[str, Sampler], rounds: int, batch: int, progress: Progress | None = None
) -> dict[str, list[list[float]]]:
    """Round trips in µs, per method and round; methods take turns in batches."""
    for fn in methods.values():  # warm-up: connections, first touches of mappings
        for _ in range(min(batch, 20)):
            await fn()
    out: dict[str, list[list[float]]] = {k: [] for k in methods}
    for _ in range(rounds):
        for name, fn in methods.items():
            times = []
            for _ in range(batch):
                start = time.perf_counter()
                await fn()
                times.append((time.perf_counter() - start) * 1e6)
            out[name].append(times)
        if progress is not None:
            progress.step()
    return out


def _dealer(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def _blocking_methods(
    sync_client: SidecarClient,
    echoes: tuple[zmq.Socket[Any], zmq.Socket[Any]],
    frames: list[bytes],
    src: BufferSetRef,
    dst: BufferSetRef,
) -> dict[str, Sampler]:
    """Return the blocking client's methods and its two echoes (blocking, zmq.asyncio server).

    They block the benchmark's loop while they run: nothing else runs meanwhile.
    """
    one = np.array([3], dtype="<i4")

    def echo_with(sock: zmq.Socket[Any]) -> Sampler:
        async def echo() -> None:
            sock.send_multipart(frames, copy=False)
            sock.recv_multipart(copy=False)

        return echo

    async def status() -> None:
        sync_client.status()

    async def move_one() -> None:
        sync_client.move(src, dst, one, one, layers=["layer0"])

    return {
        ECHO_BLOCKING: echo_with(echoes[0]),
        ECHO_BLOCKING_ASYNC: echo_with(echoes[1]),
        f"{BLOCKING}status": status,
        f"{BLOCKING}1-block move, 1 layer": move_one,
    }


def _step_methods(
    client: AsyncSidecarClient, src: BufferSetRef, dst: BufferSetRef
) -> dict[str, Sampler]:
    """Return an engine step's 1-block moves: a command each, or one batch (distinct ids)."""
    step_ids = [np.array([i], dtype="<i4") for i in range(STEP)]
    step = [BatchMove(src, dst, i, i, layers=["layer0"]) for i in step_ids]

    async def one_by_one() -> None:
        for i in step_ids:
            await client.move(src, dst, i, i, layers=["layer0"])

    async def batched() -> None:
        await client.move_batch(step)

    return {ONE_BY_ONE: one_by_one, BATCHED: batched}


async def _measure(
    opts: Options,
    endpoint: str,
    echo_eps: tuple[str, str],
    src: BufferSetRef,
    dst: BufferSetRef,
) -> dict[str, list[list[float]]]:
    client = AsyncSidecarClient(endpoint, timeout_s=10, name="bench-lat", heartbeat=False)
    ctx = zmq.asyncio.Context()
    echo = ctx.socket(zmq.DEALER)
    echo.setsockopt(zmq.LINGER, 0)
    echo.connect(echo_eps[0])
    sync_ctx: zmq.Context[Any] = zmq.Context()
    echoes = (_dealer(sync_ctx, echo_eps[1]), _dealer(sync_ctx, echo_eps[0]))
    sync_client = SidecarClient(endpoint, timeout_s=10, name="bench-lat-sync", heartbeat=False)
    progress = Progress(opts.rounds, "latency", enabled=opts.progress)
    try:
        await client.start()
        one = np.array([3], dtype="<i4")
        # The echo carries the very bytes a move request carries (private helpers, on purpose).
        move = client._requests.move(src, dst, one, one, ["layer0"])
        frames = [client._session.codec.encoder.encode(move.req), *(bytes(d) for d in move.data)]

        async def raw_echo() -> None:
            await echo.send_multipart(frames, copy=False)
            await echo.recv_multipart(copy=False)

        async def status() -> None:
            await client.status()

        async def move_one() -> None:
            await client.move(src, dst, one, one, layers=["layer0"])

        async def move_all() -> None:
            await client.move(src, dst, one, one)

        methods: dict[str, Sampler] = {
            ECHO: raw_echo,
            "status": status,
            "1-block move, 1 layer": move_one,
            f"1-block move, {opts.layers} layers": move_all,
            **_blocking_methods(sync_client, echoes, frames, src, dst),
            **_step_methods(client, src, dst),
        }
        return await timed_rounds(methods, opts.rounds, opts.batch, progress)
    finally:
        progress.close()
        await client.close()
        sync_client.close()
        echo.close(linger=0)
        for sock in echoes:
            sock.close(linger=0)
        ctx.term()
        sync_ctx.term()
