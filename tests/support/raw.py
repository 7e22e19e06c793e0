"""A hostile client's tools: raw ZeroMQ requests and raw SCM_RIGHTS messages, no project client.

The attack tests talk to a real daemon the way any local process could: a plain pyzmq DEALER
carrying msgpack headers and raw frames, and a plain Unix socket carrying fds with
`socket.send_fds`, framed by hand (``b"KVFD" | token length | fd count | token``). Only the wire
structs are borrowed from the package, to spell the messages; nothing else of it runs here.
Importable by a child that dropped to another uid (nothing here touches files).
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from kvsidecar.wire.protocol import PROTOCOL_VERSION, Register, Reply
from kvsidecar.wire.types import BufferDescriptor, LayerSpec, ShmRef, WorkerRef

ENCODE = msgspec.msgpack.Encoder()
DECODE = msgspec.msgpack.Decoder(Reply)


def ids(*values: int) -> bytes:
    """A raw little-endian int64 id frame."""
    return np.array(values, dtype="<i8").tobytes()


class Raw:
    """One plain DEALER on the control socket; `call` sends a request and waits for its reply."""

    def __init__(
        self, endpoint: str, *, routing_id: bytes | None = None, slow_reader: bool = False
    ) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        if slow_reader:
            # libzmq's own thread would read replies off the wire into this socket's queue;
            # with room for one, unread replies stay with the sender, as with a stalled client.
            self.sock.setsockopt(zmq.RCVHWM, 1)
            self.sock.setsockopt(zmq.RCVBUF, 4096)
        self.sock.connect(endpoint)
        self._next = 1

    def send(self, msg: Any, *frames: bytes) -> None:
        """Send without waiting for the reply."""
        self.sock.send_multipart([ENCODE.encode(msg), *frames])

    def call(self, msg: Any, *frames: bytes, timeout: float = 10.0) -> Reply:
        """Send and return the reply whose id matches (replies of earlier sends are skipped)."""
        self.send(msg, *frames)
        deadline = timeout * 1000
        while self.sock.poll(deadline):
            reply = DECODE.decode(self.sock.recv_multipart()[0])
            if reply.id == msg.id:
                return reply
        raise TimeoutError(f"no reply to {type(msg).__name__} in {timeout} s")

    def next_id(self) -> int:
        """A fresh request id."""
        self._next += 1
        return self._next

    def close(self) -> None:
        """Close the socket and its context."""
        self.sock.close(0)
        self.ctx.term()

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fd_message(token: bytes, nfds: int) -> bytes:
    """The fd channel's frame, spelled out by hand."""
    return struct.pack("!4sBB", b"KVFD", len(token), nfds) + token


def send_fds_raw(path: str, token: bytes, fds: Sequence[int]) -> socket.socket:
    """Connect to the fd channel and send ``fds`` under ``token``; the connection stays open."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    socket.send_fds(s, [fd_message(token, len(fds))], list(fds))
    return s


def kv_descriptor(blocks: int = 16, block_size: int = 4, heads: int = 2, head_size: int = 8) -> Any:
    """A kv_first NHD float16 descriptor and its size in bytes."""
    desc = BufferDescriptor("kv_first", "NHD", "float16", blocks, block_size, heads, head_size)
    return desc, 2 * blocks * block_size * heads * head_size * 2


def register_msg(
    rid: int,
    engine: str,
    token: bytes,
    nbytes: int,
    desc: Any,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    host_blocks: int = 0,
    layer: str = "l0",
) -> Register:
    """A one-layer registration over one fd (index 0) of ``nbytes``."""
    return Register(
        id=rid,
        protocol_version=PROTOCOL_VERSION,
        worker=WorkerRef(engine, tp_rank),
        tp_size=tp_size,
        layers=[LayerSpec(layer, desc, ShmRef(0, nbytes, 0, nbytes))],
        host_blocks=host_blocks,
        fd_token=token,
    )


def register_fd(
    raw: Raw,
    fd_path: str,
    engine: str,
    fd: int,
    *,
    host_blocks: int = 0,
    tp_rank: int = 0,
    tp_size: int = 1,
    blocks: int = 16,
    block_size: int = 4,
) -> tuple[Reply, socket.socket]:
    """Register one worker over ``fd`` (its size fits `kv_descriptor`); the fd connection too."""
    desc, nbytes = kv_descriptor(blocks, block_size)
    token = os.urandom(16)
    conn = send_fds_raw(fd_path, token, [fd])
    msg = register_msg(
        raw.next_id(),
        engine,
        token,
        nbytes,
        desc,
        host_blocks=host_blocks,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
    return raw.call(msg), conn


def sealed_memfd(nbytes: int, fill: int = 0) -> int:
    """A memfd the way an honest worker makes one: sized, filled, sealed against shrinking."""
    fd = os.memfd_create("honest", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    os.pwrite(fd, bytes([fill]) * nbytes, 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


async def raw_call(endpoint: str, frames: list[bytes]) -> Reply:
    """Send ``frames`` on a fresh asyncio DEALER and decode the one reply (5 s at most)."""
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        await sock.send_multipart(frames)
        assert await sock.poll(5000), "no reply"
        reply_frames = await sock.recv_multipart()
    finally:
        sock.close()
    return msgspec.msgpack.decode(reply_frames[0], type=Reply)
