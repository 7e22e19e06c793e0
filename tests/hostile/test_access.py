"""No side door into another engine's blocks.

A real daemon process serves the test's own uid (root here) and ``nobody``; its sockets are
opened up so that the uid allow-list and the engine checks are all that stand between them. The
victim is an engine of root, registered with raw requests, its memory a sealed memfd full of
0xAB. The intruder is a `tests.procs.intruder` process that dropped to ``nobody`` and speaks
raw ZeroMQ and raw SCM_RIGHTS; after every attack its own memory (0x11) must hold no byte of the
victim's and the victim's memory must be unchanged. The peer plane is attacked too, with a raw
DEALER on the daemon's peer endpoint (holding the cluster key, as another daemon would).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from kvsidecar.peer.messages import PeerError, PeerReply, ReadBlocks, ReadData
from kvsidecar.peer.producer import MAX_PUBLISHED_PER_OWNER
from kvsidecar.wire.curve import load_keypair
from kvsidecar.wire.protocol import (
    Collect,
    Error,
    FixLayout,
    Grant,
    Heartbeat,
    HostAlloc,
    HostFree,
    Move,
    Ok,
    Registered,
    Report,
    Request,
    Status,
    StatusReply,
    Unregister,
)
from kvsidecar.wire.pulls import Publish, Pull, PullItem, TakePeerEvents
from kvsidecar.wire.types import BufferSetRef, LayoutSpec, WorkerRef
from tests.support.children import LineChild
from tests.support.daemons import DaemonProcess, cluster_key, make_config, open_to_every_uid
from tests.support.ports import tcp_endpoint
from tests.support.raw import Raw, ids, kv_descriptor, register_fd, sealed_memfd

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid"),
]

NOBODY = 65534
_, NBYTES = kv_descriptor()
ROW = NBYTES // 2 // 16  # bytes of one block of K (or V)
VICTIM, MINE = 0xAB, 0x11


class Intruder(LineChild):
    """The `tests.procs.intruder` child (uid nobody), one JSON command per line."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__("intruder", json.dumps(spec), name="intruder")

    def ask(self, **cmd: Any) -> dict[str, Any]:  # type: ignore[override]  # JSON in, JSON out
        self.send_line(json.dumps(cmd))
        out: dict[str, Any] = json.loads(self.line(30))
        return out

    def register(self, engine: str, **kw: Any) -> dict[str, Any]:
        return self.ask(op="register", engine=engine, **kw)

    def send(self, req: Request, *frames: bytes, routing_id: bytes | None = None) -> dict[str, Any]:
        return self.ask(
            op="send",
            header=msgspec.msgpack.encode(req).hex(),
            frames=[f.hex() for f in frames],
            routing_id=routing_id.hex() if routing_id else None,
        )

    def holds_victim_bytes(self) -> bool:
        mine = bytes.fromhex(self.ask(op="peek", offset=0, nbytes=NBYTES)["hex"])
        return bytes([VICTIM]) * 16 in mine


@dataclass
class Scene:
    daemon: DaemonProcess
    intruder: Intruder
    root: Raw
    memory: dict[str, int] = field(default_factory=dict)
    channels: list[socket.socket] = field(default_factory=list)

    def register(self, engine: str, *, raw: Raw | None = None, **kw: Any) -> Any:
        """Register a root engine over a fresh memfd full of 0xAB (kept for checks)."""
        fd = sealed_memfd(NBYTES, fill=VICTIM)
        self.memory[engine] = fd
        reply, conn = register_fd(raw or self.root, self.daemon.config.fd_socket, engine, fd, **kw)
        self.channels.append(conn)
        return reply

    def untouched(self, engine: str) -> bool:
        return os.pread(self.memory[engine], NBYTES, 0) == bytes([VICTIM]) * NBYTES

    def call(self, req: Request, *frames: bytes) -> Any:
        return self.root.call(req, *frames)


def _rid() -> int:
    _rid.n += 1  # type: ignore[attr-defined]
    return _rid.n  # type: ignore[attr-defined, no-any-return]


