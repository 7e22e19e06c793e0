"""``bench aggregator``: completion reports through a daemon against a raw echo and in process.

One engine of 8 workers (TP 8), registered by one client of this process; each engine step,
every worker reports ``ids`` finished requests (the same ids for all 8, so each completes once all
8 named it) and the scheduler collects once at the end of a round. Per round, in turns:

- daemon: ``steps`` x 8 ``Report`` round trips from a blocking `SidecarClient`, then one
  ``Collect``; as reports/s and as request completions/s;
- raw echo: the same encoded ``Report`` frames, one round trip each, over a blocking DEALER to a
  zmq.asyncio ROUTER echo on uvloop in its own process (same ipc transport): the message rate the
  transport allows this pattern;
- in process: `CompletionAggregator.aggregate` of the same reports.

With ``--processes``, also the multi-process workload of `kvsidecar.bench.aggregator_procs`
(8 worker processes against raw zmq, the metrics-scrape cost).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import msgspec
import torch
import zmq

from kvsidecar.bench import aggregator_procs, procs
from kvsidecar.bench.common import Figure, Options, Progress, note
from kvsidecar.client import SidecarClient
from kvsidecar.memory import allocate_kv_caches
from kvsidecar.wire.protocol import Report
from kvsidecar.wire.types import WorkerRef

WORKERS = 8
IDS = 16


def _names(step: int) -> frozenset[str]:
    return frozenset(f"req-{step}-{i}" for i in range(IDS))


def run(opts: Options) -> list[Figure]:
    """Start a daemon and an echo server; time reports, echoes and in-process aggregation."""
    steps = 50 if opts.quick else 200
    note(
        f"aggregator: {WORKERS} workers, {steps} steps x {IDS} ids per round, {opts.repeat} rounds"
    )
    daemon_s, echo_s, local_s = _rounds(opts, steps)
    reports, completions = steps * WORKERS, steps * IDS
    group = f"aggregator: {WORKERS} workers, {IDS} ids per report"
    extra = aggregator_procs.run(opts, IDS) if opts.processes else []
    return [
        Figure(
            name="aggregator/daemon Report round trips",
            unit="reports/s",
            samples=[reports / s for s in daemon_s],
            baseline="raw zmq echo of the same frames",
            baseline_samples=[reports / s for s in echo_s],
            group=group,
        ),
        Figure(
            name="aggregator/daemon request completions (reports + collect)",
            unit="completions/s",
            samples=[completions / s for s in daemon_s],
            baseline="CompletionAggregator.aggregate in process",
            baseline_samples=[completions / s for s in local_s],
            group=group,
        ),
        *extra,
    ]


def _rounds(opts: Options, steps: int) -> tuple[list[float], list[float], list[float]]:
    """Seconds per round of the daemon, the raw echo and the in-process aggregation, in turns."""
    runtime = tempfile.mkdtemp(prefix="kvsb-agg-", dir="/tmp")
    echo_ep = f"ipc://{runtime}/echo.sock"
    caches = [allocate_kv_caches(1, (16, 16, 1, 16), torch.float16) for _ in range(WORKERS)]
    daemon_s: list[float] = []
    echo_s: list[float] = []
    local_s: list[float] = []
    progress = Progress(opts.repeat, "aggregator", enabled=opts.progress)
    ctx = zmq.Context()
    try:
        with (
            procs.echo_server(echo_ep),
            procs.daemon(peer_data_plane=opts.peer_data_plane) as (endpoint, _),
            SidecarClient(endpoint, timeout_s=60, name="bench-agg") as client,
        ):
            refs = [
                client.register_kv_caches(
                    {"l0": cache[0]},
                    engine_id="agg",
                    tp_rank=r,
                    tp_size=WORKERS,
                    arrangement="split",
                ).worker
                for r, cache in enumerate(caches)
            ]
            encoder = msgspec.msgpack.Encoder()
            frames = [
                encoder.encode(
                    Report(id=s + 1, worker=refs[0], epoch=1, step=s, finished_recving=_names(s))
                )
                for s in range(steps)
            ]
            echo = ctx.socket(zmq.DEALER)
            echo.setsockopt(zmq.LINGER, 0)
            echo.connect(echo_ep)
            for rnd in range(opts.repeat):
                base = rnd * steps  # steps keep rising: a collected step cannot be reported
                daemon_s.append(_daemon_round(client, refs, base, steps))
                start = time.perf_counter()
                for frame in frames:
                    for _ in refs:
                        echo.send(frame)
                        echo.recv()
                echo_s.append(time.perf_counter() - start)
                local_s.append(_in_process(steps))
                progress.step()
            echo.close(linger=0)
    finally:
        progress.close()
        ctx.term()
        Path(runtime, "echo.sock").unlink(missing_ok=True)
        Path(runtime).rmdir()
    return daemon_s, echo_s, local_s


def _daemon_round(client: SidecarClient, refs: list[WorkerRef], base: int, steps: int) -> float:
    """Seconds for every worker's reports of ``steps`` steps from ``base``, then one collect."""
    start = time.perf_counter()
    for s in range(base, base + steps):
        for ref in refs:
            client.report(s, finished_recving=_names(s), worker=ref)
    out = client.collect("agg", base + steps - 1, timeout_s=10).output
    seconds = time.perf_counter() - start
    done = len(out.finished_recving or ())
    if done != steps * IDS:
        raise RuntimeError(f"{done} requests completed, expected {steps * IDS}")
    return seconds


def _in_process(steps: int) -> float:
    """Seconds for `CompletionAggregator.aggregate` of ``steps`` steps of 8 reports each."""
    # One in-process workload for both entry points: aggregator_procs measures it as a rate.
    return steps * IDS / aggregator_procs.bench_in_process(steps, IDS)
