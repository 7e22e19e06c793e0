"""Probe: where a medium move's time goes, step by step, in the client and in the daemon.

A blocking `SidecarClient` moves ``--blocks`` random blocks of ``--layers`` layers between two
engines, each move followed by the in-process run copy of the same blocks (as `bench scaling`
takes turns), ``--moves`` times. The daemon runs under this script (``procs.daemon``'s
``launcher``), which wraps the functions of a move's path in both processes with timestamps
(``time.perf_counter``, one clock for all processes of the machine); each process writes its
events when it exits. The probe prints, for every step between two consecutive events of a move
(in the order of the first move after the warm-up), the median over the moves, then the daemon
move's and the in-process copy's median times, and the copy alone inside each (``_run_cpu``).

A wrapper costs about a µs per event, ~60 events per move: the steps' sum is a little above an
unwrapped move's time. docs/benchmarks.md, round 10, reads a 16 MiB move with it.

    .venv/bin/python benchmarks/probe_move_steps.py [--blocks 64] [--layers 8] [--moves 40]
"""

from __future__ import annotations

import argparse
import atexit
import collections
import functools
import importlib
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (module, attribute path, label): a move's path in the daemon and in the blocking client.
STEPS = [
    ("kvsidecar.daemon.edge", "Edge._on_readable", "readable"),
    ("kvsidecar.daemon.edge", "Edge._on_message", "on_message"),
    ("kvsidecar.daemon.edge", "Edge._decode", "decode"),
    ("kvsidecar.daemon.edge", "Edge._principal", "principal"),
    ("kvsidecar.daemon.edge", "authorize", "authorize"),
    ("kvsidecar.daemon.edge", "Edge._send", "reply"),
    ("kvsidecar.daemon.commands", "Commands._ids", "ids"),
    ("kvsidecar.daemon.commands", "prepare_move", "prepare_move"),
    ("kvsidecar.daemon.commands", "Commands._submit", "submit"),
    ("kvsidecar.node.jobs", "_pair_plan", "pair_plan"),
    ("kvsidecar.node.jobs", "check_ids", "check_ids"),
    ("kvsidecar.core.mover", "plan_runs", "plan_runs"),
    ("kvsidecar.node.executor", "CopyExecutor.submit", "executor_submit"),
    ("kvsidecar.node.executor", "CopyExecutor.settle_finished", "settle"),
    ("kvsidecar.core.copier", "_run_cpu", "copy"),
    ("kvsidecar.wire.zmqio", "try_recv", "try_recv"),
    ("kvsidecar.wire.zmqio", "send_frames", "send_frames"),
    ("kvsidecar.client.requests", "_Requests._move", "client_build"),
    ("kvsidecar.client.sync_transport", "_BlockingTransport._call", "client_call"),
]

Event = tuple[float, str, str]


def install(out: str, who: str) -> None:
    """Wrap every step with enter/leave timestamps; write them to ``out`` at exit."""
    events: list[Event] = []
    clock, current = time.perf_counter, threading.current_thread

    def wrapped(fn: Any, label: str) -> Any:
        @functools.wraps(fn)
        def step(*args: Any, **kwargs: Any) -> Any:
            events.append((clock(), f"{who}:{label}>", current().name))
            try:
                return fn(*args, **kwargs)
            finally:
                events.append((clock(), f"{who}:{label}<", current().name))

        return step

    for module, path, label in STEPS:
        owner: Any = importlib.import_module(module)
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        setattr(owner, name, wrapped(getattr(owner, name), label))

    def dump() -> None:
        with open(out, "w") as f:
            f.writelines(f"{t:.7f} {label} {thread}\n" for t, label, thread in events)

    atexit.register(dump)


def serve_traced(out: str, argv: list[str]) -> int:
    """The daemon's launcher: ``kvsidecar.cli`` with every step wrapped."""
    install(out, "D")
    from kvsidecar.cli import main

    return main(argv)


PHASES = [
    ("the client builds and sends", "move>", "C:send_frames<"),
    ("to the daemon's loop", "C:send_frames<", "D:readable>"),
    ("the loop: read, checks, plan, job", "D:readable>", "D:executor_submit<"),
    ("to a copy thread", "D:executor_submit<", "D:copy>"),
    ("the copy (two threads)", "D:copy>", "D:copy<"),
    ("the copy thread builds the reply", "D:copy<", "D:send_frames>"),
    ("the reply to the client, which returns", "D:send_frames>", "move<"),
]
"""Consecutive stretches of a move: (name, first event, the first next event after it)."""


