"""Completion aggregation and metrics cost, each next to its baseline, in one run.

1. ``in-process``: `CompletionAggregator.aggregate` alone: 8 workers, each step every worker names
   ``--ids`` requests; request completions per second (a request completes once all 8 named it).
2. ``daemon``: the same reports through a daemon process from 8 worker processes (real ZeroMQ,
   blocking `SidecarClient.report`, one request in flight per worker), then one `collect`.
3. ``raw zmq``: 8 processes doing the same request/reply round trips, with the same encoded
   report bytes, against a bare pyzmq ROUTER that answers each with a 20-byte reply: the message
   rate the transport allows this pattern. The daemon path divided by it says how much of the
   transport's rate the daemon keeps (the aggregator's share is the rest).
4. ``metrics``: move throughput (blocking offloads from one worker process) with ``/metrics``
   scraped every second against not scraped, alternating, medians.

Run: ``.venv/bin/python benchmarks/bench_aggregator.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvsidecar.aggregator import CompletionAggregator  # noqa: E402
from kvsidecar.protocol import Report, WorkerRef, WorkerReport  # noqa: E402

WORKERS = 8


def _ids(step: int, n: int) -> frozenset[str]:
    return frozenset(f"req-{step}-{i}" for i in range(n))


# ---------------------------------------------------------------------------------------------
# 1. in process
# ---------------------------------------------------------------------------------------------


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
        assert out is not None
        done += len(out.finished_recving or ())
    seconds = time.perf_counter() - started
    assert done == steps * ids
    return done / seconds


# ---------------------------------------------------------------------------------------------
# child processes
# ---------------------------------------------------------------------------------------------


def worker_main(spec: dict[str, Any]) -> None:
    """A registered worker (or a raw DEALER) that sends ``steps`` reports on "go"."""
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
    import torch

    from kvsidecar.client import SidecarClient
    from kvsidecar.memory import allocate_kv_caches

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


def echo_main(endpoint: str, use_asyncio: bool) -> None:
    """A bare ROUTER answering every message with a small reply, until killed.

    ``use_asyncio``: the daemon's own pattern (zmq.asyncio on uvloop, one recv loop) instead of
    a blocking loop, so that the comparison isolates what the daemon does per message.
    """
    reply = b"\x82\xa4type\xa8reported\xa2id\x01"
    if use_asyncio:
        import uvloop
        from zmq import asyncio as zasyncio

        async def serve() -> None:
            actx = zasyncio.Context()
            asock = actx.socket(zmq.ROUTER)
            asock.setsockopt(zmq.LINGER, 0)
            asock.bind(endpoint)
            print("ready", flush=True)
            while True:
                ident, _ = await asock.recv_multipart(copy=False)
                asock.send_multipart([ident, reply], copy=False)

        uvloop.run(serve())
        return
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
            [sys.executable, __file__, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )

    def line(self) -> str:
        assert self.proc.stdout is not None
        out = self.proc.stdout.readline()
        if not out:
            raise RuntimeError(f"child exited with {self.proc.wait(5)}")
        return out.strip()

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
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
    from kvsidecar.client import SidecarClient

    runtime = tempfile.mkdtemp(prefix="kvsba-", dir="/tmp")
    endpoint = f"ipc://{runtime}/control.sock"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvsidecar.cli",
            "serve",
            f"--runtime-dir={runtime}",
            f"--host-pool-bytes={host_pool_bytes}",
            "--metrics-port=0",
            "--log-level=warning",
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with SidecarClient(endpoint, timeout_s=0.5, heartbeat=False) as c:
                    port = c.status().metrics_port
                break
            except Exception:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.1)
        yield endpoint, port
    finally:
        proc.terminate()
        proc.wait(20)
        shutil.rmtree(runtime, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# 2./3. through the daemon, and raw zmq
# ---------------------------------------------------------------------------------------------


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
    from kvsidecar.client import SidecarClient

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


def bench_raw(steps: int, ids: int, reps: int, use_asyncio: bool) -> list[float]:
    """Report messages per second (as request completions) over bare DEALER/ROUTER."""
    rates = []
    runtime = tempfile.mkdtemp(prefix="kvsbr-", dir="/tmp")
    endpoint = f"ipc://{runtime}/echo.sock"
    try:
        with children([["--echo", endpoint, *(["--asyncio"] if use_asyncio else [])]]):
            for _ in range(reps):
                spec = {"endpoint": endpoint, "steps": steps, "ids": ids, "mode": "raw"}
                specs = [["--worker", json.dumps({**spec, "rank": r})] for r in range(WORKERS)]
                with children(specs) as kids:
                    seconds = _go(kids, "go")
                rates.append(steps * ids / seconds)
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    return rates


# ---------------------------------------------------------------------------------------------
# 4. metrics cost
# ---------------------------------------------------------------------------------------------


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker")
    parser.add_argument("--echo")
    parser.add_argument("--asyncio", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--ids", type=int, default=16, help="request ids per report")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--move-blocks", type=int, default=32)
    parser.add_argument("--move-seconds", type=float, default=3.0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.worker:
        worker_main(json.loads(args.worker))
        return
    if args.echo:
        echo_main(args.echo, args.asyncio)
        return
    if args.quick:
        args.steps, args.reps, args.move_seconds = 200, 2, 1.0
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} CPUs")

    inproc = [bench_in_process(args.steps, 64) for _ in range(args.reps)]
    inproc_small = [bench_in_process(args.steps, args.ids) for _ in range(args.reps)]
    via_daemon = bench_daemon_reps(args.steps, args.ids, args.reps)
    raw = bench_raw(args.steps, args.ids, args.reps, use_asyncio=False)
    raw_async = bench_raw(args.steps, args.ids, args.reps, use_asyncio=True)
    metrics = bench_metrics(args.move_blocks, args.move_seconds, args.reps)

    def row(name: str, xs: list[float], unit: str) -> str:
        return f"| {name} | {statistics.median(xs):,.0f} | {min(xs):,.0f}-{max(xs):,.0f} | {unit} |"

    print(f"\n{WORKERS} workers; {args.steps} steps per run; medians of {args.reps} runs\n")
    print("| path | median | min-max | unit |")
    print("| --- | ---: | ---: | --- |")
    print(row("in process, 64 ids per report", inproc, "request completions/s"))
    print(row(f"in process, {args.ids} ids per report", inproc_small, "request completions/s"))
    print(row(f"daemon, 8 worker processes, {args.ids} ids/report", via_daemon, "completions/s"))
    print(row("raw DEALER/ROUTER, blocking echo, same messages", raw, "completions/s"))
    print(row("raw DEALER/ROUTER, zmq.asyncio+uvloop echo", raw_async, "completions/s"))
    reports_daemon = statistics.median(via_daemon) * WORKERS / args.ids
    reports_raw = statistics.median(raw) * WORKERS / args.ids
    print(
        f"\nreports/s: daemon {reports_daemon:,.0f}, raw zmq {reports_raw:,.0f}; "
        f"daemon/raw = {statistics.median(via_daemon) / statistics.median(raw):.2f}, "
        f"daemon/raw asyncio = {statistics.median(via_daemon) / statistics.median(raw_async):.2f}; "
        f"aggregator in process / daemon = "
        f"{statistics.median(inproc_small) / statistics.median(via_daemon):.0f}x"
    )
    sm, im = statistics.median(metrics["scraped"]), statistics.median(metrics["idle"])
    print(
        f"\nmoves of {args.move_blocks} blocks (offload), {args.move_seconds:g} s per run, "
        f"alternating, medians of {args.reps}:"
    )
    print(row("not scraped", metrics["idle"], "moves/s"))
    print(row("/metrics scraped every 1 s", metrics["scraped"], "moves/s"))
    print(
        f"GB/s: not scraped {statistics.median(metrics['gbs_idle']):.3f}, "
        f"scraped {statistics.median(metrics['gbs_scraped']):.3f}"
    )
    print(f"scraped / not scraped = {sm / im:.3f} (cost {100 * (1 - sm / im):+.1f}%)")
    load = os.getloadavg()
    print(f"\nload average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "in_process_64": inproc,
                    "in_process": inproc_small,
                    "daemon": via_daemon,
                    "raw": raw,
                    "raw_asyncio": raw_async,
                    "metrics": metrics,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
