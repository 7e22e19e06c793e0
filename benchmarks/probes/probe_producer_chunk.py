"""Probe: a producer daemon's CPU per ZMQ-plane read chunk, with no consumer daemon around.

One daemon with a loopback peer endpoint serves `ReadBlocks` chunks to a raw DEALER in this
process, which keeps ``--window`` chunks outstanding and drops the replies unread (ZeroMQ
receives them; nothing is copied into a destination). Three chunk shapes, like the plane's:

- ``contiguous``: 4 ranges of 1 MiB (a 4 MiB chunk of a layer's K half, contiguous block ids);
- ``random``: 128 ranges of one 32 KiB block each (a 4 MiB chunk of random block ids);
- ``runs of 4``: 32 ranges of 4 consecutive blocks (128 KiB each), what blocks of 64 tokens or
  of 4x the heads give.

For each it prints the producer's CPU per chunk, all threads and its event-loop thread apart
(from ``/proc``, over ``--chunks`` chunks), and the chunks served per second. The figure is
the daemon's own cost of serving reads, which the consumer's daemon and the network share the
machine with in a real pull.

    .venv/bin/python benchmarks/probes/probe_producer_chunk.py [--chunks 4000] [--runs 3]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import msgspec
import numpy as np
import torch
import zmq

from kvsidecar.bench import procs
from kvsidecar.bench.peer import _port
from kvsidecar.client import SidecarClient
from kvsidecar.memory import allocate_kv_caches
from kvsidecar.peer.messages import PeerReply, ReadBlocks, ReadData

LAYERS, BLOCKS = 32, 512
BLOCK_SHAPE = (16, 8, 128)
ROW = 16 * 8 * 128 * 2  # one block of K (or V) of one layer, float16


def _cpu_us(pid: int, tid: int | None = None) -> int:
    """CPU time (user + system) of a process's threads, or of one thread, in µs."""
    tids = [tid] if tid is not None else [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    total = 0
    for t in tids:
        fields = Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total * 1_000_000 // os.sysconf("SC_CLK_TCK")


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} µs ({min(values):.0f}-{max(values):.0f})"


def _chunks(shape: str) -> list[bytes]:
    """Range frames of 4 MiB chunks covering the first 128 blocks of every layer's K half."""
    out = []
    rng = np.random.default_rng(0)
    for layer in range(LAYERS):
        if shape == "contiguous":
            rows = [(layer, k << 20, 1 << 20) for k in range(4)]
        elif shape == "runs of 4":
            runs = np.sort(rng.choice(BLOCKS // 4, 32, replace=False))
            rows = [(layer, int(r) * 4 * ROW, 4 * ROW) for r in runs]
        else:
            ids = np.sort(rng.choice(BLOCKS, 128, replace=False))
            rows = [(layer, int(b) * ROW, ROW) for b in ids]
        out.append(np.array(rows, dtype="<i8").tobytes())
    return out


def _serve(sock: zmq.Socket[Any], frames: list[bytes], n: int, window: int) -> float:
    """Keep ``window`` chunks outstanding until ``n`` were answered; return the seconds."""
    decoder = msgspec.msgpack.Decoder(PeerReply)
    names = [f"l{i}" for i in range(LAYERS)]
    ids = itertools.count(1)
    sent = done = 0
    start = time.perf_counter()
    while done < n:
        while sent < n and sent - done < window:
            msg = ReadBlocks(
                id=next(ids), engine_id="p", tp_rank=0, pp_rank=0, request_id="r", layers=names
            )
            sock.send_multipart([msgspec.msgpack.encode(msg), frames[sent % len(frames)]])
            sent += 1
        reply = sock.recv_multipart(copy=False)
        if not isinstance(decoder.decode(reply[0].buffer), ReadData):
            raise RuntimeError(f"refused: {decoder.decode(reply[0].buffer)}")
        done += 1
    return time.perf_counter() - start


def main() -> None:
    """Start the producer, publish every block, time the two chunk shapes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=4000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--window", type=int, default=4)
    args = parser.parse_args()
    endpoint = f"tcp://127.0.0.1:{_port()}"
    src = allocate_kv_caches(LAYERS, (2, BLOCKS, *BLOCK_SHAPE), torch.float16)
    with (
        procs.daemon(peer_endpoint=endpoint, insecure=True) as (control, proc),
        SidecarClient(control, timeout_s=60, name="probe") as client,
    ):
        client.register_kv_caches({f"l{i}": t for i, t in enumerate(src)}, engine_id="p")
        client.publish("p", "r", list(range(BLOCKS)), lease_s=3600)
        ctx: zmq.Context[Any] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(endpoint)
        try:
            for shape in ("contiguous", "runs of 4", "random"):
                frames = _chunks(shape)
                _serve(sock, frames, 200, args.window)  # warm
                total, loop, rate = [], [], []
                for _ in range(args.runs):
                    cpu0, loop0 = _cpu_us(proc.pid), _cpu_us(proc.pid, proc.pid)
                    took = _serve(sock, frames, args.chunks, args.window)
                    total.append((_cpu_us(proc.pid) - cpu0) / args.chunks)
                    loop.append((_cpu_us(proc.pid, proc.pid) - loop0) / args.chunks)
                    rate.append(args.chunks / took)
                print(
                    f"{shape:11s} producer CPU per 4 MiB chunk: all threads {_spread(total)}, "
                    f"event loop {_spread(loop)}; {statistics.median(rate):.0f} chunks/s"
                )
        finally:
            sock.close(linger=0)
            ctx.term()


if __name__ == "__main__":
    main()
