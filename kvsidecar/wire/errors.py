"""The one exception type that carries a wire error code, on both sides of the socket."""

from __future__ import annotations

from kvsidecar.wire.protocol import ErrorCode


class SidecarError(Exception):
    """A command failed with a typed ``code`` (one of `kvsidecar.wire.protocol.ErrorCode`).

    The daemon raises it while validating a command and turns it into an ``Error`` reply; the
    client raises it when such a reply arrives (or on a local timeout, code ``timeout``).
    """

    def __init__(self, code: ErrorCode, message: str, *, request_id: int = 0) -> None:
        super().__init__(f"{code}: {message}")
        self.code: ErrorCode = code
        self.message = message
        self.request_id = request_id
