"""``bench aggregator --processes``: completion aggregation across processes, and metrics cost.

The multi-process half of the aggregator benchmark; `run` gives it to ``kvsidecar bench
aggregator --processes`` as figures:

1. ``in-process``: `CompletionAggregator.aggregate` alone: 8 workers, each step every worker names
   ``ids`` requests; request completions per second (a request completes once all 8 named it).
2. ``daemon``: the same reports through a daemon process from 8 worker processes (real ZeroMQ,
   blocking `SidecarClient.report`, one request in flight per worker), then one `collect`.
3. ``raw zmq``: 8 processes doing the same request/reply round trips, with the same encoded
   report bytes, against a bare pyzmq ROUTER that answers each with a 20-byte reply: the message
   rate the transport allows this pattern. The daemon path divided by it says how much of the
   transport's rate the daemon keeps (the aggregator's share is the rest).
4. ``metrics``: move throughput (blocking offloads from one worker process) with ``/metrics``
   scraped every second against not scraped, alternating, medians.

The child processes are this module run with ``--worker SPEC`` or ``--echo ENDPOINT``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import msgspec
import torch
import zmq

from kvsidecar.bench import procs
from kvsidecar.bench.common import Figure, Options, note
from kvsidecar.client import SidecarClient
from kvsidecar.core.aggregator import CompletionAggregator
from kvsidecar.memory import allocate_kv_caches
from kvsidecar.wire.protocol import Report
from kvsidecar.wire.reports import WorkerReport
from kvsidecar.wire.types import WorkerRef

WORKERS = 8


def _ids(step: int, n: int) -> frozenset[str]:
    return frozenset(f"req-{step}-{i}" for i in range(n))


def bench_in_process(steps: int, ids: int) -> float:
    """Request completions per second through `CompletionAggregator.aggregate`."""
    names = [_ids(s, ids) for s in range(steps)]
    reports = [
        [WorkerReport(worker_id=f"w{w}", step=s, finished_recving=names[s]) for w in range(WORKERS)]
        for s in range(steps)
    ]
    agg = CompletionAggregator(WORKERS)
    done = 0
    started = time.perf_counter()
    for batch in reports:
        out = agg.aggregate(batch, 0)
        done += len(out.finished_recving or ()) if out is not None else 0
    seconds = time.perf_counter() - started
    if done != steps * ids:
        raise RuntimeError(f"in process: {done} requests completed, expected {steps * ids}")
    return done / seconds


def worker_main(spec: dict[str, Any]) -> None:
    """Run a registered worker (or a raw DEALER) that sends ``steps`` reports on "go"."""
    rank, steps, ids = spec["rank"], spec["steps"], spec["ids"]
    names = [_ids(s, ids) for s in range(steps)]
    if spec["mode"] == "raw":
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(spec["endpoint"])
        enc = msgspec.msgpack.Encoder()
        ref = WorkerRef("bench", tp_rank=rank)
        frames = [
            enc.encode(Report(id=s + 1, worker=ref, epoch=1, step=s, finished_recving=names[s]))
            for s in range(steps)
        ]
        print("ready", flush=True)
        sys.stdin.readline()
        started = time.perf_counter()
        for frame in frames:
            sock.send(frame)
            sock.recv()
        print(json.dumps({"seconds": time.perf_counter() - started}), flush=True)
        sock.close()
        ctx.term()
        return
    caches = allocate_kv_caches(1, [2, 64, 16, 2, 64], torch.float16)
    client = SidecarClient(spec["endpoint"], timeout_s=30, heartbeat=True)
    client.register_kv_caches(
        {"l0": caches[0]},
        engine_id="bench",
        tp_rank=rank,
        tp_size=spec["tp_size"],
        host_blocks=spec.get("host_blocks", 0),
    )
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("exit"):
            break
        started = time.perf_counter()
        count = 0
        if cmd["what"] == "report":
            for s in range(steps):
                client.report(s, finished_recving=names[s])
            count = steps
        else:  # moves: offload the same blocks over and over for cmd["seconds"]
            blocks = list(range(cmd["blocks"]))
            nbytes = 0
            end = started + cmd["seconds"]
            while time.perf_counter() < end:
                nbytes += client.offload(client.worker, blocks, blocks).nbytes
                count += 1
            print(
                json.dumps({"seconds": time.perf_counter() - started, "n": count, "b": nbytes}),
                flush=True,
            )
            continue
        print(json.dumps({"seconds": time.perf_counter() - started, "n": count}), flush=True)
    client.close()


def echo_main(endpoint: str) -> None:
    """Serve a bare blocking ROUTER answering every message with a small reply, until killed."""
    reply = b"\x82\xa4type\xa8reported\xa2id\x01"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    print("ready", flush=True)
    while True:
        ident, _ = sock.recv_multipart(copy=False)
        sock.send_multipart([ident, reply], copy=False)


class Child:
    """A child process of this script that speaks one line at a time."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=procs.child_env(),
            preexec_fn=procs.die_with_parent,  # noqa: PLW1509 - only a prctl, safe before exec
        )

    def line(self) -> str:
        """Return the child's next line of output (raise if it exited)."""
        assert self.proc.stdout is not None
        out = self.proc.stdout.readline()
        if not out:
            raise RuntimeError(f"child exited with {self.proc.wait(5)}")
        return out.strip()

    def send(self, text: str) -> None:
        """Send the child one line."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        """Ask the child to exit; kill it if it does not within 5 s."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.send(json.dumps({"exit": True}))
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@contextlib.contextmanager
def children(specs: list[list[str]]) -> Iterator[list[Child]]:
    """Start children with these arguments, wait until each says "ready", stop them after."""
    kids = [Child(*s) for s in specs]
    try:
        for k in kids:
            if k.line() != "ready":
                raise RuntimeError("child not ready")
        yield kids
    finally:
        for k in kids:
            k.stop()


