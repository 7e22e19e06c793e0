"""Probe: where a medium move's time goes, end to end against the daemon's own copy time.

One daemon (`kvsidecar.bench.procs.daemon`), engines A and B of 8 layers (``bench scaling``'s
blocks curve), a move of ``--blocks`` random ids per layer repeated ``--rounds`` times, each
followed by the same move copied in this process (`kvsidecar.bench.workload.run_copy`). Prints
the medians of the blocking client's end-to-end time, the daemon's executor time
(``Moved.seconds``: hand-off to a copy thread, copy, reply built) and the in-process copy, and
the daemon's CPU per command (from /proc, all its threads), so the fixed cost of a command
shows apart from the copy.

    .venv/bin/python benchmarks/probe_move_overhead.py [--blocks 64] [--rounds 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from kvsidecar.bench import procs
from kvsidecar.bench.common import Options
from kvsidecar.bench.local import engines
from kvsidecar.bench.workload import run_copy


def _cpu(pid: int) -> dict[str, int]:
    """CPU ticks per thread name of process ``pid``."""
    out: dict[str, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0) + int(fields[11]) + int(fields[12])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    opts = Options(layers=8, blocks=args.blocks, num_blocks=4096)
    with procs.daemon() as (endpoint, proc), engines(endpoint, opts, 4096, layers=8) as eng:
        rng = np.random.default_rng(1)
        s = rng.choice(4096, args.blocks, replace=False).astype(np.int64)
        d = rng.choice(4096, args.blocks, replace=False).astype(np.int64)
        s32, d32 = s.astype("<i4"), d.astype("<i4")
        local = run_copy(eng.a, eng.b, s, d)
        e2e, executor, in_process = [], [], []
        before = _cpu(proc.pid)
        for _ in range(args.rounds):
            start = time.perf_counter()
            moved = eng.client_a.move(eng.a_dev, eng.b_dev, s32, d32)
            e2e.append(time.perf_counter() - start)
            executor.append(moved.seconds)
            start = time.perf_counter()
            local()
            in_process.append(time.perf_counter() - start)
        after = _cpu(proc.pid)
    tick = os.sysconf("SC_CLK_TCK")
    mib = 8 * args.blocks * opts.block_bytes / 2**20

    def ms(values: list[float]) -> float:
        return statistics.median(values[2:]) * 1e3

    print(
        f"{mib:g} MiB: end to end {ms(e2e):.3f} ms, executor {ms(executor):.3f} ms, "
        f"in process {ms(in_process):.3f} ms; throughput ratio {ms(in_process) / ms(e2e):.2f}"
    )
    used = sum(t - before.get(n, 0) for n, t in after.items()) / tick / args.rounds * 1e6
    print(f"  daemon CPU per move, all threads: {used:.0f} µs (10 ms ticks: coarse)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
