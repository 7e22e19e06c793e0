"""A user that takes as much of the node's prefix cache as it can, and holds on to it.

Run as root: ``python -m tests.procs.cache_hog '<json spec>'`` with ``{"uid", "endpoint",
"engine", "namespaces", "capacity_bytes"}``. It allocates its KV caches and imports everything
first, drops to ``uid``, registers as engine ``engine``, then stores one block into each of
``namespaces`` fingerprints of its own, asking ``capacity_bytes`` for each, and pins what it
stored (a lookup with a long pin), so that none of it is idle. It prints one JSON line, what
each store answered (``stored`` or an error code), and holds everything until ``exit``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

from kvsidecar.client import SidecarClient, SidecarError
from kvsidecar.memory import allocate_kv_caches


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    caches = allocate_kv_caches(2, (2, 16, 4, 2, 8), torch.float32)
    os.setgroups([])
    os.setgid(spec["uid"])
    os.setuid(spec["uid"])
    outcomes: list[str] = []
    key = bytes(range(32))
    with SidecarClient(spec["endpoint"], heartbeat=True, timeout_s=30) as client:
        client.register_kv_caches(
            {f"layer{i}": t for i, t in enumerate(caches)}, engine_id=spec["engine"]
        )
        for i in range(spec["namespaces"]):
            fp = f"hog-{i}"
            try:
                stored = client.submit_cache_store(
                    fp, [key], [1], capacity_bytes=spec["capacity_bytes"]
                ).result()
                client.cache_lookup(fp, [key], pin_s=600)
                outcomes.append("stored" if stored.stored else "dropped")
            except SidecarError as exc:
                outcomes.append(exc.code)
        print(json.dumps({"outcomes": outcomes}), flush=True)
        for line in sys.stdin:
            if line.strip() in ("", "exit"):
                break


if __name__ == "__main__":
    main()
