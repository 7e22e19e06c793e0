"""A stand-in engine worker: allocates shared KV tensors and sends their fds to a daemon.

    python tests/procs/shm_worker.py CHANNEL_PATH

Prints one JSON line {"pid", "token", "strategy", "handles"} once the fds are sent, then serves
line commands on stdin:
    get I K      -> value of tensors[I].flatten()[K]
    set I K V    -> tensors[I].flatten()[K] = V, prints "ok"
    peer_closed  -> whether the daemon's end of the fd channel is closed
    quit
"""

from __future__ import annotations

import sys

import msgspec
import torch
import torch.multiprocessing as mp

from kvsidecar.memory import (
    FdChannelClient,
    allocate_kv_caches,
    allocate_shared,
    export_tensors,
    new_token,
)


def main() -> None:
    path = sys.argv[1]
    # Tensor 0: torch's own share_memory_() (file_descriptor strategy, the Linux default).
    plain = torch.arange(1000, dtype=torch.float32).share_memory_()
    # Tensors 1-3: three layers in one storage; tensor 4: a flat region of its own.
    layers = allocate_kv_caches(3, (8, 16), torch.float32)
    for i, layer in enumerate(layers):
        layer.copy_(torch.arange(layer.numel(), dtype=torch.float32).view(8, 16) + 1000 * (i + 1))
    flat = allocate_shared(4096)
    flat[:] = 7
    tensors = [plain, *layers, flat]
    handles, fds = export_tensors(tensors)
    token = new_token()
    client = FdChannelClient(path)
    client.send(token, fds)
    print(
        msgspec.json.encode(
            {
                "pid": __import__("os").getpid(),
                "token": token.hex(),
                "strategy": mp.get_sharing_strategy(),
                "nfds": len(fds),
                "handles": handles,
            }
        ).decode(),
        flush=True,
    )
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "get":
            print(float(tensors[int(cmd[1])].flatten()[int(cmd[2])]), flush=True)
        elif cmd[0] == "set":
            tensors[int(cmd[1])].view(-1)[int(cmd[2])] = float(cmd[3])
            print("ok", flush=True)
        elif cmd[0] == "peer_closed":
            print(client.peer_closed(), flush=True)
        elif cmd[0] == "quit":
            break
    client.close()


if __name__ == "__main__":
    main()
