"""Node-to-node pulls between two daemon processes, bytes checked against plain indexing.

One producer daemon and one consumer daemon (each with a NIXL agent when NIXL is installed),
one producer worker process registering every producer engine and one consumer worker process
registering every consumer engine: each case is a pair of engines with its own sizes, so the
whole matrix runs on four processes. Expectations come from `expected_rank` (the producer's
seeded values, indexed by hand), never from the daemon's code. Each pull starts from the
consumer's initial values (the worker refills them), so a data plane that moves nothing fails.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvsidecar.client import SidecarClient
from kvsidecar.peer.nixl_plane import nixl_available
from kvsidecar.wire.errors import SidecarError
from tests.procs.peer_worker import global_layer, rank_heads, rank_values
from tests.support.children import peer_workers
from tests.support.daemons import peer_daemon
from tests.support.ports import tcp_endpoint

pytestmark = pytest.mark.timeout(180)

BASE = {"layers": 2, "blocks": 24, "block_size": 16, "heads": 8, "head_size": 16}
# name: (producer overrides, consumer overrides)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "same_tp": ({"tp_size": 2, "order": "HND"}, {"tp_size": 2, "order": "HND"}),
    "tp2_to_4": ({"tp_size": 2, "order": "HND"}, {"tp_size": 4, "order": "HND"}),
    "tp4_to_2": ({"tp_size": 4, "order": "HND"}, {"tp_size": 2, "order": "HND"}),
    "tp1_to_8": ({"tp_size": 1, "order": "HND"}, {"tp_size": 8, "order": "HND"}),
    "tp8_to_1": ({"tp_size": 8, "order": "HND"}, {"tp_size": 1, "order": "HND"}),
    "bs16_to_64": (
        {"tp_size": 1, "order": "HND"},
        {"tp_size": 1, "order": "HND", "block_size": 64},
    ),
    "hnd_to_nhd": ({"tp_size": 2, "order": "HND"}, {"tp_size": 2, "order": "NHD"}),
    "tp2_to_4_bs_nhd": (
        {"tp_size": 2, "order": "HND", "block_size": 8},
        {"tp_size": 4, "order": "NHD", "block_size": 32},
    ),
    "mla_tp2_to_1": (
        {"tp_size": 2, "arrangement": "mla", "heads": 1, "head_size": 64},
        {"tp_size": 1, "arrangement": "mla", "heads": 1, "head_size": 64, "block_size": 32},
    ),
    "incompatible": ({"tp_size": 1, "model_hash": "llama"}, {"tp_size": 1, "model_hash": "qwen"}),
}


def engines() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    producers, consumers = [], []
    for i, (name, (p, c)) in enumerate(CASES.items()):
        producers.append({**BASE, "engine": f"{name}-p", "seed": 100 + i, **p})
        consumers.append({**BASE, "engine": f"{name}-c", "seed": 200 + i, **c})
    return producers, consumers


class Cluster:
    def __init__(self, prod: Any, cons: Any, pw: Any, cw: Any, specs: Any) -> None:
        self.prod, self.cons, self.pw, self.cw = prod, cons, pw, cw
        self.producers = {e["engine"]: e for e in specs[0]}
        self.consumers = {e["engine"]: e for e in specs[1]}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    plane = "auto" if nixl_available() else "zmq"
    specs = engines()
    with (
        # Trusted: NIXL is refused otherwise (docs/reliability.md); these daemons trust each other.
        peer_daemon(peer_data_plane=plane, peer_nixl_trusted=True) as prod,
        # Reads cut into 4 KiB chunks over three data streams: every pull below spreads many
        # chunks over several connections and threads, and is still checked byte by byte.
        peer_daemon(
            peer_data_plane=plane,
            peer_nixl_trusted=True,
            peer_endpoint="",
            peer_streams=3,
            peer_chunk_bytes=4096,
        ) as cons,
        peer_workers({"endpoints": [prod.config.endpoint], "engines": specs[0]}) as pw,
        peer_workers({"endpoints": [cons.config.endpoint], "engines": specs[1]}) as cw,
    ):
        yield Cluster(prod, cons, pw, cw, specs)


PLANES = [
    "zmq",
    pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="no nixl")),
]


def _ids(case: str) -> tuple[dict[str, tuple[list[int], list[int]]], int]:
    p, c = CASES[case]
    ratio = c.get("block_size", BASE["block_size"]) // p.get("block_size", BASE["block_size"])
    # Two requests; runs, gaps and reversed order so coalescing and scattering are exercised.
    a_local = [3, 4, 5, 11]
    b_local = [20, 1]
    a_remote = [2, 3, 4, 5, 6, 7, 19, 0, 13, 14, 15, 16, 9, 10, 21, 22][: ratio * 4 - 1 or 3]
    if ratio == 1:
        a_remote = [7, 8, 9, 2]
    b_remote = [23, 22, 1, 12, 17, 18, 5, 6][: ratio * 2]
    return {"req-a": (a_remote, a_local), "req-b": (b_remote, b_local)}, ratio


def expected_rank(
    producer: dict[str, Any],
    consumer: dict[str, Any],
    rank: int,
    layer: int,
    remote_ids: Sequence[int],
    local_ids: Sequence[int],
    before: np.ndarray | None = None,
) -> np.ndarray:
    """A consumer rank's layer after the pull, by plain indexing of the producer's values."""
    out = (rank_values(consumer, rank, layer) if before is None else before).copy()
    g = global_layer(producer, layer)
    ratio = consumer["block_size"] // producer["block_size"]
    n = producer["block_size"]
    mla = consumer.get("arrangement", "kv_first") == "mla"
    for j, lb in enumerate(local_ids):
        rb = list(remote_ids[j * ratio : (j + 1) * ratio])
        if not rb:
            continue
        if mla:
            out[lb, : len(rb) * n] = np.concatenate([g[b] for b in rb], axis=0)
        else:
            tokens = np.concatenate([g[:, b] for b in rb], axis=1)
            out[:, lb, : len(rb) * n] = tokens[:, :, rank_heads(consumer, rank)]
    return out


def _check(cluster: Cluster, case: str, requests: Any, tmp: Path) -> None:
    prod = cluster.producers[f"{case}-p"]
    cons = cluster.consumers[f"{case}-c"]
    got = cluster.cw.dump_all(tmp)
    ratio = cons["block_size"] // prod["block_size"]
    mla = cons.get("arrangement", "kv_first") == "mla"
    for rank in range(cons["tp_size"]):
        for layer in range(cons["layers"]):
            want = None
            for remote, local in requests.values():
                want = expected_rank(prod, cons, rank, layer, remote, local, before=want)
            have = got[f"{case}-c.r{rank}.l{layer}"]
            assert want is not None
            for remote, local in requests.values():
                # A partly filled last block: tokens past the request are undefined after the
                # layout fix (it rearranges whole blocks), so they are not compared.
                filled = (len(remote) - ratio * (len(local) - 1)) * prod["block_size"]
                if filled < cons["block_size"]:
                    for arr in (want, have):
                        if mla:
                            arr[local[-1], filled:] = 0
                        else:
                            arr[:, local[-1], filled:] = 0
            np.testing.assert_array_equal(have, want)


@pytest.mark.parametrize("plane", PLANES)
@pytest.mark.parametrize("case", [c for c in CASES if c != "incompatible"])
def test_pull_bytes(cluster: Cluster, case: str, plane: str, tmp_path: Path) -> None:
    requests, _ = _ids(case)
    with (
        SidecarClient(cluster.prod.config.endpoint) as pc,
        SidecarClient(cluster.cons.config.endpoint) as cc,
    ):
        pc.take_peer_events()
        cc.take_peer_events()
        # The other plane's test may have pulled the same blocks: back to the initial values.
        cluster.cw.refill()
        for rid, (remote, _) in requests.items():
            pc.publish(f"{case}-p", f"{plane}-{rid}", remote)
        pulled = cc.pull(
            f"{case}-c",
            cluster.prod.config.peer_endpoint,
            f"{case}-p",
            requests,
            remote_request_ids={rid: f"{plane}-{rid}" for rid in requests},
            plane=plane,
        )
        assert pulled.failed == [], pulled.error
        assert sorted(pulled.finished) == sorted(requests)
        assert pulled.plane == plane
        _check(cluster, case, requests, tmp_path)
        recv = cc.take_peer_events(f"{case}-c")
        assert set().union(*(e.finished_recving for e in recv)) == set(requests)
        # Every producer rank was read by all its readers: finished_sending for both requests.
        deadline = time.monotonic() + 5
        sent: set[str] = set()
        while time.monotonic() < deadline and len(sent) < len(requests):
            sent |= set().union(*(e.finished_sending for e in pc.take_peer_events(f"{case}-p")))
            time.sleep(0.05)
        assert sent == {f"{plane}-{rid}" for rid in requests}


def test_incompatible_handshake(cluster: Cluster) -> None:
    with SidecarClient(cluster.cons.config.endpoint) as cc:
        cc.take_peer_events()
        with pytest.raises(SidecarError) as err:
            cc.pull(
                "incompatible-c",
                cluster.prod.config.peer_endpoint,
                "incompatible-p",
                {"r": ([1, 2], [3, 4])},
            )
        assert err.value.code == "incompatible_peer"
        assert "model_hash 'qwen' here vs 'llama'" in err.value.message
        (event,) = cc.take_peer_events("incompatible-c")
        assert event.failed_recving == {"r"} and event.invalid_block_ids == {3, 4}
        assert cc.status().engines  # still serving


def test_unreachable_peer(cluster: Cluster) -> None:
    with SidecarClient(cluster.cons.config.endpoint) as cc:
        cc.take_peer_events()
        started = time.monotonic()
        pulled = cc.pull("same_tp-c", tcp_endpoint(), "same_tp-p", {"r": ([1], [5])})
        took = time.monotonic() - started
        assert pulled.failed == ["r"] and pulled.invalid_block_ids == [5]
        assert pulled.error_code == "peer_unavailable"
        assert took < cluster.cons.config.peer_handshake_timeout_s + 1.5
        (event,) = cc.take_peer_events("same_tp-c")
        assert event.failed_recving == {"r"} and event.invalid_block_ids == {5}


def test_lease_expiry_releases_unread_blocks(cluster: Cluster) -> None:
    with (
        SidecarClient(cluster.prod.config.endpoint) as pc,
        SidecarClient(cluster.cons.config.endpoint) as cc,
    ):
        pc.take_peer_events()
        pc.publish("same_tp-p", "never-read", [1, 2, 3], lease_s=0.5)
        deadline = time.monotonic() + 3
        events = []
        while time.monotonic() < deadline and not events:
            events = pc.take_peer_events("same_tp-p")
            time.sleep(0.05)
        (event,) = events
        assert event.finished_sending == {"never-read"} == event.expired_sending
        # A late reader is refused: its request fails, nothing is read.
        pulled = cc.pull(
            "same_tp-c",
            cluster.prod.config.peer_endpoint,
            "same_tp-p",
            {"late": ([1, 2, 3], [6, 7, 8])},
            remote_request_ids={"late": "never-read"},
            plane="zmq",
        )
        assert pulled.failed == ["late"] and "expired" in pulled.error
        assert pulled.invalid_block_ids == [6, 7, 8]


@pytest.mark.parametrize("plane", PLANES)
def test_a_pull_reads_only_the_blocks_published_for_its_prompt(
    cluster: Cluster, plane: str, tmp_path: Path
) -> None:
    """The producer's daemon answers each request of a pull's handshake: on every plane a
    request is read only if it was published for the same prompt digest, and only its published
    blocks. A refused request fails without a byte read; the others of the pull go on."""
    requests, _ = _ids("same_tp")
    ok_id = next(iter(requests))
    remote, local = requests[ok_id]
    spare = next(b for b in range(BASE["blocks"]) if b not in remote)
    with (
        SidecarClient(cluster.prod.config.endpoint) as pc,
        SidecarClient(cluster.cons.config.endpoint) as cc,
    ):
        cluster.cw.refill()
        rid = f"{plane}-digest"
        pc.publish("same_tp-p", rid, remote, prompt_digest="p" * 64)
        pulled = cc.pull(
            "same_tp-c",
            cluster.prod.config.peer_endpoint,
            "same_tp-p",
            {
                ok_id: (remote, local),
                "beside": ([*remote[:-1], spare], [0, 1, 2, 6]),
                "other-prompt": (remote, [7, 8, 9, 10]),
                "no-prompt": (remote, [12, 13, 14, 15]),
            },
            remote_request_ids=dict.fromkeys((ok_id, "beside", "other-prompt", "no-prompt"), rid),
            prompt_digests={ok_id: "p" * 64, "beside": "p" * 64, "other-prompt": "q" * 64},
            plane=plane,
        )
        assert pulled.finished == [ok_id], pulled.error
        assert sorted(pulled.failed) == ["beside", "no-prompt", "other-prompt"]
        assert sorted(pulled.invalid_block_ids) == [0, 1, 2, 6, 7, 8, 9, 10, 12, 13, 14, 15]
        assert pulled.nbytes > 0
        _check(cluster, "same_tp", {ok_id: (remote, local)}, tmp_path)
        cc.take_peer_events()
        pc.take_peer_events()
