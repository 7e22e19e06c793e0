"""What a pull works with: `PullContext`, with `PlaneSet` (the data planes) and `PullCounts`.

The peer service makes one `PullContext` and hands it to every pull (`kvsidecar.peer.pull`):
the node's parts (config, registry, copy executor), the daemon's id, the links and the data
planes, the completion sink and the counters, and nothing else of the service.

`PlaneSet` holds this daemon's data planes by name and its NIXL agent, made at most once. The
ZMQ plane is always there; the local plane (`kvsidecar.peer.local`) is added by the peer
service; the NIXL plane once its agent exists (`ensure_nixl`), and only with
``peer_nixl_trusted``: UCX does not confine a peer connected to our agent to what we registered
(docs/reliability.md). An agent costs a progress thread, UCX workers and registrations, so it
is made when first needed, off the event loop, and a failure is remembered rather than retried:
pulls then use the ZMQ plane.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvsidecar.node.config import Config
from kvsidecar.node.executor import CopyExecutor
from kvsidecar.node.registry import Registry
from kvsidecar.peer.link import PeerLink
from kvsidecar.peer.links import PeerLinks
from kvsidecar.peer.nixl_plane import NixlPlane
from kvsidecar.peer.planes import DataPlane
from kvsidecar.peer.zmq_plane import ZmqPlane
from kvsidecar.wire.reports import PeerCompletion

log = logging.getLogger("kvsidecar.peer")


class PlaneSet:
    """The data planes a pull may use and a producer offers (`by_name`), and the NIXL agent."""

    def __init__(self, config: Config, registry: Registry, agent_name: str) -> None:
        self.config = config
        self.registry = registry
        self.agent_name = agent_name
        """The NIXL agent's name: the daemon's id."""
        self.by_name: dict[str, DataPlane] = {"zmq": ZmqPlane(config.peer_chunk_bytes)}
        self.nixl: NixlPlane | None = None
        self.nixl_error: str | None = None
        """Why the NIXL agent could not be made (None: not tried, or made)."""
        self._lock = asyncio.Lock()

    async def ensure_nixl(self) -> None:
        """Create the NIXL agent once, off the loop; remember a failure instead of retrying."""
        # Under the lock, so that concurrent first pulls create one agent between them.
        async with self._lock:
            if self.nixl is not None or self.nixl_error is not None:
                return
            if not self.config.peer_nixl_trusted:
                # UCX lets a connected peer read any of our memory (docs/reliability.md).
                self.nixl_error = "peer_nixl_trusted is not set"
                return
            try:
                # Creating an agent starts threads and UCX workers: keep the loop free meanwhile.
                self.nixl = await asyncio.get_running_loop().run_in_executor(
                    None,
                    functools.partial(
                        NixlPlane, self.agent_name, wakeup_ms=self.config.peer_nixl_wakeup_ms
                    ),
                )
                self.by_name["nixl"] = self.nixl
            except Exception as exc:
                self.nixl_error = str(exc) or type(exc).__name__
                log.info("NIXL not available (%s): peers use the ZMQ plane", exc)

    def registered_buffers(self) -> list[tuple[Any, torch.Tensor]]:
        """Every registered layer buffer, keyed as the NIXL agent registers it."""
        return [
            ((w.ref, name), lb.mapped.flat)
            for w in self.registry.workers.values()
            for name, lb in w.device.layers.items()
        ]

    def close(self) -> None:
        """Release the NIXL agent's registrations."""
        if self.nixl is not None:
            self.nixl.close()


@dataclass
class PullCounts:
    """Pulls run, pulls with a failed request, and bytes pulled, since the daemon started."""

    pulls: int = 0
    failed: int = 0
    nbytes: int = 0


@dataclass(frozen=True, eq=False)
class PullContext:
    """What a pull needs of the node and of the peer service (`PeerService` makes one)."""

    config: Config
    registry: Registry
    executor: CopyExecutor
    """The node's copy threads: layout fixes of received blocks run there."""
    daemon_id: str
    """This daemon's id: sent in the handshake, and how a pull from itself is recognised."""
    planes: PlaneSet
    links: PeerLinks
    """The links to other daemons: endpoints checked, links taken and given back."""
    local_link: PeerLink
    """The link to this daemon itself (a pull whose endpoint is "")."""
    emit: Callable[[PeerCompletion], None]
    """Where a pull's completion events go."""
    counts: PullCounts