def report(files: list[str], moves: list[tuple[float, float]], copies: list[float]) -> None:
    """Print each phase's and each step's median over the moves, then the totals."""
    events: list[Event] = []
    for path in files:
        with open(path) as f:
            events += [(float(t), label, thread) for t, label, thread in map(str.split, f)]
    events.sort()
    phases: dict[str, list[float]] = collections.defaultdict(list)
    steps: dict[str, list[float]] = collections.defaultdict(list)
    calls: dict[str, list[int]] = collections.defaultdict(list)
    for start, end in moves:
        seq = [(start, "move>")]
        seq += [(t, label) for t, label, _ in events if start <= t <= end]
        seq.append((end, "move<"))
        at: int | None = 0
        for name, a, b in PHASES:
            ia = _find(seq, a, at or 0)
            at = None if ia is None else _find(seq, b, ia)
            if ia is None or at is None:  # threads interleaved otherwise: not this move
                break
            phases[name].append((seq[at][0] - seq[ia][0]) * 1e6)
        spent: dict[str, float] = collections.defaultdict(float)
        count: dict[str, int] = collections.defaultdict(int)
        opened: dict[str, float] = {}
        for t, label in seq[1:-1]:
            if label.endswith(">"):
                opened[label[:-1]] = t
            elif label[:-1] in opened:
                spent[label[:-1]] += t - opened.pop(label[:-1])
                count[label[:-1]] += 1
        for label, seconds in spent.items():
            steps[label].append(seconds * 1e6)
            calls[label].append(count[label])
    print(f"{'phase':40s} {'µs':>8s}")
    for name, _, _ in PHASES:
        print(f"{name:40s} {statistics.median(phases[name]):8.1f} ({len(phases[name])} moves)")
    print(f"\n{'step (inclusive; C: client, D: daemon)':40s} {'µs':>8s} calls per move")
    for label in sorted(steps, key=lambda k: -statistics.median(steps[k])):
        us, n = statistics.median(steps[label]), statistics.median(calls[label])
        print(f"{label:40s} {us:8.1f} {n:g}")
    copy_in = {who: [(b - a) * 1e6 for a, b in _spans(events, f"{who}:copy")] for who in ("C", "D")}
    move = statistics.median(e - s for s, e in moves) * 1e3
    local = statistics.median(copies) * 1e3
    print(
        f"\ndaemon move {move:.3f} ms (its copy {statistics.median(copy_in['D']):.0f} µs), "
        f"in-process run copy {local:.3f} ms (its copy {statistics.median(copy_in['C']):.0f} µs),"
        f" ratio {local / move:.2f}"
    )


def _find(seq: list[tuple[float, str]], label: str, start: int) -> int | None:
    """Index of the first ``label`` event in ``seq`` from ``start`` on, or None."""
    return next((i for i in range(start, len(seq)) if seq[i][1] == label), None)


def _spans(events: list[Event], label: str) -> list[tuple[float, float]]:
    """(enter, leave) of each call of ``label``'s step, in time order (not nested)."""
    spans, opened = [], 0.0
    for t, name, _ in events:
        if name == label + ">":
            opened = t
        elif name == label + "<" and opened:
            spans.append((opened, t))
            opened = 0.0
    return spans


def main() -> None:
    """Run the moves against a traced daemon; print the steps."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--moves", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    import numpy as np

    from kvsidecar.bench import procs
    from kvsidecar.bench.common import Options
    from kvsidecar.bench.local import engines
    from kvsidecar.bench.workload import run_copy

    out = tempfile.mkdtemp(prefix="kvs-steps-")
    files = [f"{out}/client", f"{out}/daemon"]
    install(files[0], "C")
    launcher = [__file__, "--serve-traced", files[1]]
    num_blocks = max(4096, 2 * args.blocks)
    moves: list[tuple[float, float]] = []
    copies: list[float] = []
    with (
        procs.daemon(launcher=launcher) as (endpoint, _),
        engines(endpoint, Options(), num_blocks, layers=args.layers, prefix="st") as eng,
    ):
        rng = np.random.default_rng(0)
        s_ids = rng.choice(num_blocks, args.blocks, replace=False).astype(np.int64)
        d_ids = rng.choice(num_blocks, args.blocks, replace=False).astype(np.int64)
        s32, d32 = s_ids.astype("<i4"), d_ids.astype("<i4")
        local = run_copy(eng.a, eng.b, s_ids, d_ids)
        for k in range(args.warmup + args.moves):
            start = time.perf_counter()
            eng.client_a.move(eng.a_dev, eng.b_dev, s32, d32)
            end = time.perf_counter()
            local()
            if k >= args.warmup:
                moves.append((start, end))
                copies.append(time.perf_counter() - end)
    atexit._run_exitfuncs()  # this process's events, now
    report(files, moves, copies)
    for path in files:
        os.unlink(path)
    os.rmdir(out)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-traced":
        sys.exit(serve_traced(sys.argv[2], sys.argv[3:]))
    main()
