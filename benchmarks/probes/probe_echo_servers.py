"""Probe: what a blocking pyzmq client's round trip costs against three kinds of echo server.

Three ROUTER echo servers, each in its own process over ipc: a blocking receive/send loop, a
zmq.asyncio server on uvloop (``bench latency``'s echo), and a plain socket read from a uvloop
reader callback (the daemon's control-socket pattern, `kvsidecar.daemon.edge`), doing no work.
Two more servers do a 1-block move's essential work and nothing else: ``copy`` decodes the
request (the protocol's decoder), reads the ids, copies one block of one layer (K and V, 64 KiB)
with numpy and answers a `Moved`, all on the receiving thread; ``hop`` does the same but hands
the copy and the reply to a second thread (a `queue.SimpleQueue`, the reply sent under a lock),
as the daemon does. They bound what any design reaches: ``copy`` a daemon whose copy thread reads
the control socket itself, ``hop`` one that keeps a hand-off, both without any check.
One blocking DEALER per server sends the three frames of a move request; the servers take turns
in rounds of 300 round trips; prints the median of the rounds' p50s and its ratio to the blocking
echo.

    .venv/bin/python benchmarks/probes/probe_echo_servers.py [--rounds 12]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def serve(mode: str, endpoint: str) -> None:
    """Echo on ``endpoint`` with the pattern ``mode`` until killed."""
    if mode == "blocking":
        sock = zmq.Context().socket(zmq.ROUTER)
        sock.bind(endpoint)
        print("ready", flush=True)
        while True:
            sock.send_multipart(sock.recv_multipart(copy=False), copy=False)
    if mode in ("copy", "hop"):
        _serve_moves(endpoint, hop=mode == "hop")
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


def _serve_moves(endpoint: str, *, hop: bool) -> None:
    """Answer move requests: decode, copy one block of one layer, reply (see the module doc)."""
    import os
    import queue
    import select
    import threading

    import msgspec
    import numpy as np

    from kvsidecar.wire.protocol import Moved, Request

    decoder = msgspec.msgpack.Decoder(Request)
    encoder = msgspec.msgpack.Encoder()
    src = np.ones((2, 64, 32 << 10), np.uint8)  # one layer, K and V, 64 blocks of 32 KiB
    dst = np.zeros_like(src)
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(endpoint)
    fd = int(sock.getsockopt(zmq.FD))
    wake = os.eventfd(0, os.EFD_NONBLOCK)
    lock = threading.Lock()  # the socket is shared by the two threads, as in the daemon

    def work(ident: bytes, rid: int, sids: np.ndarray, dids: np.ndarray) -> None:
        start = time.perf_counter()
        dst[:, dids] = src[:, sids]
        seconds = time.perf_counter() - start
        reply = Moved(id=rid, blocks=len(dids), nbytes=int(sids.size) << 16, seconds=seconds)
        with lock:
            sock.send_multipart([ident, encoder.encode(reply)])
            pending = bool(sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)  # type: ignore[operator]
        if pending:  # the send may have taken the fd's edge: wake the reader
            os.eventfd_write(wake, 1)

    todo: queue.SimpleQueue[tuple[bytes, int, np.ndarray, np.ndarray]] = queue.SimpleQueue()

    def copier() -> None:
        while True:
            work(*todo.get())

    if hop:
        threading.Thread(target=copier, daemon=True).start()
    print("ready", flush=True)
    while True:
        with lock:
            ready = bool(sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)  # type: ignore[operator]
            frames = sock.recv_multipart(copy=False) if ready else None
        if frames is None:
            if wake in select.select([fd, wake], [], [])[0]:
                os.eventfd_read(wake)
            continue
        ident, header, sframe, dframe = frames
        req = decoder.decode(header.buffer)
        sids = np.frombuffer(sframe.buffer, np.int64)
        dids = np.frombuffer(dframe.buffer, np.int64)
        if hop:
            todo.put((ident.bytes, req.id, sids, dids))
        else:
            work(ident.bytes, req.id, sids, dids)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    runtime = tempfile.mkdtemp(prefix="kvs-echo-")
    modes = ["blocking", "asyncio", "reader", "copy", "hop"]
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
        frames = _move_frames()
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
        echo = statistics.median(p50s["blocking"])
        for mode in modes:
            p50 = statistics.median(p50s[mode])
            print(f"{mode:9s} server: p50 {p50:.0f} µs, {p50 / echo:.2f}x the blocking echo")
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


def _move_frames() -> list[bytes]:
    """The frames of a real 1-block, 1-layer `Move` request (header, source and destination ids)."""
    import msgspec

    from kvsidecar.wire.protocol import Move
    from kvsidecar.wire.types import BufferSetRef, WorkerRef

    side = BufferSetRef(worker=WorkerRef(engine_id="bench"))
    move = Move(id=7, src=side, dst=BufferSetRef(worker=WorkerRef(engine_id="bench", tp_rank=1)),
                layers=["layer0"])  # fmt: skip
    ids = (3).to_bytes(8, "little")
    return [msgspec.msgpack.encode(move), ids, ids]


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