_rid.n = 100  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def scene() -> Iterator[Scene]:
    config = make_config(
        allowed_uids=f"{os.geteuid()},{NOBODY}",
        host_pool_bytes=8 << 20,
        lease_s=60.0,
        peer_endpoint=tcp_endpoint(),
        curve_secret_key=cluster_key(),
        peer_data_plane="zmq",
        peer_lease_s=60.0,
        peer_handshake_timeout_s=5.0,
        peer_pull_timeout_s=10.0,
    )
    daemon = DaemonProcess(config)
    intruder: Intruder | None = None
    root = Raw(config.endpoint)
    scene_: Scene | None = None
    try:
        daemon.wait_ready()
        open_to_every_uid(config)
        spec = {"uid": NOBODY, "endpoint": config.endpoint, "fd_socket": config.fd_socket}
        intruder = Intruder(spec)
        assert intruder.line(60) == "ready"
        scene_ = Scene(daemon, intruder, root)
        assert isinstance(scene_.register("decode", host_blocks=4), Registered)
        assert intruder.register("evil", host_blocks=4)["type"] == "registered"
        yield scene_
    finally:
        if intruder is not None:
            intruder.stop()
        root.close()
        if scene_ is not None:
            for conn in scene_.channels:
                conn.close()
            for fd in scene_.memory.values():
                os.close(fd)
        daemon.stop()
        shutil.rmtree(config.runtime_dir, ignore_errors=True)


@pytest.fixture(autouse=True)
def _clean_intruder(scene: Scene) -> None:
    """Each attack starts with the intruder's memory free of the victim's bytes."""
    assert scene.intruder.ask(op="wipe")["type"] == "ok"


def _refused(out: dict[str, Any]) -> bool:
    return out["type"] == "error" and out["code"] in ("forbidden", "unknown_engine")


def test_every_command_on_another_uids_engine_is_forbidden(scene: Scene) -> None:
    v, e = WorkerRef("decode"), WorkerRef("evil")
    attacks: dict[str, tuple[Request, tuple[bytes, ...]]] = {
        "move from it": (Move(id=_rid(), src=BufferSetRef(v), dst=BufferSetRef(e)), (ids(1),) * 2),
        "move into it": (Move(id=_rid(), src=BufferSetRef(e), dst=BufferSetRef(v)), (ids(1),) * 2),
        "move its host blocks": (
            Move(id=_rid(), src=BufferSetRef(v, "host"), dst=BufferSetRef(e)),
            (ids(1),) * 2,
        ),
        "fix_layout": (
            FixLayout(id=_rid(), target=BufferSetRef(v), remote=LayoutSpec("HND", 4)),
            (ids(1),),
        ),
        "host_alloc": (HostAlloc(id=_rid(), engine_id="decode", count=1), ()),
        "host_free": (HostFree(id=_rid(), engine_id="decode"), (ids(0),)),
        "publish": (Publish(id=_rid(), engine_id="decode", request_id="r"), (ids(1),)),
        "take_peer_events": (TakePeerEvents(id=_rid(), engine_id="decode"), ()),
        "take every engine's peer events": (TakePeerEvents(id=_rid()), ()),
        "report as its worker": (Report(id=_rid(), worker=v, epoch=0, step=1), ()),
        "collect": (Collect(id=_rid(), engine_id="decode", step=1, timeout_s=0), ()),
        "unregister": (Unregister(id=_rid(), worker=v), ()),
        "grant itself access": (Grant(id=_rid(), owner=v, grantee="evil", write=True), ()),
        "pull into it": (
            Pull(
                id=_rid(),
                engine_id="decode",
                remote_endpoint=scene.daemon.config.peer_endpoint,
                remote_engine_id="evil",
                items=[PullItem("r", 1, 1)],
            ),
            (ids(1), ids(1)),
        ),
        "pull from it through this daemon's own peer endpoint": (
            Pull(
                id=_rid(),
                engine_id="evil",
                remote_endpoint=scene.daemon.config.peer_endpoint,
                remote_engine_id="decode",
                items=[PullItem("r", 2, 2)],
            ),
            (ids(2, 3), ids(2, 3)),
        ),
    }
    results = {what: scene.intruder.send(req, *frames) for what, (req, frames) in attacks.items()}
    opened = {what: out for what, out in results.items() if not _refused(out)}
    assert not opened, f"side doors: {json.dumps(opened, default=str)[:3000]}"
    assert not scene.intruder.holds_victim_bytes()
    assert scene.untouched("decode")


def test_name_claimed_by_another_uid_first_is_not_joined(scene: Scene) -> None:
    """nobody registers rank 0 of "prefill" before its owner: the owner must not join it."""
    assert scene.intruder.register("prefill", tp_rank=0, tp_size=2)["type"] == "registered"
    with Raw(scene.daemon.config.endpoint) as owner:  # a fresh worker process of root's
        reply = scene.register("prefill", raw=owner, tp_rank=1, tp_size=2)
    assert isinstance(reply, Error) and reply.code == "forbidden", reply
    src, dst = BufferSetRef(WorkerRef("prefill", 1)), BufferSetRef(WorkerRef("prefill", 0))
    out = scene.intruder.send(Move(id=_rid(), src=src, dst=dst), ids(1), ids(1))
    assert out["type"] == "error", out
    assert not scene.intruder.holds_victim_bytes()


