"""Security: who may connect (ipc peer uid, tcp CURVE keys) and who may touch whose blocks.

Real sockets, a real second uid (``nobody``, via a child that drops privileges), real key files.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio

from kvsidecar.client import AsyncSidecarClient, BufferSetRef, SidecarError, WorkerRef
from kvsidecar.daemon.limits.access import AccessControl, EngineId
from kvsidecar.daemon.server import Daemon
from kvsidecar.memory import allocate_kv_caches
from kvsidecar.node.auth import DomainPolicy, ZapHandler
from kvsidecar.node.config import Config, ConfigError
from kvsidecar.node.registry import Engine
from kvsidecar.wire.curve import KeyFileError, keygen, load_authorized_keys, load_keypair
from tests.support import ROOT, python_env
from tests.support.daemons import make_config, open_to_every_uid, run_daemon
from tests.support.ports import tcp_endpoint

pytestmark = pytest.mark.timeout(60)

NOBODY = 65534
SHAPE = (2, 16, 4, 2, 8)


# ------------------------------------------------------------------ ipc: peer uid


async def _as_nobody(config: Config) -> dict[str, Any]:
    proc = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "tests.procs.uid_client",
            str(NOBODY),
            config.endpoint,
            config.fd_socket,
        ],
        cwd=ROOT,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["uid"] == NOBODY
    return result


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")


@needs_root
async def test_private_directory_keeps_another_uid_out() -> None:
    """Layer 1: the runtime dir is 0700, so nobody cannot even reach the sockets."""
    config = make_config()
    async with run_daemon(config) as daemon:
        assert stat.S_IMODE(os.stat(config.runtime_dir).st_mode) == 0o700
        result = await _as_nobody(config)
        assert result["fd"] == "PermissionError"
        assert result["zmq"] == "no reply"
        assert daemon.zap is not None and daemon.zap.stats.refused == 0  # never got that far


@needs_root
async def test_peer_uid_check_refuses_another_uid_with_open_permissions() -> None:
    """Layer 2: with the path traversable and the sockets 0666, the uid check alone refuses."""
    config = make_config()
    async with run_daemon(config) as daemon:
        open_to_every_uid(config)
        result = await _as_nobody(config)
        assert result["zmq"] == "no reply", result
        assert result["fd"] == "closed", result  # the fd channel's SO_PEERCRED check
        assert daemon.zap is not None
        assert daemon.zap.stats.refused >= 1
        assert f"uid {NOBODY} not allowed" in daemon.zap.stats.last_refused
        # Everyone else is still served.
        async with AsyncSidecarClient(config.endpoint, heartbeat=False) as c:
            assert (await c.status()).engines == []


@needs_root
async def test_allowed_uid_is_served() -> None:
    """The control experiment: the same child, allowed by the list, gets its reply."""
    config = make_config(allowed_uids=f"{os.geteuid()},{NOBODY}")
    async with run_daemon(config) as daemon:
        open_to_every_uid(config)
        result = await _as_nobody(config)
        assert result["zmq"] == "HelloReply", result
        assert result["fd"] == "open", result
        assert daemon.zap is not None and daemon.zap.stats.refused == 0


def test_zap_answers() -> None:
    """The handler's decisions, request by request (RFC 27 frames)."""
    handler = ZapHandler(zmq.asyncio.Context.instance())
    handler.policies["d"] = DomainPolicy(uids=frozenset({1000}))

    def ask(address: bytes, mechanism: bytes = b"NULL", domain: bytes = b"d") -> bytes:
        return handler.answer([b"1.0", b"7", domain, address, b"", mechanism])[2]

    assert ask(b"localhost:1000:1000:42") == b"200"
    assert ask(b"localhost:1001:1000:42") == b"400"
    assert ask(b"127.0.0.1") == b"400"  # plain tcp, not allowed
    assert ask(b"localhost:1000:1000:42", domain=b"other") == b"400"
    assert ask(b"localhost:1000:1000:42", mechanism=b"PLAIN") == b"400"
    assert handler.answer([b"1.0"])[2] == b"500"
    assert handler.stats.accepted == 1 and handler.stats.refused == 4


# ------------------------------------------------------------------ tcp: CurveZMQ


