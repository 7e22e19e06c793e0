"""A user that forks: one uid, many processes, each taking everything one process may take.

Run as root: ``python -m tests.procs.forker '<json spec>'`` with ``{"uid", "endpoint",
"fd_socket", "children"}``. It imports everything first, drops to ``uid``, forks ``children``
processes and then obeys JSON command lines on stdin, which every child carries out at once;
the answer is one JSON line with the children's answers summed (and ``each``, per child):

- ``{"op": "connect", "zmq": n, "fd": m}``: open ``n`` more DEALER connections to the control
  socket and ``m`` more connections to the fd channel; then ``served``: how many of all its
  DEALERs answer a ``hello`` within 3 s, ``fd_open``: how many of its fd connections the daemon
  has not closed;
- ``{"op": "count"}``: the same two counts, nothing new opened;
- ``{"op": "flood", "depth": d, "blocks": b}``: register an engine of ``b`` blocks of 256 KiB
  over a sealed memfd and keep ``d`` moves of half of them in flight until ``stop``; answered
  ``started`` once every child registered (``registered``: how many did);
- ``{"op": "stop"}``: end the flood; ``moved``, ``busy``, ``other``: its replies;
- ``{"op": "unread", "count": n, "size": b}``: on a DEALER of its own that never reads (a receive
  queue of one message), send ``n`` moves naming an engine id of ``b`` characters, each answered
  with an error that long; answered ``sent``;
- ``exit``.

Nothing of the project's client runs here: raw pyzmq and raw SCM_RIGHTS (`tests.support.raw`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from typing import Any

import msgspec
import zmq

from kvsidecar.wire.protocol import PROTOCOL_VERSION, Hello, Move, Registered
from kvsidecar.wire.types import BufferSetRef, WorkerRef
from tests.support.raw import ENCODE, Raw, ids, kv_descriptor, register_fd, sealed_memfd

BLOCK_SIZE = 4096
"""Tokens per block of a flood's engine: 256 KiB blocks, so that copies, not the loop, are slow."""


class Child:
    """What one forked process holds, and its answers to the commands."""

    def __init__(self, spec: dict[str, Any], index: int) -> None:
        self.spec = spec
        self.index = index
        self.ctx = zmq.Context()
        self.dealers: list[zmq.Socket[bytes]] = []
        self.fds: list[socket.socket] = []
        self.silent: list[zmq.Socket[bytes]] = []
        self.flood: Flood | None = None

    def connect(self, zmq_n: int, fd_n: int) -> dict[str, Any]:
        for _ in range(zmq_n):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.spec["endpoint"])
            self.dealers.append(sock)
        for _ in range(fd_n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.settimeout(2)
                s.connect(self.spec["fd_socket"])
            except OSError:
                s.close()
                continue
            self.fds.append(s)
        return self.count()

    def count(self) -> dict[str, Any]:
        hello = ENCODE.encode(Hello(id=1, protocol_version=PROTOCOL_VERSION))
        waiting = set()
        for i, sock in enumerate(self.dealers):
            with contextlib.suppress(zmq.Again):  # no connection at all: refused
                sock.send(hello, zmq.NOBLOCK)
                waiting.add(i)
        served = 0
        deadline = time.monotonic() + 3.0
        while waiting and time.monotonic() < deadline:
            poller = zmq.Poller()
            for i in waiting:
                poller.register(self.dealers[i], zmq.POLLIN)
            for sock, _ in poller.poll(100):
                while sock.poll(0):
                    sock.recv_multipart()
                i = self.dealers.index(sock)  # type: ignore[arg-type]
                if i in waiting:
                    waiting.discard(i)
                    served += 1
        time.sleep(0.5)  # a refused fd connection is closed right after its accept
        fd_open = 0
        for s in self.fds:
            s.setblocking(False)
            try:
                fd_open += s.recv(1) != b""
            except BlockingIOError:
                fd_open += 1  # nothing to read and not closed: open
            except OSError:
                pass
        return {"served": served, "fd_open": fd_open}

    def unread(self, count: int, size: int) -> dict[str, Any]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 4096)
        sock.connect(self.spec["endpoint"])
        self.silent.append(sock)  # kept open, never read, until exit
        ref = BufferSetRef(WorkerRef("x" * size))
        frames = [ENCODE.encode(Move(id=9, src=ref, dst=ref)), ids(1), ids(2)]
        sent = 0
        for _ in range(count):
            with contextlib.suppress(zmq.Again):
                sock.send_multipart(frames, zmq.NOBLOCK)
                sent += 1
        return {"sent": sent}

    def start_flood(self, depth: int, blocks: int) -> dict[str, Any]:
        self.flood = Flood(self.spec, f"forked-{self.index}", depth, blocks)
        return {"registered": int(self.flood.registered)}

    def stop_flood(self) -> dict[str, Any]:
        if self.flood is None:
            return {}
        return self.flood.stop()