@contextlib.contextmanager
def daemon(host_pool_bytes: int) -> Iterator[tuple[str, int]]:
    """``kvsidecar serve`` in its own process; yields (endpoint, metrics port)."""
    with procs.daemon(host_pool_bytes=host_pool_bytes, metrics_port=0, peer_data_plane="auto") as (
        endpoint,
        _,
    ):
        with SidecarClient(endpoint, timeout_s=5, heartbeat=False) as c:
            port = c.status().metrics_port
        yield endpoint, port


def _go(kids: list[Child], cmd: str) -> float:
    started = time.perf_counter()
    for k in kids:
        k.send(cmd)
    for k in kids:
        json.loads(k.line())
    return time.perf_counter() - started


def bench_daemon(steps: int, ids: int) -> float:
    """Request completions per second through a fresh daemon: 8 worker processes, one collect.

    Fresh each time (daemon and workers) because a worker's step numbers start at 0 per
    registration; the wall time runs from the first "go" to the collect's answer.
    """
    with daemon(0) as (endpoint, _):
        spec = {"endpoint": endpoint, "steps": steps, "ids": ids, "tp_size": WORKERS, "mode": "d"}
        specs = [["--worker", json.dumps({**spec, "rank": r})] for r in range(WORKERS)]
        with (
            children(specs) as kids,
            SidecarClient(endpoint, timeout_s=30, heartbeat=False) as sched,
        ):
            started = time.perf_counter()
            for k in kids:
                k.send(json.dumps({"what": "report"}))
            for k in kids:
                json.loads(k.line())
            out = sched.collect("bench", steps - 1, timeout_s=5).output
            seconds = time.perf_counter() - started
    done = len(out.finished_recving or ())
    if done != steps * ids:
        raise RuntimeError(f"{done} requests completed, expected {steps * ids}")
    return done / seconds


