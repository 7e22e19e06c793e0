"""The raw side of ``bench peer``'s baselines, in its own process: a pyzmq sender or a NIXL target.

``python -m kvsidecar.bench.peer_raw zmq-send <endpoint> <nbytes> <frame> <repeat>``: PUSH
``repeat`` streams of ``nbytes`` from one preallocated, touched buffer in ``frame``-byte
zero-copy frames, waiting for a go line on stdin each time.
``python -m kvsidecar.bench.peer_raw nixl-target <nbytes>``: register a touched buffer with a
NIXL agent, print its metadata (hex) and address, then wait for EOF.
"""

from __future__ import annotations

import sys

import numpy as np


def zmq_send(endpoint: str, nbytes: int, frame: int, repeat: int) -> None:
    """Stream ``repeat`` times on request; see the module docstring."""
    import zmq

    buf = np.ones(nbytes, dtype=np.uint8)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(endpoint)
    print("ready", flush=True)
    for _ in range(repeat):
        sys.stdin.readline()
        for off in range(0, nbytes, frame):
            sock.send(buf[off : off + frame].data, copy=False)
    sys.stdin.readline()
    sock.close(linger=1000)
    ctx.term()


def nixl_target(nbytes: int) -> None:
    """Expose a registered buffer to a NIXL reader until stdin closes."""
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    buf = torch.ones(nbytes, dtype=torch.uint8)
    agent = nixl_agent("raw-target", nixl_agent_config(backends=["UCX"]))
    agent.register_memory(buf)
    print("META", bytes(agent.get_agent_metadata()).hex(), buf.data_ptr(), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    if sys.argv[1] == "zmq-send":
        zmq_send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        nixl_target(int(sys.argv[2]))
