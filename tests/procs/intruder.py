"""A hostile local user: a process of another uid that attacks the daemon with raw requests.

Run as root: ``python -m tests.procs.intruder '<json spec>'`` with ``{"uid", "endpoint",
"fd_socket"}``. It imports everything first, drops to ``uid``, makes its own memory (a sealed
memfd filled with 0x11, the shape of `tests.support.raw.kv_descriptor`) and then obeys JSON
command lines on stdin, answering one JSON line each:

- ``{"op": "register", "engine", "tp_rank", "tp_size", "host_blocks"}``: register its memory;
- ``{"op": "send", "header": hex, "frames": [hex...], "routing_id": hex|null}``: one raw
  request (on a fresh socket when ``routing_id`` is given), answered with the reply's
  ``type``, ``code`` and ``message``;
- ``{"op": "publish_many", "engine", "count", "blocks"}``: publish ``count`` requests of its
  engine (``many-0``, ``many-1``, ...), each naming ``blocks``, pipelined; answered with how
  many replies of each type or error code came;
- ``{"op": "wipe"}``: fill its memory with 0x11 again;
- ``{"op": "peek", "offset", "nbytes"}``: the bytes of its own memory there (hex), to see
  whether something of another engine's landed in it;
- ``exit``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import msgspec

from kvsidecar.wire.pulls import Publish
from tests.support.raw import Raw, ids, kv_descriptor, register_fd, sealed_memfd


def _reply(raw: Raw, header: bytes, frames: list[bytes]) -> dict[str, Any]:
    rid = msgspec.msgpack.decode(header)["id"]
    raw.sock.send_multipart([header, *frames])
    while raw.sock.poll(15_000):
        reply = msgspec.msgpack.decode(raw.sock.recv_multipart()[0])
        if reply.get("id") == rid:
            return {"type": reply["type"], "code": reply.get("code", ""), "reply": reply}
    return {"type": "no_reply", "code": "", "reply": {}}


def _publish_many(raw: Raw, engine: str, count: int, blocks: list[int]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    frame = ids(*blocks)
    for start in range(0, count, 500):  # batches the reply queue holds whole
        batch = range(start, min(count, start + 500))
        for i in batch:
            raw.send(Publish(id=10_000_000 + i, engine_id=engine, request_id=f"many-{i}"), frame)
        for _ in batch:
            if not raw.sock.poll(15_000):
                counts["no_reply"] = counts.get("no_reply", 0) + 1
                continue
            reply = msgspec.msgpack.decode(raw.sock.recv_multipart()[0])
            what = reply.get("code") or reply["type"]
            counts[what] = counts.get(what, 0) + 1
    return {"type": "counts", "counts": counts}


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.setgroups([])
    os.setgid(spec["uid"])
    os.setuid(spec["uid"])
    _, nbytes = kv_descriptor()
    memory = sealed_memfd(nbytes, fill=0x11)
    raw = Raw(spec["endpoint"])
    channels = []
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() in ("", "exit"):
            break
        cmd = json.loads(line)
        out: dict[str, Any]
        if cmd["op"] == "register":
            reply, conn = register_fd(
                raw,
                spec["fd_socket"],
                cmd["engine"],
                memory,
                tp_rank=cmd.get("tp_rank", 0),
                tp_size=cmd.get("tp_size", 1),
                host_blocks=cmd.get("host_blocks", 0),
            )
            channels.append(conn)  # open for the worker's life: its closing releases it
            out = {
                "type": type(reply).__struct_config__.tag,
                "code": getattr(reply, "code", ""),
                "message": getattr(reply, "message", ""),
            }
        elif cmd["op"] == "send":
            frames = [bytes.fromhex(f) for f in cmd.get("frames", [])]
            header = bytes.fromhex(cmd["header"])
            if cmd.get("routing_id"):
                with Raw(spec["endpoint"], routing_id=bytes.fromhex(cmd["routing_id"])) as other:
                    out = _reply(other, header, frames)
            else:
                out = _reply(raw, header, frames)
        elif cmd["op"] == "publish_many":
            out = _publish_many(raw, cmd["engine"], cmd["count"], cmd["blocks"])
        elif cmd["op"] == "wipe":
            os.pwrite(memory, bytes([0x11]) * nbytes, 0)
            out = {"type": "ok"}
        elif cmd["op"] == "peek":
            out = {"hex": os.pread(memory, cmd["nbytes"], cmd["offset"]).hex()}
        else:
            out = {"type": "bad_command"}
        print(json.dumps(out, default=str), flush=True)
    for conn in channels:
        conn.close()
    raw.close()


if __name__ == "__main__":
    main()
