"""The NIXL data plane: the consumer READs the producer's registered memory through NIXL (UCX).

Each daemon owns one NIXL agent (named after its daemon id) and registers the layer buffers of
its registered workers with it, lazily: a producer syncs its registrations before answering a
handshake that asks for NIXL, a consumer before a pull. The producer's agent metadata and each
layer's base address travel in the handshake (`PeerWelcome.nixl_metadata`,
`PeerWorker.layer_addrs`); the consumer (re)loads the metadata whenever it changed.

A read plan becomes one READ transfer: local descriptors (our buffer + destination offset) and
remote descriptors (their base address + range offset), polled until done or the deadline. The
producer's daemon is not involved per read; the notification goes over the peer connection. The
transfer is posted from a thread, never from the event loop: over UCX's TCP and shared-memory
transports posting it moves the bytes.

A process that made an agent leaves through `kvsidecar.peer.process_exit.finish_process`: the
libraries the NIXL wheel bundles crash in their exit handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
from collections.abc import Hashable, Iterable
from typing import Any

import numpy as np
import torch

from kvsidecar.peer import process_exit
from kvsidecar.peer.link import PeerGone
from kvsidecar.peer.plan import ReadPlan
from kvsidecar.peer.planes import DataPlane, ReadTarget

log = logging.getLogger("kvsidecar.peer.nixl")


WAKEUP_MS = 1
"""Default period of the UCX progress thread's wake-ups when no event woke it (`new_agent`)."""

_constructing = threading.Lock()


class _Bindings:
    """NIXL's native module with some names replaced (`new_agent`)."""

    def __init__(self, native: Any, **replaced: Any) -> None:
        self._native = native
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._native, name)


