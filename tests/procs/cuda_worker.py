"""A stand-in GPU engine worker: exports CUDA tensors by IPC handle (needs CUDA).

    python tests/procs/cuda_worker.py

Prints the handles (JSON list) of three layers carved from one CUDA tensor, layer i filled with
i + 1, then serves "get I K", "set I K V" and "quit" on stdin like shm_worker.py.
"""

from __future__ import annotations

import sys

import msgspec
import torch

from kvsidecar.memory import export_cuda_tensors


def main() -> None:
    region = torch.zeros(3, 1024, dtype=torch.float32, device="cuda")
    layers = [region[i] for i in range(3)]
    for i, layer in enumerate(layers):
        layer.fill_(i + 1)
    torch.cuda.synchronize()
    print(msgspec.json.encode(export_cuda_tensors(layers)).decode(), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        torch.cuda.synchronize()
        if cmd[:1] == ["get"]:
            print(float(layers[int(cmd[1])][int(cmd[2])]), flush=True)
        elif cmd[:1] == ["set"]:
            layers[int(cmd[1])][int(cmd[2])] = float(cmd[3])
            torch.cuda.synchronize()
            print("ok", flush=True)
        elif cmd[:1] == ["quit"]:
            break


if __name__ == "__main__":
    main()
