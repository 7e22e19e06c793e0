"""A hostile local process: attacks a daemon from outside the project's client, with raw sockets.

Run as ``python -m tests.procs.attacker '<json spec>'`` (`tests.support.attack.Attacker`). It sets
up, prints ``ready``, attacks until stdin says ``exit`` (or closes) or ``seconds`` pass, then prints
one JSON line of counts and exits. ``spec["attack"]`` picks the attack:

- ``control_flood``: ``sockets`` DEALERs send ``kind`` requests (``status``, ``garbage``,
  ``move``, ``oversize`` or ``mix``) as fast as they can and never read a reply.
- ``many_connections``: ``count`` DEALER sockets, one connection each, send a status each and
  hold their connections open.
- ``slow_reader``: one DEALER sends ``status``/``collect`` requests at ``rate`` per second and
  never reads (a tiny receive queue).
- ``peer_flood``: a DEALER on the peer endpoint sends ``kind`` (``hello``, ``notify`` with fresh
  request ids, ``garbage`` or ``mix``) as fast as it can and never reads.
- ``fd_hoard``: opens up to ``connections`` fd-channel connections, sends ``messages`` messages
  of ``fds`` fds each on every one (never claimed), leaves ``half_open`` more with a partial
  header, then keeps connecting for ``reconnect_s`` seconds (``accept`` is exercised too).
- ``http_idle``: opens TCP connections to the metrics port at ``rate`` per second and sends
  nothing (``slowloris``: a request head one byte every half second).
- ``shrinker``: registers an unsealed memfd as a KV cache (raw fd channel message, raw
  ``Register``), shrinks the file to 0 bytes, and asks for moves out of it.
- ``endpoint_flood``: registers an engine of its own (raw), then keeps ``inflight`` raw ``Pull``
  requests outstanding, each naming the producer's peer endpoint (``peer_port``, engine
  ``remote_engine``) in another spelling: a source address before a ``;`` (libzmq connects from
  it), another address of the loopback net (``127.a.b.c``, which reaches a daemon bound to
  ``0.0.0.0``), host names in other cases, ports with leading zeros, and endpoints where nothing
  listens. Prints ``flooded`` once ``count`` pulls are sent and answered; counts the replies by
  outcome.
- ``nixl_read``: a hostile peer daemon: holding the cluster key (``key``), it greets the producer's
  peer endpoint asking for NIXL and no request at all, and, if the welcome carries NIXL metadata,
  READs the first layer of ``engine``'s first rank whole (published or not) with a NIXL agent of
  its own. The result has the bytes read (hex), or None.
- ``pin_and_store``: registers a sealed memfd as a KV cache, stores ``slots`` keys into a cache
  namespace of that size, pins every one of them (a lookup with a long pin), then stores
  ``keys`` new keys at a time, one store after another: none finds a slot to evict.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import socket
import struct
import sys
import threading
import time
from typing import Any

import msgspec
import numpy as np
import zmq

from kvsidecar.core import layout
from kvsidecar.peer.messages import (
    PEER_PROTOCOL_VERSION,
    Notify,
    PeerHello,
    PeerReply,
    PeerWelcome,
)
from kvsidecar.wire.cache import CacheLookup, CacheStore
from kvsidecar.wire.curve import load_keypair, secure_client_socket
from kvsidecar.wire.protocol import PROTOCOL_VERSION, Collect, Heartbeat, Move, Register, Status
from kvsidecar.wire.pulls import Pull, PullItem
from kvsidecar.wire.types import BufferDescriptor, BufferSetRef, LayerSpec, ShmRef, WorkerRef

ENC = msgspec.msgpack.Encoder()
FD_HEADER = struct.Struct("!4sBB")
"""The fd channel's framing, written here by hand: b"KVFD", token length, fd count, token."""


def send_fds(sock: socket.socket, token: bytes, fds: list[int]) -> None:
    """One fd-channel message, as a worker would send it (the fds ride with its first byte)."""
    frame = FD_HEADER.pack(b"KVFD", len(token), len(fds)) + token
    sent = socket.send_fds(sock, [frame], fds)
    sock.sendall(frame[sent:])


_STOP = threading.Event()
"""Set once stdin says ``exit`` or closes (read on a thread: a select on the pipe's fd would
not see a line already in Python's buffer)."""