def new_agent(name: str, config: Any, *, wakeup_ms: int = WAKEUP_MS) -> Any:
    """Create a ``nixl_agent`` whose UCX progress thread sleeps until it has work.

    The UCX backend's shared progress thread waits in ``poll()`` on its workers' event fds,
    with the agent's ``pthrDelay`` (µs, rounded up to whole ms) as the timeout: a periodic
    wake-up that NIXL keeps for fds that ``poll`` can miss. NIXL's Python ``nixl_agent`` sets
    ``pthrDelay`` to 0, so the thread never sleeps: it busy-polls a core for the agent's whole
    life, while a 1 ms wake-up leaves idle agents idle and reads no slower (docs/benchmarks.md,
    "bench peer"). The Python API has no option for it, so the native constructor is wrapped
    for this one construction (anything else that uses the module meanwhile reaches the same
    bindings through the wrapper). ``wakeup_ms`` 0 keeps NIXL's busy poll; so does a NIXL whose
    bindings have no such field (logged).
    """
    from nixl._api import nixl_agent

    process_exit.note_native_libraries()
    module = sys.modules[nixl_agent.__module__]
    native: Any = getattr(module, "nixlBind", None)
    config_type = getattr(native, "nixlAgentConfig", None)
    if wakeup_ms <= 0:
        return nixl_agent(name, config)
    if config_type is None or not hasattr(config_type(), "pthrDelay"):
        log.warning("this NIXL has no pthrDelay: its progress thread busy-polls a core")
        return nixl_agent(name, config)
    make = native.nixlAgent

    def make_sleeping(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = wakeup_ms * 1000
        return make(agent_name, agent_config)

    with _constructing:
        setattr(module, "nixlBind", _Bindings(native, nixlAgent=make_sleeping))  # noqa: B010
        try:
            return nixl_agent(name, config)
        finally:
            setattr(module, "nixlBind", native)  # noqa: B010


def nixl_available() -> bool:
    """Whether the ``nixl`` package can be imported here."""
    try:
        from nixl._api import nixl_agent  # noqa: F401
    except Exception:
        return False
    return True


class NixlPlane(DataPlane):
    """One NIXL agent with the daemon's buffers registered; READs on the consumer side."""

    name = "nixl"

    def __init__(self, agent_name: str, *, wakeup_ms: int = WAKEUP_MS) -> None:
        from nixl._api import nixl_agent_config, nixl_thread_sync_t

        self.agent_name = agent_name
        # The agent is used from the loop and from the thread that posts transfers (`read`):
        # without a listener thread NIXL's default is no locking at all. RW mode lets the data
        # path (transfers, their states) run concurrently and makes registrations and metadata
        # loads exclusive.
        config = nixl_agent_config(
            backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
        )
        self._agent: Any = new_agent(agent_name, config, wakeup_ms=wakeup_ms)
        # NIXL installs its own stdout handler at INFO on import; route its records through ours
        # so --log-level and --log-format json apply to them too.
        nixl_log = logging.getLogger("nixl")
        nixl_log.handlers.clear()
        nixl_log.propagate = True
        nixl_log.setLevel(logging.NOTSET)
        self._regs: dict[Hashable, tuple[torch.Tensor, Any]] = {}
        self._remotes: dict[str, bytes] = {}
        self._stuck: list[Any] = []

    def sync(self, buffers: Iterable[tuple[Hashable, torch.Tensor]]) -> None:
        """Register these buffers (by key) and deregister every other one registered before."""
        wanted = dict(buffers)
        for key in [k for k in self._regs if k not in wanted]:
            _, reg = self._regs.pop(key)
            try:
                self._agent.deregister_memory(reg)
            except Exception:
                log.warning("NIXL deregistration of %r failed", key, exc_info=True)
        for key, flat in wanted.items():
            if key not in self._regs:
                self._regs[key] = (flat, self._agent.register_memory(flat))

    def addr(self, key: Hashable) -> int:
        """Return the base address of a registered buffer."""
        return int(self._regs[key][0].data_ptr())

    def metadata(self) -> bytes:
        """Return the agent metadata (connection info, registered memory) for the handshake."""
        return bytes(self._agent.get_agent_metadata())

    def load_remote(self, name: str, metadata: bytes) -> None:
        """Load (or refresh) a remote agent's metadata; a no-op when unchanged."""
        if self._remotes.get(name) == metadata:
            return
        self._agent.add_remote_agent(metadata)
        self._remotes[name] = metadata

    async def read(self, target: ReadTarget, plan: ReadPlan, deadline: float) -> int:
        """One READ of every range of ``plan``, polled until done or ``deadline``."""
        if len(plan.ranges) == 0:
            return 0
        rem_base = np.asarray(target.remote.layer_addrs, dtype=np.int64)
        names = target.remote.layers
        # The plan indexes the remote layers by its own list; map to the worker's addresses.
        by_name = {n: int(rem_base[i]) for i, n in enumerate(names)}
        plan_bases = np.array([by_name[n] for n in plan.remote_layers], dtype=np.int64)
        loc_base = np.array(
            [lb.mapped.flat.data_ptr() for lb in target.local_layers], dtype=np.int64
        )
        n = plan.ranges[:, 2]
        remote = np.stack([plan_bases[plan.ranges[:, 0]] + plan.ranges[:, 1], n, 0 * n], 1)
        local = np.stack([loc_base[plan.dest[:, 0]] + plan.dest[:, 1], n, 0 * n], 1)
        agent = self._agent
        loop = asyncio.get_running_loop()
        handle = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(local.astype(np.uint64), "DRAM"),
            agent.get_xfer_descs(remote.astype(np.uint64), "DRAM"),
            target.remote_agent,
        )
        # transfer() may move every byte before it returns (UCX over TCP or shared memory
        # does), so it runs on a thread (the binding releases the GIL) and the loop keeps
        # serving everyone else meanwhile.
        posting = loop.run_in_executor(None, agent.transfer, handle)
        try:
            state = await asyncio.shield(posting)
        except asyncio.CancelledError:
            # The thread still holds the handle: it is released once the thread is done.
            posting.add_done_callback(lambda _: self._release(handle, False))
            raise
        except BaseException:
            self._release(handle, False)
            raise
        done = False
        try:
            pause = 50e-6
            while state != "DONE":
                if state == "ERR":
                    raise PeerGone(f"NIXL READ from {target.remote_agent} failed")
                if loop.time() > deadline:
                    raise PeerGone(f"NIXL READ from {target.remote_agent} did not finish in time")
                await asyncio.sleep(pause)
                pause = min(pause * 2, 1e-3)
                state = agent.check_xfer_state(handle)
            done = True
        finally:
            self._release(handle, done)
        return int(n.sum())

    def _release(self, handle: Any, done: bool) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            if not done:
                self._stuck.append(handle)

    def close(self) -> None:
        """Release stuck transfers and registrations; the agent goes with the object."""
        for handle in self._stuck:
            with contextlib.suppress(Exception):  # best effort at shutdown
                self._agent.release_xfer_handle(handle)
        self._stuck.clear()
        self.sync(())
