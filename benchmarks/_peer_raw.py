"""Kept for old command lines: the raw baselines live in `kvsidecar.bench.peer_raw`."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if __name__ == "__main__":
    runpy.run_module("kvsidecar.bench.peer_raw", run_name="__main__")