def test_grant_before_its_owner_registers_gives_nothing(scene: Scene) -> None:
    """A grant naming an engine that is not there yet is refused and leaves nothing behind."""
    grant = Grant(id=_rid(), owner=WorkerRef("ghost"), grantee="evil", read=True, write=True)
    assert _refused(scene.intruder.send(grant))
    assert isinstance(scene.register("ghost"), Registered)
    move = Move(
        id=_rid(), src=BufferSetRef(WorkerRef("ghost")), dst=BufferSetRef(WorkerRef("evil"))
    )
    assert _refused(scene.intruder.send(move, ids(9), ids(9)))
    assert not scene.intruder.holds_victim_bytes()


def test_grant_to_a_name_nobody_holds_is_not_inherited_by_another_uid(scene: Scene) -> None:
    grant = Grant(id=_rid(), owner=WorkerRef("decode"), grantee="later", read=True, write=True)
    assert isinstance(scene.call(grant), Ok)
    assert scene.intruder.register("later")["type"] == "registered"
    move = Move(
        id=_rid(), src=BufferSetRef(WorkerRef("decode")), dst=BufferSetRef(WorkerRef("later"))
    )
    out = scene.intruder.send(move, ids(4), ids(4))
    assert _refused(out), out
    assert not scene.intruder.holds_victim_bytes()


def test_grant_to_a_name_nobody_holds_yet_serves_the_owners_own_engine(scene: Scene) -> None:
    """The control case (the demo's order): the grantee registers later, as the same user."""
    grant = Grant(id=_rid(), owner=WorkerRef("decode"), grantee="sibling", read=True)
    assert isinstance(scene.call(grant), Ok)
    with Raw(scene.daemon.config.endpoint) as sibling:
        assert isinstance(scene.register("sibling", raw=sibling), Registered)
        src, dst = BufferSetRef(WorkerRef("decode")), BufferSetRef(WorkerRef("sibling"))
        reply = sibling.call(Move(id=_rid(), src=src, dst=dst), ids(5), ids(5))
        assert type(reply).__name__ == "Moved", reply


def test_grant_to_another_users_engine_must_name_that_user(scene: Scene) -> None:
    """A grant by name alone means the owner's own user; another uid's engine must be named."""
    decode, evil = WorkerRef("decode"), WorkerRef("evil")
    move = Move(id=_rid(), src=BufferSetRef(decode), dst=BufferSetRef(evil))
    grant = Grant(id=_rid(), owner=decode, grantee="evil", read=True)
    assert isinstance(scene.call(grant), Ok)
    assert _refused(scene.intruder.send(move, ids(8), ids(8)))
    named = Grant(id=_rid(), owner=decode, grantee="evil", read=True, grantee_user=f"uid:{NOBODY}")
    assert isinstance(scene.call(named), Ok)
    assert scene.intruder.send(move, ids(8), ids(8))["type"] == "moved"
    for g in (grant, named):  # revoked: the door shuts again
        revoke = msgspec.structs.replace(g, id=_rid(), read=False, write=False)
        assert isinstance(scene.call(revoke), Ok)
    assert _refused(scene.intruder.send(move, ids(8), ids(8)))


def test_grant_does_not_pass_to_a_new_holder_of_the_name(scene: Scene) -> None:
    with Raw(scene.daemon.config.endpoint) as helper:
        assert isinstance(scene.register("helper", raw=helper), Registered)
        grant = Grant(id=_rid(), owner=WorkerRef("decode"), grantee="helper", read=True)
        assert isinstance(scene.call(grant), Ok)
        assert isinstance(helper.call(Unregister(id=_rid(), worker=WorkerRef("helper"))), Ok)
    assert scene.intruder.register("helper")["type"] == "registered"
    move = Move(
        id=_rid(), src=BufferSetRef(WorkerRef("decode")), dst=BufferSetRef(WorkerRef("helper"))
    )
    out = scene.intruder.send(move, ids(6), ids(6))
    assert _refused(out), out
    assert not scene.intruder.holds_victim_bytes()