def _watch_stdin() -> None:
    for line in sys.stdin:
        if line.strip() == "exit":
            break
    _STOP.set()


threading.Thread(target=_watch_stdin, daemon=True).start()


def _stop_requested() -> bool:
    return _STOP.is_set()


def _dealer(ctx: zmq.Context[Any], endpoint: str, *, sndhwm: int = 1000) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(endpoint)
    return sock


def _control_message(kind: str, i: int) -> list[bytes]:
    if kind == "mix":
        kind = "oversize" if i % 64 == 63 else ("status", "garbage", "move")[i % 3]
    if kind == "status":
        return [ENC.encode(Status(id=i + 1))]
    if kind == "garbage":
        return [b"\xc1\xff" + i.to_bytes(8, "little"), b"x" * (i % 64)]
    if kind == "oversize":
        return [b"\x80" * ((1 << 20) + 1)]  # over max_header_bytes (1 MiB): too_large
    ref = BufferSetRef(WorkerRef("victim"), "device")
    ids = np.arange(4, dtype=np.int64).tobytes()
    return [ENC.encode(Move(id=i + 1, src=ref, dst=ref)), ids, ids]


def control_flood(spec: dict[str, Any], ctx: zmq.Context[Any]) -> dict[str, Any]:
    socks = [_dealer(ctx, spec["endpoint"]) for _ in range(spec.get("sockets", 1))]
    kind = spec.get("kind", "status")
    print("ready", flush=True)
    sent, full, i = 0, 0, 0
    deadline = time.monotonic() + spec.get("seconds", 3600)
    while time.monotonic() < deadline:
        if i % 512 == 0 and _stop_requested():
            break
        sock = socks[i % len(socks)]
        try:
            sock.send_multipart(_control_message(kind, i), flags=zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            full += 1
            time.sleep(0.0002)
        i += 1
    return {"sent": sent, "queue_full": full}


def many_connections(spec: dict[str, Any], ctx: zmq.Context[Any]) -> dict[str, Any]:
    ctx.set(zmq.MAX_SOCKETS, spec["count"] + 16)
    socks = []
    for i in range(spec["count"]):  # one connection per socket (a second connect is a no-op)
        sock = _dealer(ctx, spec["endpoint"])
        sock.send(ENC.encode(Status(id=i + 1)), zmq.NOBLOCK)  # queued until connected
        socks.append(sock)
    time.sleep(1.0)
    print("ready", flush=True)
    deadline = time.monotonic() + spec.get("seconds", 3600)
    while time.monotonic() < deadline and not _stop_requested():
        time.sleep(0.05)
    answered = sum(1 for s in socks if s.poll(0))
    return {"sockets": len(socks), "answered": answered}


def slow_reader(spec: dict[str, Any], ctx: zmq.Context[Any]) -> dict[str, Any]:
    sock = _dealer(ctx, spec["endpoint"])
    print("ready", flush=True)
    sent, rate = 0, spec.get("rate", 200.0)
    deadline = time.monotonic() + spec.get("seconds", 3600)
    while time.monotonic() < deadline and not _stop_requested():
        req = Status(id=sent + 1) if sent % 2 else Collect(id=sent + 1, engine_id="x", step=0)
        try:
            sock.send(ENC.encode(req), zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            pass
        time.sleep(1.0 / rate)
    return {"sent": sent}


def _peer_message(kind: str, i: int, engine: str) -> bytes:
    if kind == "mix":
        kind = ("hello", "notify", "garbage")[i % 3]
    if kind == "hello":
        return ENC.encode(PeerHello(id=i, protocol_version=PEER_PROTOCOL_VERSION, daemon_id="x"))
    if kind == "notify":
        return ENC.encode(
            Notify(
                id=i,
                engine_id=engine,
                request_id=f"forged-{i}",
                tp_rank=0,
                pp_rank=0,
                reader=f"reader-{i}",
                expected_readers=2,
            )
        )
    return b"\xc1" * (16 + i % 64)


def peer_flood(spec: dict[str, Any], ctx: zmq.Context[Any]) -> dict[str, Any]:
    sock = _dealer(ctx, spec["endpoint"])
    kind, engine = spec.get("kind", "mix"), spec.get("engine", "e")
    print("ready", flush=True)
    sent, i = 0, 0
    deadline = time.monotonic() + spec.get("seconds", 3600)
    while time.monotonic() < deadline:
        if i % 512 == 0 and _stop_requested():
            break
        try:
            sock.send(_peer_message(kind, i, engine), zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            time.sleep(0.0002)
        i += 1
    return {"sent": sent}


def _connect_unix(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(0.2)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return sock


def _connect_patiently(path: str, within_s: float = 20.0) -> socket.socket:
    """Connect to the fd channel, again while a flood of others makes a connect time out."""
    deadline = time.monotonic() + within_s
    while True:
        sock = _connect_unix(path)
        if sock is not None:
            return sock
        if time.monotonic() > deadline:
            raise TimeoutError(f"could not connect to {path} in {within_s} s")
        time.sleep(0.05)


def _hung_up(sock: socket.socket) -> bool:
    """Whether the other end closed (after whatever it sent last, e.g. a 408)."""
    try:
        while sock.recv(65536, socket.MSG_DONTWAIT):
            pass
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True


def fd_hoard(spec: dict[str, Any], _ctx: zmq.Context[Any]) -> dict[str, Any]:
    memfd = os.memfd_create("hoard")
    os.ftruncate(memfd, 4096)
    fds = [memfd] * spec.get("fds", 200)
    conns: list[socket.socket] = []
    sent = failed = 0
    for _ in range(spec.get("connections", 1)):
        sock = _connect_unix(spec["path"])
        if sock is None:
            failed += 1
            continue
        conns.append(sock)
        for _ in range(spec.get("messages", 1)):
            try:
                send_fds(sock, os.urandom(16), fds)
                sent += 1
            except OSError:
                break
    for _ in range(spec.get("half_open", 0)):
        sock = _connect_unix(spec["path"])
        if sock is not None:
            sock.sendall(FD_HEADER.pack(b"KVFD", 16, 1)[:3])  # a header that never completes
            conns.append(sock)
    time.sleep(0.5)
    print("ready", flush=True)
    attempts = 0
    deadline = time.monotonic() + spec.get("seconds", 3600)
    reconnect_until = time.monotonic() + spec.get("reconnect_s", 0.0)
    while time.monotonic() < deadline and not _stop_requested():
        if time.monotonic() < reconnect_until:
            extra = _connect_unix(spec["path"])
            attempts += 1
            if extra is not None:
                conns.append(extra)
        time.sleep(0.01)
    kept = sum(1 for s in conns if not _hung_up(s))
    return {
        "connections": len(conns),
        "kept": kept,
        "sent": sent,
        "failed": failed,
        "attempts": attempts,
    }


def http_idle(spec: dict[str, Any], _ctx: zmq.Context[Any]) -> dict[str, Any]:
    conns: list[socket.socket] = []
    opened = closed_by_server = 0
    slow = spec.get("slowloris", False)
    print("ready", flush=True)
    deadline = time.monotonic() + spec.get("seconds", 3600)
    next_open, next_byte = time.monotonic(), time.monotonic()
    while time.monotonic() < deadline and not _stop_requested():
        now = time.monotonic()
        if now >= next_open and len(conns) < 4000:
            next_open += 1.0 / spec.get("rate", 25.0)
            try:
                sock = socket.create_connection(("127.0.0.1", spec["port"]), timeout=1)
                if slow:  # a request head that grows by a byte every half second, never ending
                    sock.send(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
                conns.append(sock)
                opened += 1
            except OSError:
                pass
        if slow and now >= next_byte:
            next_byte = now + 0.5
            for sock in conns:
                with contextlib.suppress(OSError):
                    sock.send(b"a", socket.MSG_DONTWAIT)
        time.sleep(0.005)
    for sock in conns:
        closed_by_server += _hung_up(sock)
        sock.close()
    return {"opened": opened, "closed_by_server": closed_by_server}


def _raw_register(
    sock: zmq.Socket[Any], engine: str, nbytes: int, token: bytes, *, host: bool = True
) -> Any:
    blocks = nbytes // 4096
    desc = BufferDescriptor("kv_first", "NHD", "float16", blocks, 16, 8, 8)  # 2 x 2 KiB a block
    handle = ShmRef(fd_index=0, storage_nbytes=nbytes, offset=0, nbytes=nbytes)
    reg = Register(
        id=1,
        protocol_version=PROTOCOL_VERSION,
        worker=WorkerRef(engine),
        layers=[LayerSpec("l0", desc, handle)],
        host_blocks=blocks if host else 0,
        fd_token=token,
    )
    sock.send(ENC.encode(reg))
    if not sock.poll(10_000):
        return "no reply"
    return msgspec.msgpack.decode(sock.recv())


def shrinker(spec: dict[str, Any], ctx: zmq.Context[Any]) -> dict[str, Any]:
    nbytes = 64 * 4096
    memfd = os.memfd_create("shrinker")  # no seals: the file can be shrunk under a mapping
    os.ftruncate(memfd, nbytes)
    with mmap.mmap(memfd, nbytes) as mem:
        mem[:] = b"\x01" * nbytes
    fd_sock = _connect_patiently(spec["fd_socket"])
    token = os.urandom(16)
    send_fds(fd_sock, token, [memfd])
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(spec["endpoint"])
    registered = _raw_register(sock, spec.get("engine", "shrinker"), nbytes, token)
    os.ftruncate(memfd, 0)  # pull the memory away under the daemon's mapping
    print("ready", flush=True)
    worker = WorkerRef(spec.get("engine", "shrinker"))
    ids = np.arange(16, dtype=np.int64).tobytes()
    replies: dict[str, int] = {}
    deadline = time.monotonic() + spec.get("seconds", 3600)
    i = 0
    while time.monotonic() < deadline and not _stop_requested():
        i += 1
        move = Move(id=i, src=BufferSetRef(worker, "device"), dst=BufferSetRef(worker, "host"))
        if i % 10 == 0:  # keep the lease: the attack lasts as long as the test wants
            sock.send(ENC.encode(Heartbeat(id=i, workers=[worker])))
        else:
            sock.send_multipart([ENC.encode(move), ids, ids])
        if sock.poll(5000):
            reply = msgspec.msgpack.decode(sock.recv())
            key = reply.get("code") or reply.get("type", "?")
            replies[key] = replies.get(key, 0) + 1
        else:
            replies["no reply"] = replies.get("no reply", 0) + 1
        time.sleep(0.05)
    fd_sock.close()
    return {"registered": registered, "replies": replies}


def _spelling(i: int, port: int) -> str:
    """The ``i``-th spelling of the endpoint ``tcp://127.0.0.1:port`` (or of none at all)."""
    match i % 6:
        case 0 | 1:  # a source port of its own: one connection each, to the same daemon
            return f"tcp://127.0.0.1:{20000 + i % 40000};127.0.0.1:{port}"
        case 2 | 3:  # the loopback net: the same daemon when it is bound to 0.0.0.0
            n = i // 6 + 2
            return f"tcp://127.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}:{port}"
        case 4:  # host names and ports spelled otherwise
            return ("tcp://LOCALHOST:{}", "tcp://localhost.:{}", "tcp://127.0.0.1:0{}")[
                i // 6 % 3
            ].format(port)
        case _:  # nothing listens there: each waits for its handshake's timeout
            return f"tcp://127.0.0.1:{1024 + (port + i) % 20000}"


_BEATS = 1 << 40
"""Request ids of the flooder's heartbeats start past it (its pulls count from 1)."""


def endpoint_flood(spec: dict[str, Any], ctx: zmq.Context[Any]) -> dict[str, Any]:
    nbytes = 64 * 4096
    memfd = os.memfd_create("flooder", os.MFD_ALLOW_SEALING)
    os.ftruncate(memfd, nbytes)
    fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    fd_sock = _connect_unix(spec["fd_socket"])
    assert fd_sock is not None
    token = os.urandom(16)
    send_fds(fd_sock, token, [memfd])
    engine = spec.get("engine", "flooder")
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(spec["endpoint"])
    registered = _raw_register(sock, engine, nbytes, token, host=False)
    print("ready", flush=True)
    worker = WorkerRef(engine)
    ids = np.array([0], dtype=np.int64).tobytes()
    outcomes: dict[str, int] = {}
    sent = pending = beat = answered = 0
    count = spec.get("count", 1 << 30)
    last_beat = time.monotonic()
    deadline = time.monotonic() + spec.get("seconds", 3600)
    while time.monotonic() < deadline and not _stop_requested():
        if time.monotonic() - last_beat > 0.5:  # keep the worker's lease
            last_beat = time.monotonic()
            beat += 1
            sock.send(ENC.encode(Heartbeat(id=_BEATS + beat, workers=[worker])))
            pending += 1
        while pending < spec.get("inflight", 32) and sent < count:
            pull = Pull(
                id=sent + 1,
                engine_id=engine,
                remote_endpoint=_spelling(sent, spec["peer_port"]),
                remote_engine_id=spec.get("remote_engine", engine),
                items=[PullItem(f"flood-{sent}", 1, 1)],
                tp_rank=0,
                timeout_s=spec.get("timeout_s", 5.0),
            )
            sock.send_multipart([ENC.encode(pull), ids, ids])
            sent += 1
            pending += 1
        if sock.poll(50):
            while sock.poll(0):
                reply = msgspec.msgpack.decode(sock.recv_multipart()[0])
                pending -= 1
                if reply.get("id", 0) > _BEATS:
                    continue  # a heartbeat's
                if reply.get("type") == "pulled":
                    key = "pulled:" + (reply.get("error_code") or "ok")
                else:
                    key = reply.get("code") or reply.get("type", "?")
                outcomes[key] = outcomes.get(key, 0) + 1
                answered += 1
                if answered == count:
                    print("flooded", flush=True)
    fd_sock.close()
    return {"registered": registered, "sent": sent, "outcomes": outcomes}


def nixl_read(spec: dict[str, Any], ctx: zmq.Context[Any]) -> dict[str, Any]:
    keys = load_keypair(spec["key"])
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_client_socket(sock, server_public=keys.public, keys=keys)
    sock.connect(spec["peer_endpoint"])
    hello = PeerHello(id=1, protocol_version=PEER_PROTOCOL_VERSION, daemon_id="hostile")
    sock.send(ENC.encode(PeerHello(**{**msgspec.structs.asdict(hello), "want_nixl": True})))
    assert sock.poll(10_000), "no welcome"
    welcome = msgspec.msgpack.decode(sock.recv_multipart()[0], type=PeerReply)
    assert isinstance(welcome, PeerWelcome), welcome
    result: dict[str, Any] = {
        "planes": welcome.planes,
        "metadata_bytes": len(welcome.nixl_metadata),
        "read": None,
    }
    engine = next(e for e in welcome.engines if e.engine_id == spec["engine"])
    worker = engine.workers[0]
    if welcome.nixl_metadata and worker.layer_addrs:
        result["read"] = _nixl_read_layer(welcome, worker.layer_addrs[0], worker.descriptors[0])
    print("ready", flush=True)
    while not _stop_requested():
        time.sleep(0.05)
    return result


def _nixl_read_layer(welcome: PeerWelcome, addr: int, desc: BufferDescriptor) -> str | None:
    import logging

    import nixl._api  # noqa: F401 - installs NIXL's stdout log handler, removed next
    import torch

    from kvsidecar.peer.nixl_plane import NixlPlane

    logging.getLogger("nixl").handlers.clear()  # stdout carries this process's line protocol
    nbytes = layout.buffer_nbytes(desc)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    theirs = np.array([[addr, nbytes, 0]], dtype=np.uint64)
    for attempt in range(5):  # UCX's wire-up fails now and then: a fresh agent tries again
        try:
            # An agent as a daemon makes it (a hostile daemon is a modified kvsidecar).
            agent = NixlPlane(f"hostile-{attempt}")._agent
            agent.register_memory(dst)
            remote = agent.add_remote_agent(welcome.nixl_metadata)
            handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(np.array([[dst.data_ptr(), nbytes, 0]], np.uint64), "DRAM"),
                agent.get_xfer_descs(theirs, "DRAM"),
                remote,
            )
            state = agent.transfer(handle)
            deadline = time.monotonic() + 10
            while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                time.sleep(0.001)  # as a daemon polls: the agent's progress thread needs its lock
                state = agent.check_xfer_state(handle)
            if state == "DONE":
                return bytes(dst.numpy()).hex()
        except Exception as exc:  # nixl raises its own error types
            print(f"nixl read failed: {exc!r}", file=sys.stderr, flush=True)
        time.sleep(0.5)
    return None


def _call(sock: zmq.Socket[Any], frames: list[bytes], timeout_s: float = 30.0) -> dict[str, Any]:
    """Send one request and return its reply (matched by id; earlier late ones are skipped)."""
    rid = msgspec.msgpack.decode(frames[0])["id"]
    sock.send_multipart(frames)
    deadline = time.monotonic() + timeout_s
    while sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
        out: dict[str, Any] = msgspec.msgpack.decode(sock.recv_multipart()[0])
        if out.get("id") == rid:
            return out
    return {"type": "no reply"}


def pin_and_store(spec: dict[str, Any], ctx: zmq.Context[Any]) -> dict[str, Any]:
    nbytes = 64 * 4096  # 64 blocks of 4 KiB (`_raw_register`)
    memfd = os.memfd_create("pinner", os.MFD_ALLOW_SEALING)
    os.ftruncate(memfd, nbytes)
    fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    fd_sock = _connect_patiently(spec["fd_socket"])
    token = os.urandom(16)
    send_fds(fd_sock, token, [memfd])
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(spec["endpoint"])
    engine = spec.get("engine", "pinner")
    registered = _raw_register(sock, engine, nbytes, token)
    worker = WorkerRef(engine)
    slots, per_store = spec["slots"], spec["keys"]

    def keys(first: int, n: int) -> bytes:
        return b"".join((first + i).to_bytes(8, "little") * 4 for i in range(n))

    def store(first: int, n: int, rid: int, capacity: int = 0) -> dict[str, Any]:
        msg = CacheStore(
            id=rid,
            source=BufferSetRef(worker, "device"),
            fingerprint="pinner",
            capacity_bytes=capacity,
        )
        ids = (np.arange(n, dtype=np.int64) % 64).tobytes()
        return _call(sock, [ENC.encode(msg), keys(first, n), ids])

    filled = store(0, slots, 1, capacity=slots * 4096 + 4096)
    lookup = CacheLookup(id=2, fingerprint="pinner", pin_s=3600.0)
    pinned = _call(sock, [ENC.encode(lookup), keys(0, slots)])
    print("ready", flush=True)
    replies: dict[str, int] = {}
    dropped = stores = 0
    worst_s = 0.0
    last_beat = time.monotonic()
    deadline = last_beat + spec.get("seconds", 3600)
    i = 2
    while time.monotonic() < deadline and not _stop_requested():
        i += 1
        if time.monotonic() - last_beat > 1.0:  # keep the lease, and with it the pins' worker
            last_beat = time.monotonic()
            _call(sock, [ENC.encode(Heartbeat(id=i, workers=[worker]))])
            continue
        t0 = time.monotonic()
        out = store(slots + i * per_store, per_store, i)
        worst_s = max(worst_s, time.monotonic() - t0)
        key = out.get("code") or out.get("type", "?")
        replies[key] = replies.get(key, 0) + 1
        stores += 1
        dropped += int(out.get("dropped", 0))
    fd_sock.close()
    os.close(memfd)
    return {
        "registered": registered.get("type") if isinstance(registered, dict) else registered,
        "filled": {k: filled.get(k) for k in ("type", "code", "stored", "dropped")},
        "pinned": {k: pinned.get(k) for k in ("type", "code", "hits", "pin_id")},
        "stores": stores,
        "keys_dropped": dropped,
        "slowest_store_s": round(worst_s, 3),
        "replies": replies,
    }


ATTACKS = {
    "control_flood": control_flood,
    "many_connections": many_connections,
    "slow_reader": slow_reader,
    "peer_flood": peer_flood,
    "fd_hoard": fd_hoard,
    "http_idle": http_idle,
    "shrinker": shrinker,
    "endpoint_flood": endpoint_flood,
    "nixl_read": nixl_read,
    "pin_and_store": pin_and_store,
}


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        result = ATTACKS[spec["attack"]](spec, ctx)
    finally:
        ctx.destroy(linger=0)
    print(json.dumps({"result": result}, default=str), flush=True)
    if spec["attack"] == "nixl_read":  # NIXL's bundled libraries crash at exit (process_exit)
        os._exit(0)


if __name__ == "__main__":
    main()
