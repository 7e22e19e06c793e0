"""Raw block-id frames: how id arrays travel next to a msgpack header, without a copy.

An id frame is a C-ordered little-endian int32 or int64 array; the header names the dtype. The
receiver wraps the frame's buffer with `numpy.frombuffer` (no copy); the sender hands ZeroMQ the
array's own buffer (``copy=False``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.types import IdsDtype

_DTYPES: dict[str, np.dtype[np.signedinteger]] = {
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
}

IdArray = npt.NDArray[np.signedinteger]
"""A 1-D array of block ids as it came off (or goes onto) the wire."""


def decode_ids(frame: memoryview | bytes, dtype: IdsDtype, *, max_ids: int, what: str) -> IdArray:
    """View a raw frame as a read-only id array, checking its size before anything else.

    Raises `SidecarError` ``bad_frame`` when the frame is not a whole number of elements and
    ``too_large`` when it holds more than ``max_ids`` ids.
    """
    np_dtype = _DTYPES.get(dtype)
    if np_dtype is None:  # the Literal is checked by msgspec; this guards direct callers
        raise SidecarError("invalid_message", f"unknown ids dtype {dtype!r}")
    nbytes = len(frame) if isinstance(frame, bytes) else frame.nbytes
    if nbytes % np_dtype.itemsize:
        raise SidecarError(
            "bad_frame", f"{what} frame of {nbytes} bytes is not a whole number of {dtype}"
        )
    count = nbytes // np_dtype.itemsize
    if count > max_ids:
        raise SidecarError("too_large", f"{what}: {count} ids, more than the limit {max_ids}")
    return np.frombuffer(frame, dtype=np_dtype)


def encode_ids(ids: Sequence[int] | npt.ArrayLike, dtype: IdsDtype = "int64") -> IdArray:
    """Return ``ids`` as a contiguous little-endian array ready to send with ``copy=False``."""
    arr = np.ascontiguousarray(ids, dtype=_DTYPES[dtype])
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    return arr


def ids_dtype_for(ids: IdArray) -> IdsDtype:
    """Return the narrowest wire dtype the caller's array already has (int32 stays int32)."""
    return "int32" if ids.dtype.itemsize == 4 else "int64"
