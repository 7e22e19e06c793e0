"""What both ends of a socket share: the daemon and the client import these, nothing above them.

- `protocol`: every wire message as a msgspec ``Struct`` in tagged unions, ``PROTOCOL_VERSION``,
  the closed set of error codes.
- `errors`: `SidecarError`, the exception that carries a wire error code.
- `framing`: raw block-id frames beside the msgpack header.
- `zmqio`: non-blocking multipart send and receive on plain pyzmq sockets.
- `curve`: CurveZMQ key files and client-socket settings.
- `endpoints`: where a daemon of this user listens by default.

May import msgspec, pyzmq and numpy; never pickle.
"""
