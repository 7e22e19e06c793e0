"""Pulls between engines of one daemon (``remote_endpoint`` ""): disaggregated prefill on a node.

The producer publishes a request's blocks, the consumer's worker pulls them through the same
daemon, the producer's worker learns ``finished_sending`` from its own event queue
(``take_worker_events``). Bytes are compared with the producer's, block by block, and token by
token across block sizes (`tests.vllm.test_cpu_layout` writes the expectation from the layout's
definition).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvsidecar.client import SidecarClient, SidecarError
from kvsidecar.memory import allocate_kv_caches
from tests.support import ROOT
from tests.support.daemons import (
    DaemonProcess,
    StartDaemon,
    daemon_process,
    make_config,
    open_to_every_uid,
)
from tests.support.vllm_layout import packed_cache, packed_cache_from_block

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def daemon(module_daemon_factory: StartDaemon) -> DaemonProcess:
    return module_daemon_factory(host_pool_bytes=8 << 20, peer_lease_s=30.0)


def engine(endpoint: str, name: str, shape: tuple[int, ...], arrangement: str) -> SidecarClient:
    caches = allocate_kv_caches(2, shape, torch.bfloat16)
    gen = torch.Generator().manual_seed(len(name))
    for t in caches:
        t.copy_(torch.randn(t.shape, generator=gen))
    client = SidecarClient(endpoint, name=name)
    client.register_kv_caches(
        {f"layer{i}": t for i, t in enumerate(caches)},
        engine_id=name,
        arrangement=arrangement,  # type: ignore[arg-type]
    )
    client.caches = caches  # type: ignore[attr-defined]
    return client


def test_published_blocks_pulled_locally_and_the_producer_told(daemon: DaemonProcess) -> None:
    shape = (2, 16, 4, 2, 8)
    with (
        engine(daemon.config.endpoint, "prod", shape, "kv_first") as p,
        engine(daemon.config.endpoint, "cons", shape, "kv_first") as d,
    ):
        assert p.take_worker_events() == []  # subscribes the producer's worker
        p.publish("prod", "req-1", [3, 7, 1])
        before = [t.clone() for t in d.caches]  # type: ignore[attr-defined]
        pulled = d.submit_pull("cons", "", "prod", {"req-1": ([3, 7, 1], [5, 6, 9])}, tp_rank=0)
        out = pulled.result()
        assert out.finished == ["req-1"] and out.failed == [] and out.plane == "local"
        for src, dst, old in zip(p.caches, d.caches, before, strict=True):  # type: ignore[attr-defined]
            for s, t in ((3, 5), (7, 6), (1, 9)):
                assert torch.equal(dst[:, t], src[:, s])
            untouched = [b for b in range(16) if b not in (5, 6, 9)]
            assert torch.equal(dst[:, untouched], old[:, untouched])
        events = p.take_worker_events()
        assert [e.finished_sending for e in events] == [frozenset({"req-1"})]
        # A request that was never published is not read: the pull fails, nothing written.
        failed = d.submit_pull("cons", "", "prod", {"req-2": ([2], [2])}, tp_rank=0).result()
        assert failed.failed == ["req-2"] and failed.invalid_block_ids == [2]
        assert torch.equal(d.caches[0][:, 2], before[0][:, 2])  # type: ignore[attr-defined]


def test_a_local_pull_reads_only_the_blocks_published_for_its_prompt(
    daemon: DaemonProcess,
) -> None:
    """A consumer names its request, the producer's blocks and its prompt's digest: the daemon
    serves exactly the published blocks of a request published for that prompt.

    Each refused pull fails its request (every local block invalid) and writes nothing; the
    allowed one copies the published blocks. Refused: blocks beside the published ones (another
    user's prompt could be in them), a prompt digest other than the published one, none where
    one was published, and a request whose digest matches but whose blocks run past it.
    """
    shape = (2, 16, 4, 2, 8)
    with (
        engine(daemon.config.endpoint, "prod-d", shape, "kv_first") as p,
        engine(daemon.config.endpoint, "cons-d", shape, "kv_first") as d,
    ):
        p.publish("prod-d", "mine", [4, 5], prompt_digest="a" * 64)
        before = [t.clone() for t in d.caches]  # type: ignore[attr-defined]
        for remote, digest in (
            ([4, 5, 6], "a" * 64),  # block 6 was not published
            ([6], "a" * 64),
            ([4, 5], "b" * 64),  # another prompt
            ([4, 5], ""),
        ):
            local = list(range(9, 9 + len(remote)))
            out = d.submit_pull(
                "cons-d",
                "",
                "prod-d",
                {"x": (remote, local)},
                tp_rank=0,
                remote_request_ids={"x": "mine"},
                prompt_digests={"x": digest},
            ).result()
            assert out.failed == ["x"] and out.invalid_block_ids == local, (remote, digest, out)
            assert out.nbytes == 0 and "refused by the producer" in out.error
            for t, old in zip(d.caches, before, strict=True):  # type: ignore[attr-defined]
                assert torch.equal(t, old)
        out = d.submit_pull(
            "cons-d",
            "",
            "prod-d",
            {"x": ([5, 4], [9, 10])},
            tp_rank=0,
            remote_request_ids={"x": "mine"},
            prompt_digests={"x": "a" * 64},
        ).result()
        assert out.finished == ["x"], out
        for src, dst in zip(p.caches, d.caches, strict=True):  # type: ignore[attr-defined]
            assert torch.equal(dst[:, 9], src[:, 5]) and torch.equal(dst[:, 10], src[:, 4])


def test_local_pull_reblocks_vllm_cpu_32_into_64(daemon: DaemonProcess) -> None:
    heads, c = 2, 8
    with (
        engine(daemon.config.endpoint, "p32", (12, heads, 32, 2 * c), "vllm_cpu") as p,
        engine(daemon.config.endpoint, "d64", (8, heads, 64, 2 * c), "vllm_cpu") as d,
    ):
        tokens = 90  # three producer blocks, the last partly filled; two consumer blocks
        gen = torch.Generator().manual_seed(9)
        kv = []
        for cache in p.caches:  # type: ignore[attr-defined]
            k = torch.randn(tokens, heads, c, generator=gen).to(torch.bfloat16)
            v = torch.randn(tokens, heads, c, generator=gen).to(torch.bfloat16)
            blocks = packed_cache(k, v, 32)
            for j, b in enumerate((4, 9, 2)):
                cache[b].copy_(blocks[j])
            kv.append((k, v))
        p.publish("p32", "r", [4, 9, 2])
        out = d.submit_pull("d64", "", "p32", {"r": ([4, 9, 2], [6, 1])}, tp_rank=0).result()
        assert out.finished == ["r"], out
        for (k, v), cache in zip(kv, d.caches, strict=True):  # type: ignore[attr-defined]
            got = [packed_cache_from_block(cache[b], 64) for b in (6, 1)]
            for t in range(tokens):
                gk, gv = got[t // 64]
                assert torch.equal(gk[t % 64], k[t]) and torch.equal(gv[t % 64], v[t]), t


NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_another_user_sees_no_cache_and_pulls_nothing() -> None:
    """Namespaces and local pulls are per user: another uid's engine gets neither."""
    config = make_config(host_pool_bytes=8 << 20, allowed_uids=f"{os.geteuid()},{NOBODY}")
    with daemon_process(config) as daemon:
        open_to_every_uid(config)
        with engine(config.endpoint, "mine", (2, 16, 4, 2, 8), "kv_first") as mine:
            k_mine, k_theirs = b"\x01" * 32, b"\x02" * 32
            mine.submit_cache_store("fp", [k_mine], [1], capacity_bytes=1 << 20).result()
            mine.publish("mine", "req", [1])
            spec = {
                "uid": NOBODY,
                "endpoint": config.endpoint,
                "engine": "theirs",
                "fingerprint": "fp",
                "keys": [k_mine.hex()],
                "store_keys": [k_theirs.hex()],
                "pull_from": "mine",
                "request": "req",
            }
            proc = subprocess.run(
                [sys.executable, "-m", "tests.procs.cache_user", json.dumps(spec)],
                check=False,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert proc.returncode == 0, proc.stderr + daemon.log()
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            assert out["uid"] == NOBODY
            assert out["hits"] == 0  # my block, same fingerprint: not visible to them
            assert out["stored"] == 1  # they have a namespace of their own
            assert out["pull"] == "forbidden"
            assert mine.cache_lookup("fp", [k_theirs]).hits == 0  # theirs is not visible to me
            assert mine.cache_lookup("fp", [k_mine]).hits == 1


def test_a_prompt_digest_longer_than_its_limit_is_refused(daemon: DaemonProcess) -> None:
    with engine(daemon.config.endpoint, "prod-long", (2, 16, 4, 2, 8), "kv_first") as p:
        for call in (
            lambda: p.publish("prod-long", "r", [1], prompt_digest="x" * 129),
            lambda: p.submit_pull(
                "prod-long", "", "prod-long", {"r": ([1], [2])}, prompt_digests={"r": "x" * 129}
            ).result(),
        ):
            with pytest.raises(SidecarError) as err:
                call()
            assert err.value.code == "invalid_message" and "128" in err.value.message
        p.publish("prod-long", "r", [1], prompt_digest="x" * 128)  # the limit itself is fine
