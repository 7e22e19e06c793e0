"""Node-to-node pull benchmark: two daemons over loopback TCP against raw pyzmq and raw NIXL.
A thin wrapper over ``kvsidecar bench peer`` with this script's original sizes.

Two daemon processes (producer with a loopback peer endpoint, consumer), this process the engine
worker of both: 32 layers of ``(2, 512, 16, 8, 128)`` float16 (kv_first, 64 KiB per block and
layer, 1 GiB per engine) in shared memory. Pulls of the first 8 blocks (16 MiB), 128 (256 MiB)
and all 512 (1 GiB) per plane, against raw pyzmq PUSH -> PULL into a buffer (glibc defaults, and
the daemon's malloc settings) and one prepared raw NIXL READ of the same bytes; see
`kvsidecar.bench.peer`. ``--json`` writes the common schema.

    UCX_NET_DEVICES=lo .venv/bin/python benchmarks/bench_peer.py [--repeat 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvsidecar.bench.cli import run_and_report
from kvsidecar.bench.common import Options


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=str, default="")
    parser.add_argument("--chart", metavar="FILE.png")
    args = parser.parse_args()
    opts = Options(layers=32, blocks=512, num_blocks=512, repeat=args.repeat)
    return run_and_report(("peer",), opts, args.json or None, args.chart, "bench_peer")


if __name__ == "__main__":
    sys.exit(main())
