"""Engine workers for the peer tests: one process registers several engines and TP ranks.

Run as ``python -m tests.procs.peer_worker '<json spec>'``. The spec has ``endpoints`` (one
client per daemon, every engine registered with each) and ``engines``, each a dict:
``engine``, ``seed``, ``tp_size``, ``layers``, ``blocks``, ``block_size``, ``heads`` (total KV
heads), ``head_size``, ``order`` (NHD/HND), ``arrangement`` (kv_first or mla), ``model_hash``,
``fill`` (default true; false leaves the memory zeroed, for big buffers).
Every rank of every engine is allocated in shared memory, filled from `global_layer` (rank ``q``
holds its heads of it, MLA ranks hold all of it), registered, then ``ready`` is printed.

stdin commands: ``dump <dir>`` writes ``<engine>.r<rank>.l<layer>.npy`` (logical tensors, NHD
shape order) and prints ``ok``; ``fill`` puts every rank's memory back to its initial values (as
registered) and prints ``ok``; ``exit`` ends the process.
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


def global_shape(e: dict[str, Any]) -> tuple[int, ...]:
    """The whole engine's logical tensor of one layer (all heads)."""
    if e.get("arrangement", "kv_first") == "mla":
        return (e["blocks"], e["block_size"], e["head_size"])
    return (2, e["blocks"], e["block_size"], e["heads"], e["head_size"])


def global_layer(e: dict[str, Any], layer: int) -> np.ndarray:
    """The engine's values of one layer, from its seed alone (the tests' reference)."""
    gen = torch.Generator().manual_seed(e["seed"] * 1000 + layer)
    return torch.randn(global_shape(e), generator=gen).to(torch.float16).numpy()


def rank_heads(e: dict[str, Any], rank: int) -> slice:
    """The heads a TP rank holds (heads >= tp_size in these tests)."""
    per = e["heads"] // e["tp_size"]
    return slice(rank * per, (rank + 1) * per)


def rank_values(e: dict[str, Any], rank: int, layer: int) -> np.ndarray:
    """A rank's initial logical values of one layer."""
    g = global_layer(e, layer)
    if e.get("arrangement", "kv_first") == "mla":
        return g
    return g[:, :, :, rank_heads(e, rank)]


def fill(e: dict[str, Any], rank: int, tensors: list[torch.Tensor]) -> None:
    """Put a rank's initial values (`rank_values`) into its tensors; zeros without ``fill``."""
    mla = e.get("arrangement", "kv_first") == "mla"
    order = "NHD" if mla else e.get("order", "NHD")
    for i, t in enumerate(tensors):
        if not e.get("fill", True):
            t.zero_()  # big buffers for fault tests and benchmarks: contents do not matter
            continue
        view = t.transpose(-3, -2) if order == "HND" else t
        view.copy_(torch.from_numpy(rank_values(e, rank, i)))


def main() -> None:
    spec = json.loads(sys.argv[1])
    clients = [SidecarClient(ep, timeout_s=20) for ep in spec["endpoints"]]
    caches: dict[tuple[str, int], list[torch.Tensor]] = {}
    for e in spec["engines"]:
        mla = e.get("arrangement", "kv_first") == "mla"
        order = "NHD" if mla else e.get("order", "NHD")
        for rank in range(e["tp_size"]):
            shape = list(rank_values(e, rank, 0).shape)
            if order == "HND":
                shape[-3], shape[-2] = shape[-2], shape[-3]
            tensors = allocate_kv_caches(e["layers"], shape, torch.float16)
            if e.get("fill", True):  # allocated zeroed: big unfilled buffers stay untouched
                fill(e, rank, tensors)
            caches[(e["engine"], rank)] = tensors
            for client in clients:
                client.register_kv_caches(
                    {f"layer{i}": t for i, t in enumerate(tensors)},
                    engine_id=e["engine"],
                    tp_rank=rank,
                    tp_size=e["tp_size"],
                    model_hash=e.get("model_hash", "m"),
                    arrangement="mla" if mla else "kv_first",
                    memory_order=order,
                    shape_order="HN" if order == "HND" else "NH",
                )
    print("ready", flush=True)
    orders = {e["engine"]: e.get("order", "NHD") for e in spec["engines"]}
    engines = {e["engine"]: e for e in spec["engines"]}
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "dump":
            out = Path(arg)
            out.mkdir(parents=True, exist_ok=True)
            for (engine, rank), tensors in caches.items():
                for i, t in enumerate(tensors):
                    view = t.transpose(-3, -2) if orders[engine] == "HND" and t.dim() == 5 else t
                    np.save(out / f"{engine}.r{rank}.l{i}.npy", view.contiguous().numpy())
            print("ok", flush=True)
        elif cmd == "fill":
            for (engine, rank), tensors in caches.items():
                fill(engines[engine], rank, tensors)
            print("ok", flush=True)
        elif cmd == "exit":
            break
    for client in clients:
        client.close()


if __name__ == "__main__":
    main()
