"""Register a CPU cache larger than ``/dev/shm`` (run where a small tmpfs is mounted there).

Prints one JSON line: what the worker half raised, and whether anything was moved into shared
memory (it must not be: the check comes first).
"""

from __future__ import annotations

import json
import sys

import torch

from kvsidecar.integrations.vllm.layout import detect_layout
from kvsidecar.integrations.vllm.settings import ConnectorSettings
from kvsidecar.integrations.vllm.worker import WorkerSide


def main() -> None:
    mib = int(sys.argv[1])
    storage = torch.zeros(mib << 19, dtype=torch.bfloat16)  # mib MiB, one storage as vLLM has
    half = storage.numel() // 2
    caches = {f"layer{i}": storage[i * half : (i + 1) * half].view(-1, 2, 32, 64) for i in (0, 1)}
    side = WorkerSide(
        ConnectorSettings(endpoint="ipc:///nonexistent/x.sock"),
        engine_id="e",
        tp_rank=0,
        tp_size=1,
        model_hash="",
    )
    try:
        side.register(caches, detect_layout(caches["layer0"], cpu_packing="vllm_cpu"))
        error = ""
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"error": error, "shared": storage.is_shared()}))


if __name__ == "__main__":
    main()
