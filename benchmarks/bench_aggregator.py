"""Completion aggregation and metrics cost, each next to its baseline, in one run.

A thin wrapper over `kvsidecar.bench.aggregator_procs` (also ``kvsidecar bench aggregator
--processes``), which documents the workloads: the aggregator in process, 8 worker processes
reporting through a daemon, the same messages over raw DEALER/ROUTER (blocking and
zmq.asyncio+uvloop echo), and move throughput with ``/metrics`` scraped every second or not.

Run: ``.venv/bin/python benchmarks/bench_aggregator.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvsidecar.bench import aggregator_procs as agg


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
    if args.worker:  # the old child entry points, kept for old command lines
        agg.worker_main(json.loads(args.worker))
        return
    if args.echo:
        agg.echo_main(args.echo, args.asyncio)
        return
    if args.quick:
        args.steps, args.reps, args.move_seconds = 200, 2, 1.0
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} CPUs")

    inproc = [agg.bench_in_process(args.steps, 64) for _ in range(args.reps)]
    inproc_small = [agg.bench_in_process(args.steps, args.ids) for _ in range(args.reps)]
    via_daemon = agg.bench_daemon_reps(args.steps, args.ids, args.reps)
    raw = agg.bench_raw(args.steps, args.ids, args.reps, use_asyncio=False)
    raw_async = agg.bench_raw(args.steps, args.ids, args.reps, use_asyncio=True)
    metrics = agg.bench_metrics(args.move_blocks, args.move_seconds, args.reps)

    def row(name: str, xs: list[float], unit: str) -> str:
        return f"| {name} | {statistics.median(xs):,.0f} | {min(xs):,.0f}-{max(xs):,.0f} | {unit} |"

    print(f"\n{agg.WORKERS} workers; {args.steps} steps per run; medians of {args.reps} runs\n")
    print("| path | median | min-max | unit |")
    print("| --- | ---: | ---: | --- |")
    print(row("in process, 64 ids per report", inproc, "request completions/s"))
    print(row(f"in process, {args.ids} ids per report", inproc_small, "request completions/s"))
    print(row(f"daemon, 8 worker processes, {args.ids} ids/report", via_daemon, "completions/s"))
    print(row("raw DEALER/ROUTER, blocking echo, same messages", raw, "completions/s"))
    print(row("raw DEALER/ROUTER, zmq.asyncio+uvloop echo", raw_async, "completions/s"))
    reports_daemon = statistics.median(via_daemon) * agg.WORKERS / args.ids
    reports_raw = statistics.median(raw) * agg.WORKERS / args.ids
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