class Flood:
    """One engine keeping ``depth`` moves in flight, from a thread of its own."""

    def __init__(self, spec: dict[str, Any], engine: str, depth: int, blocks: int) -> None:
        _, nbytes = kv_descriptor(blocks, BLOCK_SIZE)
        self.memory = sealed_memfd(nbytes, fill=0x22)
        self.raw = Raw(spec["endpoint"])
        reply, self.conn = register_fd(
            self.raw, spec["fd_socket"], engine, self.memory, blocks=blocks, block_size=BLOCK_SIZE
        )
        self.registered = isinstance(reply, Registered)
        self.counts = {"moved": 0, "busy": 0, "other": 0}
        ref = BufferSetRef(WorkerRef(engine))
        half = blocks // 2
        self.frames = [
            ENCODE.encode(Move(id=7, src=ref, dst=ref)),
            ids(*range(half)),
            ids(*range(half, 2 * half)),
        ]
        self.depth = depth
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        if self.registered:
            self.thread.start()

    def _run(self) -> None:
        sock = self.raw.sock
        for _ in range(self.depth):
            sock.send_multipart(self.frames)
        while not self.done.is_set():
            if not sock.poll(100):
                continue
            reply = msgspec.msgpack.decode(sock.recv_multipart()[0])
            kind = reply.get("type")
            key = "moved" if kind == "moved" else "busy" if reply.get("code") == "busy" else "other"
            self.counts[key] += 1
            sock.send_multipart(self.frames)  # in flight again

    def stop(self) -> dict[str, Any]:
        self.done.set()
        if self.thread.is_alive():
            self.thread.join(10)
        self.conn.close()
        self.raw.close()
        os.close(self.memory)
        return dict(self.counts)


def _child(spec: dict[str, Any], index: int, commands: int, answers: int) -> None:
    child = Child(spec, index)
    with os.fdopen(commands, "r") as cin, os.fdopen(answers, "w") as cout:
        for line in cin:
            cmd = json.loads(line)
            if cmd["op"] == "connect":
                out = child.connect(cmd.get("zmq", 0), cmd.get("fd", 0))
            elif cmd["op"] == "count":
                out = child.count()
            elif cmd["op"] == "flood":
                out = child.start_flood(cmd["depth"], cmd["blocks"])
            elif cmd["op"] == "stop":
                out = child.stop_flood()
            elif cmd["op"] == "unread":
                out = child.unread(cmd["count"], cmd["size"])
            else:
                break
            cout.write(json.dumps(out) + "\n")
            cout.flush()
    for sock in child.dealers + child.silent:
        sock.close(0)
    for s in child.fds:
        s.close()
    child.ctx.term()
    os._exit(0)


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.setgroups([])
    os.setgid(spec["uid"])
    os.setuid(spec["uid"])
    pipes = []
    pids = []
    for index in range(spec["children"]):
        cmd_r, cmd_w = os.pipe()
        ans_r, ans_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(cmd_w)
            os.close(ans_r)
            _child(spec, index, cmd_r, ans_w)
        os.close(cmd_r)
        os.close(ans_w)
        pids.append(pid)
        pipes.append((os.fdopen(cmd_w, "w"), os.fdopen(ans_r, "r")))
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() in ("", "exit"):
            break
        for cin, _ in pipes:
            cin.write(line.strip() + "\n")
            cin.flush()
        each = [json.loads(cout.readline() or "{}") for _, cout in pipes]
        total: dict[str, Any] = {}
        for out in each:
            for key, value in out.items():
                total[key] = total.get(key, 0) + value
        print(json.dumps({**total, "each": each}), flush=True)
    for cin, _ in pipes:
        cin.close()
    for pid in pids:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
