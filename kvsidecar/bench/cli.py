"""``kvsidecar bench``: the argument parser and the runner behind the subcommand.

Kept apart from `kvsidecar.cli` so that the daemon's command line imports nothing of the
benchmarks (no torch at parse time).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

KINDS = ("local", "latency", "peer", "aggregator", "scaling", "gpu", "disk")
"""Every kind; ``all`` runs all of them except ``gpu`` (which needs CUDA) and ``disk`` (which
writes gigabytes to a file system of the user's choosing)."""

ALL = ("local", "latency", "peer", "aggregator", "scaling")


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 16,8,128, got {text!r}") from None
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"dimensions must be >= 1, got {text!r}")
    return shape


def add_bench_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``kvsidecar``'s subparsers."""
    p: argparse.ArgumentParser = sub.add_parser(
        "bench",
        help="measure the daemon against in-process copies, memcpy, raw pyzmq and raw NIXL",
        description=(
            "Measure moves, command latency, node-to-node pulls, completion aggregation and "
            "scaling, each side by side with its baseline in the same run; print a table of "
            "medians, min-max and ratios. See docs/benchmarks.md."
        ),
    )
    p.add_argument(
        "kind",
        nargs="?",
        default="all",
        choices=(*KINDS, "all"),
        help="what to measure; all = " + ", ".join(ALL) + " [all]",
    )
    p.add_argument("--layers", type=int, help="K-or-V tensors per engine [32; quick 8]")
    p.add_argument("--blocks", type=int, help="block ids moved per layer [512; quick 128]")
    p.add_argument("--num-blocks", type=int, help="blocks per layer tensor [4096; quick 1024]")
    p.add_argument("--block-shape", type=_shape, help="one block's shape, e.g. 16,8,128 [16,8,128]")
    p.add_argument("--dtype", help="torch dtype of the caches [float16]")
    p.add_argument("--repeat", type=int, help="timed rounds per bandwidth figure [7; quick 3]")
    p.add_argument("--rounds", type=int, help="latency rounds [20; quick 3]")
    p.add_argument("--batch", type=int, help="round trips per method per round [100; quick 50]")
    p.add_argument(
        "--run-lengths", type=_shape, help="block-run lengths besides random ids [4,16,64]"
    )
    p.add_argument("--seed", type=int, default=0, help="of the random ids [0]")
    p.add_argument(
        "--peer-data-plane",
        choices=("zmq", "nixl", "auto"),
        default=None,
        help="the daemons' setting in local, latency and scaling [auto]",
    )
    p.add_argument("--quick", action="store_true", help="small sizes: each kind in under 60 s")
    p.add_argument(
        "--processes",
        action="store_true",
        help="aggregator: also 8 worker processes against raw zmq, and the /metrics scrape cost",
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="latency: servers (daemon and echoes) on the first CPU, the client on the second",
    )
    p.add_argument(
        "--dir",
        help="disk: a directory on the file system to measure (the cache_dir's) "
        "[a temporary one in /var/tmp]",
    )
    p.add_argument(
        "--rebuild",
        type=int,
        metavar="BLOCKS",
        help="disk: also time the index rebuild of a tier of BLOCKS blocks, 10 GiB in all [none]",
    )
    p.add_argument("--json", metavar="FILE", help="write {machine, results} to FILE")
    p.add_argument("--chart", metavar="FILE.png", help="draw the charts (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def options_from(args: argparse.Namespace) -> Any:
    """Build `Options` from parsed flags: given flags win, then --quick's sizes, then defaults."""
    from kvsidecar.bench.common import QUICK, Options

    values: dict[str, Any] = dict(QUICK) if args.quick else {}
    for field in dataclasses.fields(Options):
        given = getattr(args, field.name, None)
        if given is not None and field.name not in ("quick", "progress"):
            values[field.name] = given
    return Options(quick=args.quick, progress=not args.no_progress, **values)


def _runner(kind: str) -> Callable[[Any], list[Any]]:
    module = importlib.import_module(f"kvsidecar.bench.{kind}")
    run: Callable[[Any], list[Any]] = module.run
    return run


def run_bench(args: argparse.Namespace) -> int:
    """Run the kinds asked for; print the table; write JSON and charts. Returns the exit code."""
    try:
        opts = options_from(args)
    except ValueError as exc:
        print(f"kvsidecar bench: {exc}", file=sys.stderr)
        return 2
    kinds = ALL if args.kind == "all" else (args.kind,)
    return run_and_report(kinds, opts, args.json, args.chart, f"kvsidecar bench {args.kind}")


def run_and_report(
    kinds: tuple[str, ...], opts: Any, json_path: str | None, chart: str | None, title: str
) -> int:
    """Measure ``kinds`` with ``opts``, print one table per group, write JSON and the chart.

    Returns 0, or 1 when matplotlib is missing for ``chart`` or no kind could be measured.
    """
    from kvsidecar.bench.common import (
        BenchUnavailable,
        describe_cpu_idle,
        machine_info,
        note,
        table,
        write_json,
    )

    if chart:
        from kvsidecar.bench.charts import require_matplotlib

        try:
            require_matplotlib()  # fail before minutes of measuring, not after
        except BenchUnavailable as exc:
            print(f"kvsidecar bench: {exc}", file=sys.stderr)
            return 1
    load_before = machine_info()["loadavg"]
    figures: list[Any] = []
    failed: list[str] = []
    seconds: dict[str, float] = {}
    for kind in kinds:
        start = time.monotonic()
        try:
            figures += _runner(kind)(opts)
        except BenchUnavailable as exc:
            print(f"{kind}: not measured: {exc}", file=sys.stderr)
            failed.append(kind)
        seconds[kind] = round(time.monotonic() - start, 1)
        note(f"{kind}: {seconds[kind]:.0f} s")
    groups: dict[str, list[Any]] = {}
    for f in figures:
        groups.setdefault(f.group, []).append(f)
    for group, members in groups.items():
        print(f"\n### {group}\n")
        print("\n".join(table(members)), flush=True)
    machine = machine_info(
        loadavg_start=load_before,
        options={k: v for k, v in dataclasses.asdict(opts).items() if k != "progress"},
        kinds=list(kinds),
        seconds=seconds,
        not_measured=failed,
    )
    print(f"\nload average at start {_load(load_before)}, at end {_load(machine['loadavg'])}")
    print(describe_cpu_idle(machine["cpu_idle"]))
    if json_path:
        write_json(json_path, machine, figures)
        note(f"wrote {json_path}")
    if chart:
        from kvsidecar.bench.charts import draw

        if draw(figures, Path(chart), title=title):
            note(f"wrote {chart}")
        else:
            note("no figure of this run has a chart")
    return 1 if len(failed) == len(kinds) else 0


def _load(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)
