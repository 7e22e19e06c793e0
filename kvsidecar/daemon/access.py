"""Which engines a connection may touch: bindings of connections to engines, and sharing grants.

The principal of a request is its ZeroMQ connection (the ROUTER routing id). A connection that
registered a worker is **bound** to that worker's engine and may read and write that engine's
buffers and host blocks, and those of engines that granted it access (`Grant`). A connection
that registered nothing is **administrative** when the transport vouched for it as the daemon's
own operator: an ipc peer with the daemon's uid (a same-uid process can read the daemon's memory
anyway, so refusing it would protect nothing), or a tcp peer authenticated by CURVE (its key is on
the operator's allow-list) or accepted in insecure mode. Any other unbound connection (an ipc
peer with another allowed uid that has not registered) may only say hello, ask for status,
heartbeat and register.

Checks happen before a command does anything; a refusal is ``forbidden`` and changes nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvsidecar.wire.cache import CacheLoad, CacheLookup, CacheStore
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.protocol import (
    FixLayout,
    Grant,
    Heartbeat,
    Hello,
    HostAlloc,
    HostFree,
    Move,
    Publish,
    Pull,
    Register,
    Request,
    Status,
    TakePeerEvents,
    Unregister,
)
from kvsidecar.wire.types import WorkerRef


@dataclass(frozen=True)
class Principal:
    """Who sent a request: the engines its connection is bound to, and whether it is an admin."""

    engines: frozenset[str]
    admin: bool
    user: str
    """The transport's word for the peer (``uid:<n>``, ``curve:<key>``, ``insecure``)."""


@dataclass
class _Grant:
    read: set[str] = field(default_factory=set)
    write: set[str] = field(default_factory=set)


class AccessControl:
    """Connection bindings and grants, and the checks commands go through."""

    def __init__(
        self,
        admin_uids: Iterable[int] | None = None,
        *,
        exists: Callable[[str], bool] = lambda _: True,
    ) -> None:
        # ``exists``: whether an engine is registered. Checks on an unknown engine pass, so the
        # command fails with its own precise error (unknown_engine) and nothing is touched.
        self._exists = exists
        self._admin_users = {f"uid:{u}" for u in (admin_uids or (os.geteuid(),))}
        self._bound: dict[bytes, set[WorkerRef]] = {}
        self._by_worker: dict[WorkerRef, bytes] = {}
        self._grants: dict[str, _Grant] = {}
        self._engine_user: dict[str, str] = {}
        """The transport user that registered an engine's first worker."""

    # -- bindings

    def bind(self, ident: bytes, ref: WorkerRef, user: str) -> None:
        """Record that the connection ``ident`` (transport user ``user``) registered ``ref``."""
        self._bound.setdefault(ident, set()).add(ref)
        self._by_worker[ref] = ident
        self._engine_user.setdefault(ref.engine_id, user)

    def unbind(self, ref: WorkerRef) -> None:
        """Forget a released worker's binding."""
        ident = self._by_worker.pop(ref, None)
        if ident is None:
            return
        refs = self._bound.get(ident)
        if refs is not None:
            refs.discard(ref)
            if not refs:
                del self._bound[ident]

    def principal(self, ident: bytes, user: str) -> Principal:
        """Return who sent a request on connection ``ident`` (transport user ``user``)."""
        refs = self._bound.get(ident)
        engines = frozenset(r.engine_id for r in refs) if refs else frozenset()
        admin = not engines and (
            user in self._admin_users or user.startswith("curve:") or user == "insecure"
        )
        return Principal(engines, admin, user)

    # -- grants

    def grant(self, owner: str, grantee: str, *, read: bool, write: bool) -> None:
        """Set what ``grantee`` may do with ``owner``'s buffers (both False: revoke)."""
        g = self._grants.setdefault(owner, _Grant())
        for allowed, names in ((read, g.read), (write, g.write)):
            if allowed:
                names.add(grantee)
            else:
                names.discard(grantee)
        if not g.read and not g.write:
            del self._grants[owner]

    def drop_engine(self, engine_id: str) -> None:
        """Forget an engine's grants and owner (it is gone; a new one of that name starts clean)."""
        self._grants.pop(engine_id, None)
        self._engine_user.pop(engine_id, None)

    # -- checks

    def may(self, who: Principal, engine_id: str, *, write: bool) -> bool:
        """Whether ``who`` may read (or write) ``engine_id``'s buffers and host blocks."""
        if who.admin or engine_id in who.engines or not self._exists(engine_id):
            return True
        g = self._grants.get(engine_id)
        if g is None:
            return False
        names = g.write if write else g.read
        return not who.engines.isdisjoint(names)

    def check(self, who: Principal, engine_id: str, *, write: bool, what: str) -> None:
        """Raise ``forbidden`` unless `may`."""
        if not self.may(who, engine_id, write=write):
            verb = "write" if write else "read"
            mine = ", ".join(sorted(who.engines)) or f"an unregistered client ({who.user})"
            raise SidecarError(
                "forbidden",
                f"{what}: {mine} may not {verb} engine {engine_id!r} (no grant from its owner)",
            )

    def check_register(self, who: Principal, engine_id: str) -> None:
        """Raise ``forbidden`` if ``who`` would join another user's engine by registering.

        Joining an engine gives access to all its buffers, so it is the owner's user's alone.
        """
        owner = self._engine_user.get(engine_id)
        if owner is None or who.admin or owner == who.user:
            return
        raise SidecarError(
            "forbidden", f"engine {engine_id!r} belongs to {owner}; {who.user} may not join it"
        )

    def check_same_user(self, who: Principal, engine_id: str, what: str) -> None:
        """Raise ``forbidden`` unless ``who`` is the user that registered ``engine_id`` (or admin).

        For reads of another engine's *published* blocks on this node (a local pull): the
        producer published them for a consumer, and the consumer is trusted as far as its user is.
        """
        owner = self._engine_user.get(engine_id)
        if owner is None or who.admin or owner == who.user:
            return
        raise SidecarError(
            "forbidden", f"{what}: engine {engine_id!r} belongs to {owner}, not to {who.user}"
        )

    def check_owner(self, who: Principal, engine_id: str, what: str) -> None:
        """Raise ``forbidden`` unless ``who`` is bound to ``engine_id`` (or an admin)."""
        if not (who.admin or engine_id in who.engines or not self._exists(engine_id)):
            raise SidecarError("forbidden", f"{what}: only engine {engine_id!r} itself may do it")


