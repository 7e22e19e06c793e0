"""Probe: what a blocking pyzmq client's round trip costs against three kinds of echo server.

Three ROUTER echo servers, each in its own process over ipc: a blocking receive/send loop, a
zmq.asyncio server on uvloop (``bench latency``'s echo), and a plain socket read from a uvloop
reader callback (the daemon's control-socket pattern, `kvsidecar.daemon.edge`), doing no work.
One blocking DEALER per server sends the three frames of a move request; the servers take turns
in rounds of 300 round trips; prints the median of the rounds' p50s. It bounds what a daemon
built on each pattern can reach for the blocking client.

    .venv/bin/python benchmarks/probe_echo_servers.py [--rounds 12]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq


def serve(mode: str, endpoint: str) -> None:
    """Echo on ``endpoint`` with the pattern ``mode`` until killed."""
    if mode == "blocking":
        sock = zmq.Context().socket(zmq.ROUTER)
        sock.bind(endpoint)
        print("ready", flush=True)
        while True:
            sock.send_multipart(sock.recv_multipart(copy=False), copy=False)
    import uvloop
    import zmq.asyncio as zasync

    async def asyncio_echo() -> None:
        sock = zasync.Context().socket(zmq.ROUTER)
        sock.bind(endpoint)
        print("ready", flush=True)
        while True:
            frames = await sock.recv_multipart(copy=False)
            await sock.send_multipart(frames, copy=False)

    async def reader_echo() -> None:
        sock = zmq.Context().socket(zmq.ROUTER)
        sock.bind(endpoint)
        print("ready", flush=True)
        loop = asyncio.get_running_loop()

        def on_readable() -> None:
            while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[operator]
                sock.send_multipart(sock.recv_multipart(copy=False), copy=False)

        loop.add_reader(sock.getsockopt(zmq.FD), on_readable)
        loop.call_soon(on_readable)
        await loop.create_future()

    uvloop.run(asyncio_echo() if mode == "asyncio" else reader_echo())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    runtime = tempfile.mkdtemp(prefix="kvs-echo-")
    modes = ["blocking", "asyncio", "reader"]
    ctx = zmq.Context()
    procs, socks = [], {}
    try:
        for mode in modes:
            endpoint = f"ipc://{runtime}/{mode}.sock"
            proc = subprocess.Popen(
                [sys.executable, __file__, "serve", mode, endpoint],
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(proc)
            if proc.stdout is None or proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"{mode} echo did not start")
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            socks[mode] = sock
        frames = [b"x" * 100, b"\0" * 4, b"\0" * 4]
        p50s: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(args.rounds + 1):
            for mode, sock in socks.items():
                times = []
                for _ in range(300):
                    start = time.perf_counter()
                    sock.send_multipart(frames)
                    sock.recv_multipart()
                    times.append(time.perf_counter() - start)
                if r:  # the first round warms up
                    p50s[mode].append(statistics.median(times) * 1e6)
        for mode in modes:
            print(f"{mode:9s} server: p50 {statistics.median(p50s[mode]):.0f} µs")
    finally:
        for sock in socks.values():
            sock.close(linger=0)
        for proc in procs:
            proc.kill()
            proc.wait(5)
        for path in Path(runtime).iterdir():
            path.unlink()
        Path(runtime).rmdir()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
