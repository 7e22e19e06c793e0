"""Daemon benchmark: block moves and command latency through a real daemon, against in-process
copies and a raw ZeroMQ echo. A thin wrapper over ``kvsidecar bench local`` and ``latency``.

The workload and methods are documented in `kvsidecar.bench.local` and `kvsidecar.bench.latency`
(and docs/benchmarks.md): two engines of ``--layers`` x (``--num-blocks``, 16, 8, 128) float16 in
shared memory, ``--blocks`` ids moved per layer (defaults 32 x 4096, 512 = 512 MiB per command);
daemon w2w and offload moves against the in-process run copy, naive ``index_copy_`` and memcpy;
1-block move round trips against a raw zmq.asyncio echo. ``--json`` writes the common schema
``{"machine", "results": [{"name", "value", "unit", "baseline", "baseline_value", "ratio",
"higher_is_better"}]}``.

    .venv/bin/python benchmarks/bench_daemon.py [--layers 32] [--blocks 512] [--repeat 7]
        [--num-blocks 4096] [--rounds 20] [--json FILE] [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvsidecar.bench.cli import run_and_report
from kvsidecar.bench.common import QUICK, Options
from kvsidecar.bench.procs import run_echo_server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=None, help="K-or-V tensors (default 32)")
    parser.add_argument("--blocks", type=int, default=None, help="ids moved per layer (512)")
    parser.add_argument("--num-blocks", type=int, default=None, help="blocks per tensor (4096)")
    parser.add_argument("--repeat", type=int, default=None, help="timed moves per method (7)")
    parser.add_argument("--rounds", type=int, default=None, help="latency rounds (20)")
    parser.add_argument("--batch", type=int, default=100, help="round trips per method per round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--peer-data-plane",
        default="auto",
        choices=("auto", "zmq", "nixl"),
        help="the daemon's setting (auto, its default, starts a NIXL agent when NIXL is installed)",
    )
    parser.add_argument("--quick", action="store_true", help="small shapes, a few seconds")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--chart", metavar="FILE.png")
    parser.add_argument("--echo-server", metavar="ENDPOINT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.echo_server:  # old entry point of the echo process; kept for old command lines
        run_echo_server(args.echo_server)
        return 0
    values = dict(QUICK) if args.quick else {}
    values.pop("batch", None)
    for key in ("layers", "blocks", "num_blocks", "repeat", "rounds"):
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
    opts = Options(
        **values,
        batch=args.batch,
        seed=args.seed,
        peer_data_plane=args.peer_data_plane,
        run_lengths=(16,),  # the original id sets: random and runs16
        quick=args.quick,
    )
    return run_and_report(("local", "latency"), opts, args.json, args.chart, "bench_daemon")


if __name__ == "__main__":
    sys.exit(main())