def test_keygen_files(tmp_path: Path) -> None:
    public, secret = keygen(tmp_path, "node")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    pair = load_keypair(secret)
    assert load_authorized_keys(public) == {pair.public}
    assert load_authorized_keys(tmp_path) == {pair.public}
    with pytest.raises(FileExistsError):
        keygen(tmp_path, "node")
    os.chmod(secret, 0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        load_keypair(secret)
    # A bad key file is a configuration error (exit code 3 in the CLI), found as the settings
    # are read, before anything starts.
    with pytest.raises(ConfigError, match="chmod 600"):
        Config(
            runtime_dir=str(tmp_path),
            endpoint="tcp://127.0.0.1:5555",
            curve_secret_key=str(secret),
        )


def test_tcp_needs_keys_or_insecure(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="curve_secret_key"):
        Config(runtime_dir=str(tmp_path), endpoint="tcp://127.0.0.1:5555")
    plain = Config(runtime_dir=str(tmp_path), endpoint="tcp://127.0.0.1:5555", insecure=True)
    assert plain.endpoint == "tcp://127.0.0.1:5555" and plain.insecure
    with pytest.raises(ConfigError, match="allowed_uids"):
        Config(runtime_dir=str(tmp_path), allowed_uids="root")


@pytest.fixture
async def curve_daemon(tmp_path: Path) -> AsyncIterator[tuple[Daemon, Path]]:
    _, server_secret = keygen(tmp_path / "server", "daemon")
    keygen(tmp_path / "clients", "worker")
    async with run_daemon(
        lambda: make_config(
            endpoint=tcp_endpoint(),
            curve_secret_key=str(server_secret),
            curve_authorized_keys=str(tmp_path / "clients"),
        )
    ) as daemon:
        yield daemon, tmp_path


async def test_curve_client_with_authorized_key_is_served(
    curve_daemon: tuple[Daemon, Path],
) -> None:
    daemon, keys = curve_daemon
    server = load_keypair(keys / "server" / "daemon.key_secret").public
    mine = load_keypair(keys / "clients" / "worker.key_secret")
    async with AsyncSidecarClient(
        daemon.config.endpoint, heartbeat=False, curve=(server, mine), timeout_s=5
    ) as c:
        assert (await c.status()).endpoint == daemon.config.endpoint
    assert daemon.zap is not None and daemon.zap.stats.accepted >= 1
    assert daemon.control is not None and not daemon.control.insecure


async def test_curve_refuses_unknown_key_and_plain_text(curve_daemon: tuple[Daemon, Path]) -> None:
    daemon, keys = curve_daemon
    server = load_keypair(keys / "server" / "daemon.key_secret").public
    keygen(keys / "stranger", "x")
    stranger = load_keypair(keys / "stranger" / "x.key_secret")
    for curve in ((server, stranger), None):
        c = AsyncSidecarClient(daemon.config.endpoint, heartbeat=False, curve=curve, timeout_s=1)
        with pytest.raises(SidecarError) as info:
            await c.start()
        await c.close()
        assert info.value.code == "timeout"
    assert daemon.zap is not None
    assert daemon.zap.stats.refused_by_reason.get("CURVE key not authorized", 0) >= 1
    # A plain-text client never reaches ZAP: libzmq drops it at the greeting (NULL vs CURVE).


async def test_plain_tcp_only_when_insecure() -> None:
    async with run_daemon(lambda: make_config(endpoint=tcp_endpoint(), insecure=True)) as daemon:
        async with AsyncSidecarClient(daemon.config.endpoint, heartbeat=False) as c:
            assert (await c.status()).endpoint == daemon.config.endpoint
        assert daemon.control is not None and daemon.control.insecure
        registry = daemon.observability.registry
        assert registry.get_sample_value("kvsidecar_insecure_transport") == 1


# ------------------------------------------------------------------ grants


def _caches(seed: int) -> list[torch.Tensor]:
    caches = allocate_kv_caches(1, SHAPE, torch.float16)
    caches[0].copy_(torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).half())
    return caches


async def test_engines_need_grants_to_touch_each_other() -> None:
    config = make_config()
    a_mem, b_mem = _caches(1), _caches(2)
    async with (
        run_daemon(config),
        AsyncSidecarClient(config.endpoint) as a,
        AsyncSidecarClient(config.endpoint) as b,
        AsyncSidecarClient(config.endpoint, heartbeat=False) as admin,
    ):
        await a.register_kv_caches({"l0": a_mem[0]}, engine_id="a", host_blocks=4)
        await b.register_kv_caches({"l0": b_mem[0]}, engine_id="b", host_blocks=4)
        A, B = BufferSetRef(WorkerRef("a")), BufferSetRef(WorkerRef("b"))
        before_a, before_b = a_mem[0].clone(), b_mem[0].clone()

        async def refused(coro: Any) -> str:
            with pytest.raises(SidecarError) as info:
                await coro
            assert info.value.code == "forbidden", info.value
            return info.value.message

        assert "may not write engine 'b'" in await refused(a.move(A, B, [1], [2]))
        assert "may not read engine 'b'" in await refused(a.move(B, A, [1], [2]))
        await refused(a.host_alloc("b", 1))
        await refused(a.offload(WorkerRef("b"), [1], [0]))
        await refused(
            a.fix_layout(WorkerRef("b"), [1], remote_memory_order="NHD", remote_block_size=4)
        )
        await refused(a.unregister(WorkerRef("b")))
        await refused(a.grant("a", owner=WorkerRef("b"), write=True))  # not b's owner
        assert torch.equal(a_mem[0], before_a) and torch.equal(b_mem[0], before_b)

        await b.grant("a", read=False, write=True)  # a may write b, still not read it
        await a.move(A, B, [1], [2])
        assert torch.equal(b_mem[0][:, 2], a_mem[0][:, 1])
        await refused(a.move(B, A, [3], [4]))
        await b.grant("a", read=True, write=True)
        await a.move(B, A, [3], [4])
        assert torch.equal(a_mem[0][:, 4], b_mem[0][:, 3])
        await b.grant("a", read=False, write=False)  # revoked
        await refused(a.move(A, B, [5], [6]))
        # An administrative client (the daemon's own uid, nothing registered) may do anything.
        await admin.move(A, B, [7], [8])
        assert torch.equal(b_mem[0][:, 8], a_mem[0][:, 7])


