"""Ordering the daemon's copies against the engine's GPU streams, by the caller's CUDA events.

A copy of a worker's GPU memory (a move, a cache store or load, a pull into one rank) may carry
the caller's events (`kvsidecar.wire.types.MoveEvents`, recorded by the client as it sends the
command, `kvsidecar.memory.cuda_sync`). They are checked on the loop before anything is queued
(`event_device`); a copy job then runs on the copy thread's own streams after waiting for
``ready`` (`on_copy_streams`), and a pull, whose writes come from the data planes, starts
writing only once ``ready`` has passed (`ready_passed`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvsidecar.memory import cuda_ipc, cuda_sync
from kvsidecar.memory.base import HandleError
from kvsidecar.node.registry import BufferSet
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.types import MoveEvents

READY_POLL_S = 0.0005
"""How often `ready_passed` asks whether the engine's stream has passed the event."""


def cuda_devices(buffers: BufferSet) -> tuple[int, ...]:
    """Return the GPUs whose memory a buffer set's layers are in (none: CPU memory)."""
    return tuple(
        sorted({lb.cache.device.index or 0 for lb in buffers.layers.values() if lb.cache.is_cuda})
    )


def event_device(devices: tuple[int, ...], events: MoveEvents | None) -> int | None:
    """Check a copy's events against the GPUs it touches; return the events' GPU (None: none).

    Raises ``invalid_message`` for events on a copy of CPU memory, handles of the wrong size,
    and events of a GPU the copy does not touch (`cuda_sync.ordered` records ``done`` there).
    """
    if events is None:
        return None
    if not devices:
        raise SidecarError("invalid_message", "a move of CPU memory takes no CUDA events")
    try:
        cuda_sync.check_events(events)
        device = cuda_ipc.local_index(events.device_uuid, cuda_ipc.visible_device_uuids())
    except HandleError as exc:
        raise SidecarError("invalid_message", f"move events: {exc}") from None
    if device not in devices:
        raise SidecarError(
            "invalid_message",
            f"move events are of GPU {events.device_uuid}, which the move does not touch",
        )
    return device


def on_copy_streams(
    run: Callable[[], int], devices: tuple[int, ...], events: MoveEvents | None
) -> Callable[[], int]:
    """Make a copy of GPU memory run on the copy thread's streams, ordered by ``events``.

    The events are checked now, on the loop (`event_device`). A CPU copy (no ``devices``) runs
    as it is.
    """
    device = event_device(devices, events)
    if not devices:
        return run

    def ordered_run() -> int:
        with cuda_sync.ordered(devices, events, device):
            return run()

    return ordered_run


def ready_of(targets: list[BufferSet], events: MoveEvents | None) -> tuple[int, bytes] | None:
    """Check events for writes into one rank's ``targets``; return ``(GPU, ready handle)``.

    None: no events. Events of one caller's stream cannot order several ranks' writes: refused.
    """
    if events is not None and len(targets) != 1:
        raise SidecarError("invalid_message", "a copy's events order one rank's blocks only")
    device = None if events is None else event_device(cuda_devices(targets[0]), events)
    return None if device is None or events is None else (device, events.ready)


async def ready_passed(device: int, handle: bytes, deadline: float) -> bool:
    """Wait until the engine's stream has passed a ready event; False at ``deadline``.

    ``deadline`` is loop time. Polls, never blocking the loop: a stream that never gets there
    (an engine stopped mid-step) fails the copy at its deadline instead of holding a thread.
    """
    loop = asyncio.get_running_loop()
    event = await loop.run_in_executor(None, cuda_sync.open_event, device, handle)
    while not event.query():
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(READY_POLL_S)
    return True
