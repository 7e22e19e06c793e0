"""A/B: ``kvsidecar bench`` kinds through two checkouts, in turns, with the ratio of the medians.

A change that must not cost speed (a refactor of the command path) is checked by running the same
benchmark from two checkouts, A (before) and B (after), in turns: each pair runs A then B, the next
pair B then A, so that both meet the same load and neither always goes first. Each run is a whole
``kvsidecar bench <kind> --json`` in its own checkout (its daemon, its client, its bench code), with
this interpreter. For every figure both runs report, it prints A's and B's medians over the pairs
with their ranges and B's median over A's, oriented so that below 1 means B is faster.

    git worktree add /tmp/a <commit-a>; git worktree add /tmp/b <commit-b>
    .venv/bin/python benchmarks/ab_bench.py /tmp/a /tmp/b --kinds latency,local [--pairs 5]
        [--match "1-block move"] [--bench-args=--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

Runs = dict[str, list[dict[str, tuple[float, bool, str]]]]
"""Each side's runs: figure name -> (value, higher is better, unit)."""


def _run(tree: Path, kind: str, extra: list[str], out: Path) -> dict[str, tuple[float, bool, str]]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "kvsidecar.cli", "bench", kind, "--no-progress", "--json"]
    subprocess.run([*cmd, str(out), *extra], cwd=tree, env=env, check=True, capture_output=True)
    results = json.loads(out.read_text())["results"]
    figures: dict[str, tuple[float, bool, str]] = {}
    for r in results:  # a figure listed against two baselines appears twice, with one value
        figures[r["name"]] = (float(r["value"]), bool(r["higher_is_better"]), r["unit"])
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tree_a", type=Path)
    parser.add_argument("tree_b", type=Path)
    parser.add_argument("--kinds", default="latency,local", help="bench kinds [latency,local]")
    parser.add_argument("--pairs", type=int, default=5, help="A/B pairs per kind [5]")
    parser.add_argument("--match", default="", help="print only figures whose name contains this")
    parser.add_argument("--bench-args", default="", help='for every bench run, e.g. "--quick"')
    args = parser.parse_args()
    trees = {"A": args.tree_a.resolve(), "B": args.tree_b.resolve()}
    with tempfile.TemporaryDirectory(prefix="kvsab-") as tmp:
        for kind in args.kinds.split(","):
            runs: Runs = {"A": [], "B": []}
            for pair in range(args.pairs):
                for side in ("A", "B") if pair % 2 == 0 else ("B", "A"):
                    out = Path(tmp) / f"{kind}-{side}-{pair}.json"
                    runs[side].append(_run(trees[side], kind, shlex.split(args.bench_args), out))
                    print(f"{kind}: pair {pair} {side} done", file=sys.stderr, flush=True)
            _report(kind, runs, args.match)
    return 0


def _report(
    kind: str, runs: dict[str, list[dict[str, tuple[float, bool, str]]]], match: str
) -> None:
    names = [n for n in runs["A"][0] if all(n in r for r in (*runs["A"], *runs["B"]))]
    print(f"\n{kind}: medians of {len(runs['A'])} runs each (range); B/A below 1: B is faster")
    print("| figure | unit | A | B | B/A |\n| --- | --- | ---: | ---: | ---: |")
    for name in names:
        if match not in name:
            continue
        _, higher, unit = runs["A"][0][name]
        a = [r[name][0] for r in runs["A"]]
        b = [r[name][0] for r in runs["B"]]
        ma, mb = statistics.median(a), statistics.median(b)
        ratio = (ma / mb if higher else mb / ma) if ma and mb else float("nan")
        print(
            f"| {name} | {unit} | {ma:.4g} ({min(a):.4g}-{max(a):.4g}) "
            f"| {mb:.4g} ({min(b):.4g}-{max(b):.4g}) | {ratio:.3f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
