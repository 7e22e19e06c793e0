"""The data-plane interface: how the bytes of one `ReadPlan` get from the producer to us.

Two implementations: `kvsidecar.peer.zmq_plane.ZmqPlane` (built in: the producer's daemon sends
the ranges as zero-copy frames over the peer connection) and
`kvsidecar.peer.nixl_plane.NixlPlane` (the consumer READs the producer's registered memory
through NIXL; the producer's daemon does nothing per read). The handshake and notifications go
over the peer connection for both.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from kvsidecar.node.registry import LayerBuffer
from kvsidecar.peer.link import PeerLink
from kvsidecar.peer.messages import PeerWorker
from kvsidecar.peer.plan import ReadPlan


@dataclass(frozen=True)
class ReadTarget:
    """Where one read goes: the link, the remote worker and request, the local layer buffers."""

    link: PeerLink
    engine_id: str
    request_id: str
    remote: PeerWorker
    remote_agent: str
    """NIXL agent name of the producer ("" on the ZMQ plane)."""
    local_layers: list[LayerBuffer]
    """The local layer buffers, indexed like `ReadPlan.local_layers`."""


class DataPlane(abc.ABC):
    """Moves the bytes of read plans. One instance per daemon, shared by every pull."""

    name: str
    """``"zmq"`` or ``"nixl"``: what the handshake offers and `Pulled.plane` reports."""

    @abc.abstractmethod
    async def read(self, target: ReadTarget, plan: ReadPlan, deadline: float) -> int:
        """Read every range of ``plan`` into the local buffers by ``deadline`` (loop time).

        Returns the bytes read. Raises `kvsidecar.peer.link.PeerGone` (peer gone, timeout) or
        `kvsidecar.peer.link.PeerRefused`; on failure the destination bytes are undefined.
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the plane holds (agents, registrations)."""
