"""What a call puts on the socket and takes off it, for both clients.

Block ids as id frames, the msgpack codec of requests and replies, and the check of a reply
against the type its command expects.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt
import torch
import zmq

from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.framing import IdArray, encode_ids
from kvsidecar.wire.protocol import Error, Reply
from kvsidecar.wire.types import IdsDtype

Ids = Sequence[int] | npt.NDArray[np.integer[Any]] | torch.Tensor
"""Block ids as an engine has them: a list, a numpy array, or a CPU integer tensor."""

R = TypeVar("R", bound=Reply)
T = TypeVar("T")


def _as_id_array(ids: Ids) -> IdArray:
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.dtype == np.int32:
        return encode_ids(arr, "int32")
    return encode_ids(arr, "int64")


def _dtype_of(arr: IdArray) -> IdsDtype:
    return "int32" if arr.dtype.itemsize == 4 else "int64"


class _Codec:
    """Encoding of requests and decoding of replies, shared by both clients."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(Reply)
        self.ids = itertools.count(1)

    def next_id(self) -> int:
        return next(self.ids)

    def decode(self, frames: Sequence[bytes | zmq.Frame]) -> tuple[Reply, list[memoryview]]:
        if not frames:
            raise SidecarError("bad_frame", "empty reply")
        head = frames[0]
        raw = head.buffer if isinstance(head, zmq.Frame) else head
        try:
            reply = self.decoder.decode(raw)
        except msgspec.DecodeError as exc:
            raise SidecarError("bad_frame", f"unreadable reply: {exc}") from None
        data = [f.buffer if isinstance(f, zmq.Frame) else memoryview(f) for f in frames[1:]]
        return reply, data


def _check(reply: Reply, expected: type[R]) -> R:
    if isinstance(reply, Error):
        raise SidecarError(reply.code, reply.message, request_id=reply.id)
    if not isinstance(reply, expected):
        raise SidecarError(
            "internal", f"expected {expected.__name__}, the daemon sent {type(reply).__name__}"
        )
    return reply