def bench_daemon_reps(steps: int, ids: int, reps: int) -> list[float]:
    """`bench_daemon` ``reps`` times."""
    return [bench_daemon(steps, ids) for _ in range(reps)]


def bench_raw(steps: int, ids: int, reps: int) -> list[float]:
    """Report messages per second (as request completions) over bare DEALER/ROUTER."""
    rates = []
    runtime = tempfile.mkdtemp(prefix="kvsbr-", dir="/tmp")
    endpoint = f"ipc://{runtime}/echo.sock"
    try:
        with children([["--echo", endpoint]]):
            for _ in range(reps):
                spec = {"endpoint": endpoint, "steps": steps, "ids": ids, "mode": "raw"}
                specs = [["--worker", json.dumps({**spec, "rank": r})] for r in range(WORKERS)]
                with children(specs) as kids:
                    seconds = _go(kids, "go")
                rates.append(steps * ids / seconds)
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    return rates


def bench_metrics(blocks: int, seconds: float, reps: int) -> dict[str, list[float]]:
    """Offload moves/s and GB/s with /metrics scraped every second, and without."""
    results: dict[str, list[float]] = {"scraped": [], "idle": [], "gbs_scraped": [], "gbs_idle": []}
    with daemon(64 << 20) as (endpoint, port):
        spec = {"endpoint": endpoint, "steps": 0, "ids": 0, "tp_size": 1, "mode": "d"}
        spec["host_blocks"] = blocks
        with children([["--worker", json.dumps({**spec, "rank": 0})]]) as (kid,):
            for rep in range(2 * reps):
                scraped = rep % 2 == 0
                stop = threading.Event()

                def scrape(stop: threading.Event = stop) -> None:
                    while not stop.is_set():
                        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read()
                        stop.wait(1.0)

                thread = threading.Thread(target=scrape) if scraped else None
                if thread is not None:
                    thread.start()
                kid.send(json.dumps({"what": "move", "blocks": blocks, "seconds": seconds}))
                r = json.loads(kid.line())
                stop.set()
                if thread is not None:
                    thread.join()
                key = "scraped" if scraped else "idle"
                results[key].append(r["n"] / r["seconds"])
                results[f"gbs_{key}"].append(r["b"] / r["seconds"] / 1e9)
    return results


def run(opts: Options, ids: int = 16) -> list[Figure]:
    """Measure across processes: daemon vs raw zmq, in process, and the metrics-scrape cost."""
    steps, reps, move_seconds = (200, 2, 1.0) if opts.quick else (1000, opts.repeat, 3.0)
    note(f"aggregator --processes: {WORKERS} worker processes, {steps} steps, {reps} runs")
    via_daemon = bench_daemon_reps(steps, ids, reps)
    raw = bench_raw(steps, ids, reps)
    inproc = [bench_in_process(steps, ids) for _ in range(reps)]
    metrics = bench_metrics(32, move_seconds, reps)
    group = f"aggregator: {WORKERS} worker processes, {ids} ids per report"
    return [
        Figure(
            name="aggregator/daemon from worker processes (reports + collect)",
            unit="completions/s",
            samples=via_daemon,
            baseline="raw DEALER/ROUTER, blocking echo, same messages",
            baseline_samples=raw,
            group=group,
        ),
        Figure(
            name="aggregator/in process (8 workers)",
            unit="completions/s",
            samples=inproc,
            baseline="daemon from worker processes",
            baseline_samples=via_daemon,
            group=group,
        ),
        Figure(
            name="metrics/offloads with /metrics scraped every 1 s",
            unit="moves/s",
            samples=metrics["scraped"],
            baseline="not scraped",
            baseline_samples=metrics["idle"],
            group=group,
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    """Entry point of the child processes: ``--worker SPEC`` or ``--echo ENDPOINT``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker")
    parser.add_argument("--echo")
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(json.loads(args.worker))
    elif args.echo:
        echo_main(args.echo)


if __name__ == "__main__":
    main()
