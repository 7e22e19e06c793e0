"""Kept for old command lines: the raw baselines now live in `kvsidecar.bench.peer_raw`."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvsidecar.bench.peer_raw import nixl_target, zmq_send

if __name__ == "__main__":
    if sys.argv[1] == "zmq-send":
        zmq_send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        nixl_target(int(sys.argv[2]))