def test_register_into_another_users_engine_is_refused() -> None:
    engines: dict[str, Engine] = {}
    acl = AccessControl(admin_uids=[0], lookup=engines.get)
    engines["e"] = Engine("e", "", 1, 1, 1, 0, None, epoch=7, owner="uid:1000")
    owner = acl.principal(b"x", "uid:1000")
    acl.bind(owner, WorkerRef("e"), EngineId("e", 7))
    stranger = acl.principal(b"y", "uid:1001")
    same_user = acl.principal(b"z", "uid:1000")
    admin = acl.principal(b"w", "uid:0")
    with pytest.raises(SidecarError, match="another user"):
        acl.check_register(stranger, "e")
    with pytest.raises(SidecarError, match="another user"):
        acl.check_register(admin, "e")  # administrators do not join another user's engine
    acl.check_register(same_user, "e")  # another rank of the same engine, same user
    assert not stranger.admin and admin.admin
    assert not acl.may(stranger, "e", write=False)
    # the binding is to (connection, user): the same routing id under another uid is nobody
    assert acl.principal(b"x", "uid:1001").engines == frozenset()
    assert acl.principal(b"x", "uid:1000").engines == {EngineId("e", 7)}
    del engines["e"]
    acl.drop_engine(EngineId("e", 7))
    acl.check_register(stranger, "e")  # gone: the name is free again


def test_a_principal_follows_its_connections_bindings() -> None:
    """`AccessControl.principal` keeps its answers: a binding made or ended changes them at once."""
    engines: dict[str, Engine] = {}
    acl = AccessControl(admin_uids=[0], lookup=engines.get)
    engines["e"] = Engine("e", "", 1, 1, 1, 0, None, epoch=7, owner="uid:1000")
    before = acl.principal(b"x", "uid:1000")
    assert before.engines == frozenset() and not acl.may(before, "e", write=True)
    assert acl.principal(b"x", "uid:1000") is before  # asked again: the same answer
    acl.bind(before, WorkerRef("e", 0), EngineId("e", 7))
    acl.bind(before, WorkerRef("e", 1), EngineId("e", 7))
    bound = acl.principal(b"x", "uid:1000")
    assert bound.engines == {EngineId("e", 7)} and acl.may(bound, "e", write=True)
    assert acl.principal(b"y", "uid:1000").engines == frozenset()  # another connection
    acl.unbind(WorkerRef("e", 0))
    assert acl.principal(b"x", "uid:1000").engines == {EngineId("e", 7)}  # rank 1 is left
    acl.unbind(WorkerRef("e", 1))
    after = acl.principal(b"x", "uid:1000")
    assert after.engines == frozenset() and not acl.may(after, "e", write=True)
    # The daemon's own uid with nothing bound is an administrator; bound, it is its engine's.
    admin = acl.principal(b"w", "uid:0")
    assert admin.admin
    acl.bind(admin, WorkerRef("f"), EngineId("f", 9))
    assert not acl.principal(b"w", "uid:0").admin


async def test_peer_endpoint_refuses_daemons_without_the_cluster_key(tmp_path: Path) -> None:
    """The peer endpoint takes CURVE peers with an authorized key only (here: the cluster's)."""
    _, cluster = keygen(tmp_path / "cluster", "cluster")
    keygen(tmp_path / "other", "other")
    async with run_daemon(
        lambda: make_config(
            peer_endpoint=tcp_endpoint(), peer_data_plane="zmq", curve_secret_key=str(cluster)
        )
    ) as daemon:
        assert daemon.peer is not None
        zap = daemon.peer._zap
        assert zap is not None
        server = load_keypair(cluster).public
        ctx = zmq.asyncio.Context.instance()
        for keys in (load_keypair(tmp_path / "other" / "other.key_secret"), load_keypair(cluster)):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.CURVE_SERVERKEY, server)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
            sock.connect(daemon.config.peer_endpoint)
            for _ in range(100):  # the handshake (and its ZAP verdict) needs no message
                if zap.stats.refused + zap.stats.accepted >= (1 if keys.public != server else 2):
                    break
                await asyncio.sleep(0.02)
            sock.close()
        assert zap.stats.refused_by_reason == {"CURVE key not authorized": zap.stats.refused}
        assert zap.stats.refused >= 1 and zap.stats.accepted >= 1
