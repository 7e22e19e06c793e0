"""Ordering the daemon's copies against the engine's own GPU work, with interprocess CUDA events.

The IPC event that torch sends with a handle is recorded once, at export: it says nothing about
the kernels that write a block later. So each move that touches a worker's GPU memory carries
its own pair of events (`kvsidecar.wire.types.MoveEvents`):

- ``ready``: the client records it on the caller's current stream as it sends the move
  (`MoveSync.before`); the daemon's copy streams wait for it before the first copy
  (`ordered`). The copy therefore sees every write the engine enqueued before the call, and
  overwrites no block that an earlier kernel still reads.
- ``done``: the daemon records it on its copy stream after the copy and any layout fix; the
  client makes the caller's current stream wait for it when the reply arrives (`MoveSync.after`),
  so attention enqueued after the call reads the new blocks.

Each client has one pair per GPU and records it again for every move: a wait on an event waits
for its latest record, which is never earlier than the one meant, so reuse can only order more,
and since every record a wait can see was enqueued before that wait, no cycle (deadlock) can
form. The daemon opens each event handle once and keeps it (`open_event`).

Against a daemon without the ``cuda_events`` capability the client synchronises the caller's
stream before sending instead (`SyncBeforeSend`): slower, equally correct.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from kvsidecar.memory.base import HandleError
from kvsidecar.memory.cuda_ipc import IPC_HANDLE_BYTES
from kvsidecar.wire.types import MoveEvents

__all__ = [
    "MAX_OPEN_EVENTS",
    "MoveSync",
    "Sync",
    "SyncBeforeSend",
    "check_events",
    "copy_stream",
    "open_event",
    "ordered",
]

_Event: Any = torch.cuda.Event
_Stream: Any = torch.cuda.Stream


class Sync(Protocol):
    """What a client does around a move that touches its GPU memory."""

    device: torch.device
    """The GPU whose memory the moves touch."""

    def before(self) -> MoveEvents | None:
        """Run as the move is built; return the events to send (None: none)."""
        ...

    def after(self) -> None:
        """Run once the move's reply arrived (success only)."""
        ...


class MoveSync:
    """One GPU's pair of interprocess events, recorded around every move on its memory."""

    def __init__(self, device: torch.device, device_uuid: str) -> None:
        self.device = device
        with torch.cuda.device(device):
            self._ready = _Event(interprocess=True)
            self._done = _Event(interprocess=True)
            # Handles are fixed for an event's life: made once, sent with every move.
            self.events = MoveEvents(
                device_uuid=device_uuid,
                ready=bytes(self._ready.ipc_handle()),
                done=bytes(self._done.ipc_handle()),
            )

    def before(self) -> MoveEvents:
        """Record ``ready`` on the caller's current stream of this GPU."""
        self._ready.record(torch.cuda.current_stream(self.device))
        return self.events

    def after(self) -> None:
        """Make the caller's current stream of this GPU wait for the daemon's ``done``."""
        torch.cuda.current_stream(self.device).wait_event(self._done)


class SyncBeforeSend:
    """For a daemon without ``cuda_events``: finish the caller's GPU work before sending."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def before(self) -> None:
        """Wait for everything enqueued on the caller's current stream of this GPU."""
        torch.cuda.current_stream(self.device).synchronize()

    def after(self) -> None:
        """Nothing: such a daemon replies once its copy has finished on the GPU."""


# Called by the daemon.

MAX_OPEN_EVENTS = 1024
"""Event handles kept open (two per client GPU in use); the oldest is closed beyond it."""

_events: OrderedDict[tuple[int, bytes], Any] = OrderedDict()
_events_lock = threading.Lock()
_streams = threading.local()


def check_events(events: MoveEvents) -> None:
    """Refuse (``bad_handle``) event handles of the wrong size, before any CUDA call."""
    for name, handle in (("ready", events.ready), ("done", events.done)):
        if handle and len(handle) != IPC_HANDLE_BYTES:
            raise HandleError(
                "bad_handle", f"the {name} event handle has {len(handle)} bytes, not 64"
            )
    if not events.ready:
        raise HandleError("bad_handle", "a move's events need a ready event")


def open_event(ordinal: int, handle: bytes) -> Any:
    """Return the ``torch.cuda.Event`` of an IPC handle, opened once per process (blocking)."""
    key = (ordinal, handle)
    with _events_lock:
        event = _events.get(key)
        if event is not None:
            _events.move_to_end(key)
            return event
    try:
        event = _Event.from_ipc_handle(ordinal, handle)
    except RuntimeError as exc:
        raise HandleError("bad_handle", f"could not open a CUDA event handle: {exc}") from None
    with _events_lock:
        _events[key] = event
        while len(_events) > MAX_OPEN_EVENTS:
            _events.popitem(last=False)  # destroyed when freed; CUDA waits for pending work
    return event


def copy_stream(ordinal: int) -> Any:
    """Return the calling thread's copy stream on device ``ordinal`` (made on first use)."""
    streams: dict[int, Any] = getattr(_streams, "by_device", None) or {}
    _streams.by_device = streams
    stream = streams.get(ordinal)
    if stream is None:
        stream = streams[ordinal] = _Stream(device=ordinal)
    return stream


@contextlib.contextmanager
def ordered(
    devices: Sequence[int], events: MoveEvents | None = None, event_device: int | None = None
) -> Iterator[None]:
    """Run the body on this thread's copy streams of ``devices``, ordered by ``events``.

    Every stream first waits for ``events.ready``; after the body, ``events.done`` is recorded
    on the stream of ``event_device`` once the others have joined it. Every stream is
    synchronised before returning, also on error, so no copy outlives the job (the worker's
    mapping may be released right after).
    """
    streams = {d: copy_stream(d) for d in devices}
    with contextlib.ExitStack() as stack:
        for stream in streams.values():
            stack.enter_context(torch.cuda.stream(stream))
        try:
            if events is not None and event_device is not None:
                ready = open_event(event_device, events.ready)
                for stream in streams.values():
                    stream.wait_event(ready)
            yield
            if events is not None and events.done and event_device is not None:
                target = streams[event_device]
                for stream in streams.values():
                    if stream is not target:
                        target.wait_stream(stream)
                open_event(event_device, events.done).record(target)
        finally:
            for stream in streams.values():
                stream.synchronize()
