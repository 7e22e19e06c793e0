"""The one interface every mapped buffer offers, whatever memory it lives in.

The daemon's copy engine only ever sees a `MappedBuffer`: a flat byte view of a registered tensor.
Where the bytes come from (a worker's CPU shared memory, a worker's GPU memory through CUDA IPC, the
daemon's own host pool) is decided once, at registration, by the handle's kind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol, runtime_checkable

import torch

BufferKind = Literal["shm", "cuda_ipc", "cuda_vmm", "host_pool"]
"""Where the bytes of a `MappedBuffer` live."""

HandleErrorCode = Literal[
    "not_shared",
    "wrong_device",
    "bad_handle",
    "bad_fd",
    "cuda_unavailable",
    "pool_exhausted",
    "not_allocated",
    "bad_request",
    "closed",
    "protocol",
    "device_not_visible",
    "not_shareable",
    "cuda_error",
    "busy",
]
"""Typed reasons a handle could not be made, opened, or a pool request could not be served."""


class HandleError(ValueError):
    """A buffer handle or pool request was refused; ``code`` says why, the message says where.

    It is a `ValueError` because every case is bad input (from the wire or from the caller): the
    daemon turns it into a typed error reply and keeps serving everyone else.
    """

    def __init__(self, code: HandleErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code: HandleErrorCode = code


@runtime_checkable
class MappedBuffer(Protocol):
    """A registered tensor's bytes, mapped into this process.

    ``flat`` is a 1-D ``uint8`` tensor of exactly ``nbytes`` that aliases the registered memory:
    writes through it are seen by the owner of the memory, and the other way round. It stays valid
    until `close`; after that it must not be used (the mapping may be gone).
    """

    @property
    def flat(self) -> torch.Tensor:
        """1-D ``uint8`` view of exactly `nbytes` bytes of the registered memory."""
        ...

    @property
    def nbytes(self) -> int:
        """Length of `flat` in bytes."""
        ...

    @property
    def kind(self) -> BufferKind:
        """Where the bytes live: ``"shm"``, ``"cuda_ipc"``, ``"cuda_vmm"`` or ``"host_pool"``."""
        ...

    @property
    def closed(self) -> bool:
        """True once `close` was called."""
        ...

    def close(self) -> None:
        """Release this buffer's hold on the mapping; calling it again does nothing."""
        ...


class TensorBuffer:
    """A `MappedBuffer` over a tensor this process already holds.

    The mapping itself belongs to the tensor's storage: it is unmapped when the last tensor that
    views it is freed. `close` drops this buffer's reference (and runs ``on_close`` once), so the
    mapping goes as soon as no copy still holds a view of `flat`.
    """

    __slots__ = ("_flat", "_kind", "_nbytes", "_on_close")

    def __init__(
        self,
        flat: torch.Tensor,
        kind: BufferKind,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        if flat.dtype != torch.uint8 or flat.dim() != 1 or not flat.is_contiguous():
            raise HandleError("bad_handle", "a buffer view must be a contiguous 1-D uint8 tensor")
        self._flat: torch.Tensor | None = flat
        self._nbytes = flat.numel()
        self._kind: BufferKind = kind
        self._on_close = on_close

    @property
    def flat(self) -> torch.Tensor:
        """1-D ``uint8`` view of exactly `nbytes` bytes; raises `HandleError` once closed."""
        if self._flat is None:
            raise HandleError("closed", f"{self._kind} buffer of {self._nbytes} bytes is closed")
        return self._flat

    @property
    def nbytes(self) -> int:
        """Length of `flat` in bytes."""
        return self._nbytes

    @property
    def kind(self) -> BufferKind:
        """Where the bytes live."""
        return self._kind

    @property
    def closed(self) -> bool:
        """True once `close` was called."""
        return self._flat is None

    def close(self) -> None:
        """Drop the reference to the mapping; idempotent."""
        if self._flat is None:
            return
        self._flat = None
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    def __repr__(self) -> str:
        state = "closed" if self._flat is None else "open"
        return f"<TensorBuffer {self._kind} {self._nbytes} bytes {state}>"
