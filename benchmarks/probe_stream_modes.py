"""Probe: what a raw pyzmq stream gains from several connections and from malloc settings.

Raw PUSH -> PULL streams over loopback TCP in 1 MiB zero-copy frames, the receiver landing them
in a touched buffer with ``recv_into`` (what ``bench peer``'s baseline does), in four modes that
take turns round by round, each mode a persistent (warm) sender and receiver process pair:

- ``1 stream``: one connection, one receiving thread (the baseline's shape);
- ``1 stream, malloc``: the same with the receiver's glibc told to keep freed memory
  (`kvsidecar.wire.zmq_memory.keep_freed_memory`): ZeroMQ allocates each received message,
  and without it large messages are fresh pages every time;
- ``N streams`` and ``N streams, malloc``: ``--streams`` connections, each with its own
  receiving thread and the contexts with as many ZeroMQ I/O threads, each stream a share of
  the bytes.

Prints each mode's median GB/s and its ratio to ``1 stream`` over ``--rounds`` rounds.

    .venv/bin/python benchmarks/probe_stream_modes.py [--mib 1024] [--rounds 5] [--streams 2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import zmq

FRAME = 1 << 20


def _send(ports: list[int], nbytes: int) -> None:
    streams = len(ports)
    ctx = zmq.Context(io_threads=streams)
    socks = []
    for port in ports:
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.SNDHWM, 0)
        s.connect(f"tcp://127.0.0.1:{port}")
        socks.append(s)
    buf = np.ones(nbytes, dtype=np.uint8)
    share = nbytes // streams

    def one(i: int) -> None:
        for off in range(i * share, (i + 1) * share, FRAME):
            socks[i].send(buf[off : off + FRAME].data, copy=False)

    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for s in socks:
        s.close(linger=1000)
    ctx.term()


def _recv(streams: int, nbytes: int, malloc: bool) -> None:
    if malloc:
        from kvsidecar.wire.zmq_memory import keep_freed_memory

        keep_freed_memory()
    ctx = zmq.Context(io_threads=streams)
    socks, ports = [], []
    for _ in range(streams):
        s = ctx.socket(zmq.PULL)
        s.setsockopt(zmq.RCVHWM, 0)
        ports.append(s.bind_to_random_port("tcp://127.0.0.1"))
        socks.append(s)
    dest = np.ones(nbytes, dtype=np.uint8)
    view = memoryview(dest)
    share = nbytes // streams
    sender = subprocess.Popen(
        [sys.executable, __file__, "send", str(nbytes), *map(str, ports)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert sender.stdin is not None and sender.stdout is not None
    assert sender.stdout.readline().strip() == "ready"

    def one(i: int) -> None:
        for off in range(i * share, (i + 1) * share, FRAME):
            socks[i].recv_into(view[off : off + FRAME])

    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        start = time.perf_counter()
        sender.stdin.write("go\n")
        sender.stdin.flush()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(time.perf_counter() - start, flush=True)
    sender.stdin.close()
    sender.wait(30)
    for s in socks:
        s.close(linger=0)
    ctx.term()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=2)
    args = parser.parse_args()
    nbytes = args.mib << 20
    modes = {
        "1 stream": (1, False),
        "1 stream, malloc": (1, True),
        f"{args.streams} streams": (args.streams, False),
        f"{args.streams} streams, malloc": (args.streams, True),
    }
    procs = {}
    for name, (streams, malloc) in modes.items():
        p = subprocess.Popen(
            [sys.executable, __file__, "recv", str(nbytes), str(streams), str(int(malloc))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        procs[name] = p
    rates: dict[str, list[float]] = {k: [] for k in modes}
    try:
        for _ in range(args.rounds + 1):  # the first round warms the connections
            for name, p in procs.items():
                assert p.stdin is not None and p.stdout is not None
                p.stdin.write("go\n")
                p.stdin.flush()
                rates[name].append(nbytes / float(p.stdout.readline()) / 1e9)
    finally:
        for p in procs.values():
            if p.stdin is not None:
                p.stdin.close()
            p.wait(30)
    base = rates["1 stream"][1:]
    for name, all_rounds in rates.items():
        r = all_rounds[1:]
        ratio = statistics.median(a / b for a, b in zip(r, base, strict=True))
        print(
            f"{name:22s} {statistics.median(r):5.2f} GB/s ({min(r):.2f}-{max(r):.2f})"
            f"  paired ratio to 1 stream {ratio:.2f}"
        )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "send":
        _send([int(p) for p in sys.argv[3:]], int(sys.argv[2]))
    elif len(sys.argv) > 1 and sys.argv[1] == "recv":
        _recv(int(sys.argv[3]), int(sys.argv[2]), bool(int(sys.argv[4])))
    else:
        sys.exit(main())