def test_a_registered_connections_routing_id_is_worthless_to_another_uid(scene: Scene) -> None:
    """The binding is to (connection, uid): reusing a left connection's routing id gives nothing.

    Routing ids the ROUTER makes up start with a zero byte, which no peer may claim; a client
    that chooses its own (any ZeroMQ client may) could be impersonated by name alone.
    """
    stolen = b"victim-conn"
    victim = Raw(scene.daemon.config.endpoint, routing_id=stolen)
    try:
        assert isinstance(scene.register("stolen", raw=victim, host_blocks=4), Registered)
    finally:
        victim.close()  # its worker stays registered: its fd channel is still open
    ref = WorkerRef("stolen")
    offload = Move(id=_rid(), src=BufferSetRef(ref), dst=BufferSetRef(ref, "host"))
    deadline = time.monotonic() + 10
    out = scene.intruder.send(offload, ids(7), ids(0), routing_id=stolen)
    while out["type"] == "no_reply" and time.monotonic() < deadline:  # until the ROUTER let go
        out = scene.intruder.send(offload, ids(7), ids(0), routing_id=stolen)
    assert _refused(out), out


# ------------------------------------------------------------------ the peer plane


class PeerSocket:
    """A raw DEALER on the daemon's peer endpoint with the cluster key (another daemon's seat)."""

    def __init__(self, endpoint: str) -> None:
        keys = load_keypair(cluster_key())
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.CURVE_SERVERKEY, keys.public)
        self.sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        self.sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
        self.sock.connect(endpoint)

    def read(self, request_id: str, ranges: list[tuple[int, int, int]]) -> PeerReply:
        msg = ReadBlocks(
            id=_rid(),
            engine_id="decode",
            tp_rank=0,
            pp_rank=0,
            request_id=request_id,
            layers=["l0"],
        )
        frame = np.array(ranges, dtype="<i8").reshape(-1, 3).tobytes()
        self.sock.send_multipart([msgspec.msgpack.encode(msg), frame])
        assert self.sock.poll(10_000), "no peer reply"
        frames = self.sock.recv_multipart()
        return msgspec.msgpack.decode(frames[0], type=PeerReply)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def peer(scene: Scene) -> Iterator[PeerSocket]:
    p = PeerSocket(scene.daemon.config.peer_endpoint)
    yield p
    p.close()


def _publish(scene: Scene, request_id: str, blocks: list[int], lease_s: float = 0.0) -> None:
    msg = Publish(id=_rid(), engine_id="decode", request_id=request_id, lease_s=lease_s)
    assert isinstance(scene.call(msg, ids(*blocks)), Ok)


def _block(b: int) -> tuple[int, int, int]:
    return (0, b * ROW, ROW)


def test_peer_reads_need_a_published_request(scene: Scene, peer: PeerSocket) -> None:
    refused = peer.read("never-published", [_block(1)])
    assert isinstance(refused, PeerError) and refused.code == "expired", refused
    _publish(scene, "open", [1, 2])
    assert isinstance(peer.read("open", [_block(1), _block(2)]), ReadData)  # the control case


def test_peer_reads_stay_inside_the_published_blocks(scene: Scene, peer: PeerSocket) -> None:
    _publish(scene, "narrow", [1])
    for ranges in ([_block(5)], [(0, ROW, 2 * ROW)], [(0, 16 * ROW + 5 * ROW, ROW)]):
        out = peer.read("narrow", ranges)
        assert isinstance(out, PeerError) and out.code == "out_of_range", (ranges, out)


def test_peer_read_count_near_2_63_is_out_of_range(scene: Scene, peer: PeerSocket) -> None:
    _publish(scene, "overflow", list(range(16)))
    for ranges in ([(0, ROW, (1 << 63) - 1)], [(0, (1 << 63) - 1, 1)], [(0, 0, -1)]):
        out = peer.read("overflow", ranges)
        assert isinstance(out, PeerError) and out.code == "out_of_range", (ranges, out)


def test_expired_and_forgotten_requests_stay_closed(scene: Scene, peer: PeerSocket) -> None:
    """Past its lease a request is refused, also once so many others expired it is forgotten."""
    _publish(scene, "old", [3], lease_s=0.2)
    n = 4200  # more than the producer remembers as expired (4096)
    for batch in range(0, n, 500):  # pipelined, in batches the reply queue holds whole
        for i in range(batch, min(n, batch + 500)):
            msg = Publish(id=_rid(), engine_id="decode", request_id=f"filler-{i}", lease_s=0.2)
            scene.root.send(msg, ids(4))
        for _ in range(batch, min(n, batch + 500)):
            assert scene.root.sock.poll(10_000), "publish not answered"
            scene.root.sock.recv_multipart()
    time.sleep(1.5)  # every lease above ended; the sweep runs every 0.25 s at the latest
    for request_id in ("old", "filler-4199"):
        out = peer.read(request_id, [_block(3 if request_id == "old" else 4)])
        assert isinstance(out, PeerError) and out.code == "expired", (request_id, out)


