"""Which engines a request may touch: principals, their bindings to engines, and sharing grants.

The principal of a request is its ZeroMQ connection (the ROUTER routing id) **together with** the
transport user that libzmq vouched for (``uid:<n>`` on ipc, ``curve:<key>`` on tcp): a routing id
alone can be chosen by any client, so a binding is never found under another user's id.

An engine is known by its name and its **epoch**: the registration epoch of the worker that
created it (unique, also across daemon restarts). Its **owner** is the transport user that created
it. Rights are bound to such engines, never to names alone:

- A connection that registered a worker is **bound** to that worker's engine (name and epoch) and
  may read and write its buffers and host blocks. When the engine ends (its last worker released)
  the binding ends with it; a new engine of the same name is another engine.
- Only the owner's user may join an engine (register another of its workers), administrators
  included: joining an engine exposes the joiner's memory to it as well. A name that another user
  holds cannot be joined, only waited out.
- A grant (`Grant`) gives one engine's rights (read: move source; write: move destination, fix
  target) to another engine: the engine of that name owned by ``grantee_user`` (default: the
  granting engine's own user). It binds to that engine as registered now, or, when none is, to
  the first one that registers; it ends when either engine ends.

A connection that registered nothing is **administrative** when the transport vouched for it as
the daemon's own operator: an ipc peer with the daemon's uid (a same-uid process can read the
daemon's memory anyway, so refusing it would protect nothing), or a tcp peer authenticated by
CURVE (its key is on the operator's allow-list) or accepted in insecure mode. Any other unbound
connection may only say hello, ask for status, heartbeat and register.

Checks happen before a command does anything; a refusal is ``forbidden`` and changes nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from kvsidecar.wire.batch import MoveBatch
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
    Register,
    Request,
    Status,
    Unregister,
)
from kvsidecar.wire.pulls import Publish, Pull, TakePeerEvents
from kvsidecar.wire.types import WorkerRef

if TYPE_CHECKING:
    from kvsidecar.node.registry import Engine


_MAX_PRINCIPALS = 4096
"""Principals kept by `AccessControl.principal` (one per live connection and user)."""


class EngineId(NamedTuple):
    """One engine as a holder of rights: its name and the epoch it was created with."""

    name: str
    epoch: int


@dataclass(frozen=True)
class Principal:
    """Who sent a request: the engines its connection is bound to, and whether it is an admin."""

    engines: frozenset[EngineId]
    admin: bool
    user: str
    """The transport's word for the peer (``uid:<n>``, ``curve:<key>``, ``insecure``)."""
    ident: bytes = b""
    """The connection's routing id."""


@dataclass
class _Rights:
    """What a grant allows, and the grantee engine's epoch once one holds it (None: not yet)."""

    read: bool
    write: bool
    epoch: int | None