def authorize(acl: AccessControl, who: Principal, req: Request) -> None:
    """Raise ``forbidden`` unless ``who`` may do ``req`` (hello, status and heartbeat: anyone)."""
    match req:
        case Hello() | Status() | Heartbeat():
            return
        case Move():
            acl.check(who, req.src.worker.engine_id, write=False, what="move source")
            acl.check(who, req.dst.worker.engine_id, write=True, what="move destination")
        case FixLayout():
            acl.check(who, req.target.worker.engine_id, write=True, what="fix_layout")
        case HostAlloc() | HostFree():
            acl.check(who, req.engine_id, write=True, what=type(req).__name__)
        case Register():
            acl.check_register(who, req.worker.engine_id)
        case Unregister():
            acl.check_owner(who, req.worker.engine_id, "unregister")
        case Grant():
            acl.check_owner(who, req.owner.engine_id, "grant")
        case Pull():
            acl.check(who, req.engine_id, write=True, what="pull")
            if not req.remote_endpoint:  # a local pull reads an engine of this node
                acl.check_same_user(who, req.remote_engine_id, "local pull")
        case Publish():
            acl.check(who, req.engine_id, write=False, what="publish")
        # prefix cache: a namespace is its user's (kvsidecar/daemon/cache.py), so a lookup is
        # anyone's; a store reads the worker's blocks, a load writes them.
        case CacheLookup():
            return
        case CacheStore():
            acl.check(who, req.source.worker.engine_id, write=False, what="cache_store")
        case CacheLoad():
            acl.check(who, req.target.worker.engine_id, write=True, what="cache_load")
        case TakePeerEvents():
            if req.engine_id:
                acl.check_owner(who, req.engine_id, "take_peer_events")
            elif not who.admin:
                raise SidecarError("forbidden", "take_peer_events of every engine: admin only")
        case _:
            # Other commands (report, collect) name one engine, which must be the sender's.
            engine_id = getattr(req, "engine_id", None) or getattr(
                getattr(req, "worker", None), "engine_id", None
            )
            if isinstance(engine_id, str):
                acl.check_owner(who, engine_id, type(req).__name__)