def test_status_describes_the_senders_own_engines_and_an_administrator_sees_all(
    scene: Scene,
) -> None:
    """Another uid's ``status`` names its own engines only (not "decode", root's); root's worker
    connection sees root's; a connection of the daemon's own uid that registered nothing (the
    operator's ``kvsidecar status``) sees every engine."""
    out = scene.intruder.send(Status(id=_rid()))
    assert out["type"] == "status_reply", out
    seen = {e["engine_id"] for e in out["reply"]["engines"]}
    assert "evil" in seen and "decode" not in seen, seen  # its own (this module made several)
    assert "decode" not in json.dumps(out["reply"])
    mine = scene.call(Status(id=_rid()))
    assert isinstance(mine, StatusReply)
    assert "evil" not in {e.engine_id for e in mine.engines} and "decode" in {
        e.engine_id for e in mine.engines
    }
    with Raw(scene.daemon.config.endpoint) as admin:
        every = admin.call(Status(id=_rid()))
    assert isinstance(every, StatusReply)
    assert {"evil", "decode"} <= {e.engine_id for e in every.engines}


def test_heartbeat_answers_only_about_the_senders_own_engines(scene: Scene) -> None:
    """Another uid's heartbeat naming root's worker is answered as if no such engine existed,
    and renews nothing; root's own and the administrator's heartbeats are served."""
    victim = WorkerRef("decode")

    def lease_left() -> float:
        with Raw(scene.daemon.config.endpoint) as admin:
            every = admin.call(Status(id=_rid()))
        assert isinstance(every, StatusReply)
        (engine,) = [e for e in every.engines if e.engine_id == "decode"]
        return engine.workers[0].lease_left_s

    time.sleep(1.0)  # the victim's lease (60 s) is visibly running down
    before = lease_left()
    assert before < 59.5, before
    probe = scene.intruder.send(Heartbeat(id=_rid(), workers=[victim]))
    nothing = scene.intruder.send(Heartbeat(id=_rid(), workers=[WorkerRef("no-such-engine")]))
    assert probe["type"] == "error" and probe["code"] == nothing["code"], (probe, nothing)
    assert probe["reply"]["message"] == nothing["reply"]["message"].replace(
        "no-such-engine", "decode"
    ), (probe, nothing)
    assert lease_left() <= before, "another uid's heartbeat renewed root's lease"
    # Its own worker, and several at once: renewed (the control case).
    mine = scene.intruder.send(Heartbeat(id=_rid(), workers=[WorkerRef("evil")]))
    assert mine["type"] == "ok", mine
    both = scene.intruder.send(Heartbeat(id=_rid(), workers=[WorkerRef("evil"), victim]))
    assert both["type"] == "error", both  # all or none
    assert isinstance(scene.call(Heartbeat(id=_rid(), workers=[victim])), Ok)
    assert lease_left() > 59.0


def test_refusals_do_not_name_another_users_engines_owner(scene: Scene) -> None:
    """A refused command tells its sender what it may not do, not who holds the engine."""
    mover = Move(
        id=_rid(), src=BufferSetRef(WorkerRef("decode")), dst=BufferSetRef(WorkerRef("evil"))
    )
    outs = [
        scene.intruder.send(mover, ids(1), ids(1)),
        scene.intruder.register("decode"),
        scene.intruder.send(
            Pull(
                id=_rid(),
                engine_id="evil",
                remote_endpoint="",
                remote_engine_id="decode",
                items=[PullItem("r", 1, 1)],
            ),
            ids(1),
            ids(1),
        ),
    ]
    for out in outs:
        assert out["type"] == "error", out
        assert f"uid:{os.geteuid()}" not in json.dumps(out), out


def test_one_users_unread_publishes_are_bounded_and_leave_others_theirs(scene: Scene) -> None:
    """``nobody`` publishes more requests than one user may hold unread: the ones past the
    bound are refused ``busy`` (its engine would free their blocks), and root's engine still
    publishes."""
    out = scene.intruder.ask(
        op="publish_many", engine="evil", count=MAX_PUBLISHED_PER_OWNER + 50, blocks=[1, 2]
    )
    assert out["counts"] == {"ok": MAX_PUBLISHED_PER_OWNER, "busy": 50}, out
    _publish(scene, "root-still-publishes", [3])