class AccessControl:
    """Connection bindings and grants, and the checks commands go through."""

    def __init__(
        self,
        admin_uids: Iterable[int] | None = None,
        *,
        lookup: Callable[[str], Engine | None] = lambda _: None,
    ) -> None:
        # ``lookup``: the registered engine of a name. Checks on an unknown engine pass, so the
        # command fails with its own precise error (unknown_engine) and nothing is touched.
        self._lookup = lookup
        self._admin_users = {f"uid:{u}" for u in (admin_uids or (os.geteuid(),))}
        self._bound: dict[tuple[bytes, str], dict[WorkerRef, EngineId]] = {}
        self._by_worker: dict[WorkerRef, tuple[bytes, str]] = {}
        self._grants: dict[EngineId, dict[tuple[str, str], _Rights]] = {}
        """owner engine -> (grantee name, grantee user) -> rights."""
        self._principals: dict[tuple[bytes, str], Principal] = {}
        """`principal`'s answers, by connection and user; a binding's change drops its own."""

    def current(self, name: str) -> EngineId | None:
        """Return the engine registered under ``name`` now, if any."""
        engine = self._lookup(name)
        return None if engine is None else EngineId(name, engine.epoch)

    def bind(self, who: Principal, ref: WorkerRef, engine: EngineId) -> None:
        """Record that ``who``'s connection registered ``ref``, a worker of ``engine``."""
        key = (who.ident, who.user)
        self._bound.setdefault(key, {})[ref] = engine
        self._by_worker[ref] = key
        self._principals.pop(key, None)

    def unbind(self, ref: WorkerRef) -> None:
        """Forget a released worker's binding."""
        key = self._by_worker.pop(ref, None)
        if key is None:
            return
        self._principals.pop(key, None)
        refs = self._bound.get(key)
        if refs is not None:
            refs.pop(ref, None)
            if not refs:
                del self._bound[key]

    def principal(self, ident: bytes, user: str) -> Principal:
        """Return who sent a request on connection ``ident`` (transport user ``user``)."""
        key = (ident, user)
        who = self._principals.get(key)
        if who is not None:
            return who
        refs = self._bound.get(key)
        engines = frozenset(refs.values()) if refs else frozenset()
        admin = not engines and (
            user in self._admin_users or user.startswith("curve:") or user == "insecure"
        )
        who = Principal(engines, admin, user, ident)
        if len(self._principals) >= _MAX_PRINCIPALS:  # connections come and go: start over
            self._principals.clear()
        self._principals[key] = who
        return who

    def engine_created(self, engine: EngineId, owner: str) -> None:
        """Record a new engine: grants that waited for its name and owner now hold it."""
        for grants in self._grants.values():
            rights = grants.get((engine.name, owner))
            if rights is not None and rights.epoch is None:
                rights.epoch = engine.epoch

    def grant(
        self,
        owner: EngineId,
        grantee: str,
        grantee_user: str,
        *,
        read: bool,
        write: bool,
    ) -> None:
        """Set what engine ``grantee`` of ``grantee_user`` may do with ``owner``'s buffers.

        Both False revoke. The grant holds the grantee's current engine if that user owns it,
        else it waits for the next engine of that name and user to register.
        """
        grants = self._grants.setdefault(owner, {})
        key = (grantee, grantee_user)
        if not read and not write:
            grants.pop(key, None)
        else:
            holder = self._lookup(grantee)
            epoch = holder.epoch if holder is not None and holder.owner == grantee_user else None
            grants[key] = _Rights(read, write, epoch)
        if not grants:
            del self._grants[owner]

    def drop_engine(self, engine: EngineId) -> None:
        """Forget an ended engine: its grants go, and so do those it held (never passed on)."""
        self._grants.pop(engine, None)
        for owner, grants in list(self._grants.items()):
            for key, rights in list(grants.items()):
                if key[0] == engine.name and rights.epoch == engine.epoch:
                    del grants[key]
            if not grants:
                del self._grants[owner]

    def may(self, who: Principal, engine_id: str, *, write: bool) -> bool:
        """Whether ``who`` may read (or write) ``engine_id``'s buffers and host blocks."""
        if who.admin:
            return True
        engine = self.current(engine_id)
        if engine is None or engine in who.engines:
            return True
        for (name, _), rights in self._grants.get(engine, {}).items():
            allowed = rights.write if write else rights.read
            if allowed and rights.epoch is not None and EngineId(name, rights.epoch) in who.engines:
                return True
        return False

    def check(self, who: Principal, engine_id: str, *, write: bool, what: str) -> None:
        """Raise ``forbidden`` unless `may`."""
        if not self.may(who, engine_id, write=write):
            verb = "write" if write else "read"
            mine = ", ".join(sorted(e.name for e in who.engines)) or (
                f"an unregistered client ({who.user})"
            )
            raise SidecarError(
                "forbidden",
                f"{what}: {mine} may not {verb} engine {engine_id!r} (no grant from its owner)",
            )

    def check_register(self, who: Principal, engine_id: str) -> None:
        """Raise ``forbidden`` if ``who`` would join another user's engine by registering.

        Joining an engine gives access to all its buffers (and gives the engine access to the
        joiner's), so it is the owner's user's alone, whoever asks, administrators included.
        """
        engine = self._lookup(engine_id)
        if engine is not None and engine.owner != who.user:
            raise SidecarError(
                "forbidden",
                f"engine {engine_id!r} is another user's; {who.user} may not join it",
            )

    def owns(self, who: Principal, engine: Engine) -> bool:
        """Whether ``who`` may be told about ``engine``: its owner's user, or an administrator."""
        return who.admin or engine.owner == who.user

    def same_user(self, who: Principal, engine_id: str) -> bool:
        """Return whether ``who`` is the user that registered ``engine_id``.

        Also True for an admin, and when there is no such engine (the command then fails with
        its own precise error).
        """
        engine = self._lookup(engine_id)
        return engine is None or self.owns(who, engine)

    def check_same_user(self, who: Principal, engine_id: str, what: str) -> None:
        """Raise ``forbidden`` unless ``who`` is the user that registered ``engine_id`` (or admin).

        For reads of another engine's *published* blocks on this node (a local pull): the
        producer published them for a consumer, and the consumer is trusted as far as its user is.
        """
        engine = self._lookup(engine_id)
        if engine is None or self.same_user(who, engine_id):
            return
        raise SidecarError(
            "forbidden", f"{what}: engine {engine_id!r} is not an engine of {who.user}"
        )

    def check_owner(self, who: Principal, engine_id: str, what: str) -> None:
        """Raise ``forbidden`` unless ``who`` is bound to ``engine_id`` (or an admin)."""
        engine = self.current(engine_id)
        if not (who.admin or engine is None or engine in who.engines):
            raise SidecarError("forbidden", f"{what}: only engine {engine_id!r} itself may do it")


def authorize(acl: AccessControl, who: Principal, req: Request) -> None:
    """Raise ``forbidden`` unless ``who`` may do ``req``.

    Hello, status and heartbeat are anyone's: status and heartbeat answer about the sender's
    own user's engines only (`AccessControl.owns`).
    """
    match req:
        case Hello() | Status() | Heartbeat():
            return
        case Move():
            acl.check(who, req.src.worker.engine_id, write=False, what="move source")
            acl.check(who, req.dst.worker.engine_id, write=True, what="move destination")
        case MoveBatch():
            for item in req.items:
                acl.check(who, item.src.worker.engine_id, write=False, what="move source")
                acl.check(who, item.dst.worker.engine_id, write=True, what="move destination")
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
        # A cache namespace is its user's (kvsidecar/daemon/cache/prefix.py), so a lookup is
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
