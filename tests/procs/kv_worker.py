"""An engine-worker process for end-to-end tests: allocate, fill, register, then obey stdin.

Run as ``python -m tests.procs.kv_worker '<json spec>'``. It allocates its KV caches in shared
memory in the requested memory order, fills them with values that `expected_layer` recomputes
in the test, registers them with the daemon, prints ``ready`` and then reads commands from stdin:

- ``dump <dir>``: write each layer's logical tensor (NHD shape order) to ``<dir>/<name>.npy``
- ``exit`` (or EOF): close the client and exit 0
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvsidecar.client import SidecarClient
from kvsidecar.memory import allocate_kv_caches


def logical_shape(spec: dict[str, Any]) -> tuple[int, ...]:
    """(2, B, N, H, C): the kv_first logical shape of every layer."""
    return (2, spec["blocks"], spec["block_size"], spec["heads"], spec["head_size"])


def expected_layer(spec: dict[str, Any], layer: int) -> torch.Tensor:
    """The initial logical values of one layer, from the spec's seed alone."""
    gen = torch.Generator().manual_seed(spec["seed"] * 1000 + layer)
    return torch.randn(logical_shape(spec), generator=gen).to(torch.float16)


def logical(cache: torch.Tensor, order: str) -> torch.Tensor:
    """The (2, B, N, H, C) view of a cache allocated in memory order."""
    return cache.transpose(-3, -2) if order == "HND" else cache


def main() -> None:
    spec = json.loads(sys.argv[1])
    order = spec.get("order", "NHD")
    shape = list(logical_shape(spec))
    if order == "HND":
        shape[2], shape[3] = shape[3], shape[2]
    caches = allocate_kv_caches(spec["layers"], shape, torch.float16)
    for i, cache in enumerate(caches):
        logical(cache, order).copy_(expected_layer(spec, i))
    names = [f"layer{i}" for i in range(spec["layers"])]
    client = SidecarClient(spec["endpoint"], timeout_s=10)
    client.register_kv_caches(
        dict(zip(names, caches, strict=True)),
        engine_id=spec["engine"],
        tp_rank=spec.get("tp_rank", 0),
        tp_size=spec.get("tp_size", 1),
        memory_order=order,
        shape_order="HN" if order == "HND" else "NH",
        host_blocks=spec.get("host_blocks", 0),
    )
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "dump":
            out = Path(arg)
            for name, cache in zip(names, caches, strict=True):
                np.save(out / f"{name}.npy", logical(cache, order).contiguous().numpy())
            print("ok", flush=True)
        elif cmd == "exit":
            break
    client.close()


if __name__ == "__main__":
    main()
