"""The connector's two halves without vLLM: settings, keys, and the worker half on a real daemon.

`kvsidecar.integrations.vllm.worker.WorkerSide` and `scheduler.SchedulerSide` take plain values,
so their contracts with vLLM (tests/test_vllm.py runs them inside real engines) can also be
driven step by step here: what a load that the daemon cannot finish turns into, what a dead
daemon does to every kind of step, what one that answers late does to the scheduler, and how
the scheduler plans stores and refuses pulls it could only get wrong.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from kvsidecar.client import SidecarClient
from kvsidecar.integrations.vllm.keys import CacheFacts, shareable_hashes
from kvsidecar.integrations.vllm.layout import detect_layout
from kvsidecar.integrations.vllm.params import prompt_digest
from kvsidecar.integrations.vllm.plan import LoadSpec, PullSpec, StepPlan, StoreSpec
from kvsidecar.integrations.vllm.scheduler import Scheduled, SchedulerSide
from kvsidecar.integrations.vllm.settings import ConnectorSettings, SettingsError
from kvsidecar.integrations.vllm.worker import WorkerSide
from tests.support.daemons import DaemonProcess, daemon_process, make_config

pytestmark = pytest.mark.timeout(120)

FACTS = CacheFacts(
    model="m",
    revision="",
    dtype="torch.bfloat16",
    cache_dtype="auto",
    block_size=32,
    kv_cache_layout="LBHNC",
    num_kv_heads=2,
    head_size=32,
    num_layers=2,
    tp_size=1,
    hash_algo="sha256",
    device="cpu",
)


def test_settings_refuse_typos_and_wrong_types() -> None:
    s = ConnectorSettings.from_extra({"endpoint": "ipc:///x", "retry_s": 3, "prefix_cache": False})
    assert (s.daemon_endpoint, s.retry_s, s.prefix_cache) == ("ipc:///x", 3.0, False)
    for bad, why in (
        ({"retry": 1}, "unknown setting"),
        ({"retry_s": "3"}, "must be a number"),
        ({"prefix_cache": 1}, "true or false"),
        ({"cache_bytes": 1.5}, "integer"),
        ({"timeout_s": 0}, "> 0"),
    ):
        with pytest.raises(SettingsError, match=why):
            ConnectorSettings.from_extra(bad)


def test_fingerprint_and_model_hash() -> None:
    """Block size is in the namespace's name but not in the model hash pulls compare."""
    other_bs = dataclasses.replace(FACTS, block_size=64)
    assert FACTS.fingerprint() == dataclasses.replace(FACTS).fingerprint()
    assert FACTS.fingerprint() != other_bs.fingerprint()
    assert FACTS.model_hash() == other_bs.model_hash()
    assert FACTS.model_hash() != dataclasses.replace(FACTS, dtype="torch.float16").model_hash()
    assert shareable_hashes("sha256", {}) is None
    assert shareable_hashes("xxhash", {"PYTHONHASHSEED": "0"}) is None
    assert "PYTHONHASHSEED" in (shareable_hashes("xxhash_cbor", {}) or "")


def test_layouts_read_from_the_tensors() -> None:
    cpu = torch.zeros(4, 2, 32, 64)
    assert detect_layout(cpu, cpu_packing="vllm_cpu").name == "vllm_cpu"
    amx = detect_layout(cpu, cpu_packing="vllm_cpu_amx")
    assert (amx.arrangement, amx.name) == ("vllm_cpu_amx", "vllm_cpu_amx")
    assert detect_layout(cpu, cpu_packing=None).name == "opaque"
    assert detect_layout(torch.zeros(2, 4, 16, 2, 8), cpu_packing=None).name == "kv_first"
    assert detect_layout(torch.zeros(4, 2, 16, 2, 8), cpu_packing=None).name == "blocks_first"


# ------------------------------------------------------------------ the scheduler's plans


@dataclasses.dataclass
class Req:
    """The parts of vLLM's ``Request`` the scheduler half reads; the prompt is 0, 1, 2, ..."""

    request_id: str
    block_hashes: Sequence[bytes]
    num_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    prompt: list[int] | None = None
    mm_features: list[Any] = dataclasses.field(default_factory=list)
    prompt_embeds: Any = None
    lora_request: Any = None
    cache_salt: str | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(range(self.num_tokens)) if self.prompt is None else self.prompt

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def scheduler(settings: ConnectorSettings | None = None, **kw: Any) -> SchedulerSide:
    """A scheduler half; with no ``settings``, one with no daemon at all (every lookup a miss)."""
    if settings is None:
        settings = ConnectorSettings(endpoint="ipc:///nonexistent/x.sock", connect_timeout_s=0.2)
    args: dict[str, Any] = {
        "role": "kv_both",
        "engine_id": "e",
        "fingerprint": "fp",
        "block_size": 4,
        "tp_size": 1,
        "prefix_cache": True,
        "disaggregated": True,
    }
    return SchedulerSide(settings, **{**args, **kw})


def test_stores_cover_each_full_block_once_and_skip_what_the_engine_had() -> None:
    side = scheduler()
    hashes = [bytes([i]) * 32 for i in range(10)]
    req = Req("r", hashes[:3], num_tokens=13)
    assert side.lookup(req, num_computed_tokens=4) == (0, False)  # no daemon: a miss
    side.after_alloc(req, [10, 11, 12, 13], 0)
    plan = side.build([Scheduled("r", 4, 9, None)], [])
    assert [(s.keys, s.block_ids, s.request_id) for s in plan.stores] == [
        (hashes[1:3], [11, 12], "r")
    ]
    req.block_hashes = hashes[:4]  # a generated token filled block 3
    plan = side.build([Scheduled("r", 13, 3, [14])], [])
    assert [(s.keys, s.block_ids) for s in plan.stores] == [(hashes[3:4], [13])]
    last = side.build([Scheduled("r", 16, 1, None)], ["p"], ["f"])
    assert last.stores == [] and last.freed == ["p", "f"]
    assert side.request_finished(
        req, [10, 11, 12, 13, 14], num_computed_tokens=16, capped=True
    ) == (
        False,
        None,
    )


def handover(num_tokens: int, block_size: int, **kw: Any) -> dict[str, Any]:
    """The ``kv_transfer_params`` a producer returns for a prompt of ``num_tokens``."""
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prod",
        "remote_request_id": "p-1",
        "remote_block_ids": list(range(10, 10 + -(-num_tokens // block_size))),
        "remote_num_tokens": num_tokens,
        "remote_block_size": block_size,
        "remote_layout": "vllm_cpu",
        "remote_endpoint": "",
        "remote_daemon_id": "",
    }
    params.update(kw)
    return params


def test_pulls_that_the_daemon_could_not_re_block_are_refused() -> None:
    side = scheduler(block_size=64)
    side.layout = "vllm_cpu"
    assert side.lookup(Req("r", [], 100, handover(100, 48)), 0) == (0, False)  # 64 % 48
    side.layout = "opaque"
    assert side.lookup(Req("r2", [], 100, handover(100, 32)), 0) == (0, False)  # cannot re-block
    # vLLM's vec and amx CPU kernels pack blocks differently: never pulled from one to the other,
    # whatever the block sizes; the same packing on both sides is pulled.
    side.layout = "vllm_cpu_amx"
    for remote_layout, remote_bs in (("vllm_cpu", 64), ("vllm_cpu", 32), ("opaque", 64)):
        mixed = handover(100, remote_bs, remote_layout=remote_layout)
        assert side.lookup(Req(f"r-{remote_layout}{remote_bs}", [], 100, mixed), 0) == (0, False)
    assert side.counters["ignored:inconsistent"] == 5
    # Blocks of the same packing pass the layout checks, amx (re-blocked or not) and vec alike
    # (lookup itself needs a daemon to pull from).
    assert side._pull_problem(64, "vllm_cpu_amx") is None
    assert side._pull_problem(32, "vllm_cpu_amx") is None
    side.layout = "vllm_cpu"
    assert side._pull_problem(32, "vllm_cpu") is None
    assert "'vllm_cpu_amx'" in (side._pull_problem(32, "vllm_cpu_amx") or "")


# ------------------------------------------------------------------ the worker half, a real daemon


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    with daemon_process(make_config(host_pool_bytes=8 << 20, cache_bytes=4 << 20)) as d:
        yield d


def worker(
    daemon: DaemonProcess, name: str, store_wait_s: float = 5.0
) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    settings = ConnectorSettings(
        endpoint=daemon.config.endpoint, load_timeout_s=30.0, store_wait_s=store_wait_s
    )
    side = WorkerSide(settings, engine_id=name, tp_rank=0, tp_size=1, model_hash="mh")
    storage = torch.zeros(2 * 16 * 2 * 32 * 64, dtype=torch.bfloat16)
    caches = {f"layer{i}": storage[i * 65536 : (i + 1) * 65536].view(16, 2, 32, 64) for i in (0, 1)}
    for t in caches.values():
        t.copy_(torch.randn(t.shape))
    side.register(caches, detect_layout(caches["layer0"], cpu_packing="vllm_cpu"))
    return side, caches


def test_a_stored_block_loads_into_another_worker_and_missing_ones_are_load_errors(
    daemon: DaemonProcess,
) -> None:
    a, a_caches = worker(daemon, "a")
    b, b_caches = worker(daemon, "b")
    try:
        keys = [b"\x01" * 32, b"\x02" * 32]
        a.store(StepPlan(1, "fp", stores=[StoreSpec(keys, [3, 4], "r")]))
        a.fence(["r"])  # r was freed: the fence waits for its store before the next forward
        b.start_loads(StepPlan(1, "fp", loads=[LoadSpec("r", [keys[1], b"\x09" * 32], [7, 8])]))
        assert b.take_load_errors() == {8}  # the unknown key; block 7 holds a's block 4
        for name in a_caches:
            assert torch.equal(b_caches[name][7], a_caches[name][4])
    finally:
        a.close()
        b.close()


def test_the_fence_waits_only_for_stores_of_freed_blocks(daemon: DaemonProcess) -> None:
    """A running request's full blocks never change: only freed ones hold up the next forward."""
    a, _ = worker(daemon, "a", store_wait_s=1.0)
    k1, k2 = b"\x11" * 32, b"\x12" * 32
    try:
        os.kill(daemon.proc.pid, signal.SIGSTOP)  # no store can finish now
        try:
            a.store(StepPlan(1, "fp", stores=[StoreSpec([k1], [2], "running")]))
            a.store(StepPlan(2, "fp", stores=[StoreSpec([k2], [3], "finished")]))
            started = time.monotonic()
            a.fence(["someone-else"])
            assert time.monotonic() - started < 0.3  # nothing of theirs was freed
            a.fence(["finished"])
            waited = time.monotonic() - started
            assert 0.5 < waited < 3  # up to the store's not_after (store_wait_s), then abandoned
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        with SidecarClient(daemon.config.endpoint, heartbeat=False) as c:
            deadline = time.monotonic() + 5
            while c.status().in_flight_moves and time.monotonic() < deadline:
                time.sleep(0.05)
            # Both copies ended after their not_after: neither block was published.
            assert c.cache_lookup("fp", [k1]).hits == 0
            assert c.cache_lookup("fp", [k2]).hits == 0
            # The control: the same store on time is published.
            a.store(StepPlan(3, "fp", stores=[StoreSpec([k1], [2], "finished")]))
            a.fence(["finished"])
            assert c.cache_lookup("fp", [k1]).hits == 1
    finally:
        a.close()


def test_a_daemon_that_dies_under_a_load_turns_it_into_load_errors(daemon: DaemonProcess) -> None:
    """The load is in flight (the daemon stopped) when the daemon is killed: bounded, reported."""
    a, _ = worker(daemon, "a")
    try:
        keys = [b"\x05" * 32]
        a.store(StepPlan(1, "fp", stores=[StoreSpec(keys, [2], "r")]))
        a.fence(["r"])
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        killer = _kill_later(daemon, 0.5)
        started = time.monotonic()
        a.start_loads(StepPlan(2, "fp", loads=[LoadSpec("r", keys, [9])]))
        assert a.take_load_errors() == {9}
        assert time.monotonic() - started < 10  # far within load_timeout_s (30 s)
        killer.join()
        # With the daemon gone every step still completes: stores dropped, pulls failed, sends
        # released, nothing raised.
        a.store(StepPlan(3, "fp", stores=[StoreSpec([b"\x06" * 32], [3])], sends=["p"]))
        pull = PullSpec("q", "prod", "q", "", "other-daemon", [1], [5])
        a.start_loads(StepPlan(4, "fp", pulls=[pull]))
        assert a.finished(idle=True) == ({"p"}, {"q"}, {"q"})
        assert a.take_load_errors() == {5}
    finally:
        a.close()


def _kill_later(daemon: DaemonProcess, delay: float) -> Any:
    import threading

    def kill() -> None:
        time.sleep(delay)
        os.kill(daemon.proc.pid, signal.SIGKILL)

    thread = threading.Thread(target=kill)
    thread.start()
    return thread


def test_published_requests_finish_sending_when_read(daemon: DaemonProcess) -> None:
    """The producer's worker learns from its daemon events that its request was read."""
    a, _ = worker(daemon, "prod")
    b, _ = worker(daemon, "cons")
    try:
        with SidecarClient(daemon.config.endpoint, heartbeat=False) as scheduler_client:
            scheduler_client.publish("prod", "req", [1, 2])
        a.store(StepPlan(1, "fp", sends=["req"]))
        assert a.finished(idle=False) == (set(), set(), set())  # not read yet: still held
        pull = PullSpec("req-d", "prod", "req", "", _daemon_id(daemon), [1, 2], [6, 7])
        b.start_loads(StepPlan(1, "fp", pulls=[pull]))
        deadline = time.monotonic() + 10
        received: set[str] = set()
        while not received and time.monotonic() < deadline:
            received = b.finished(idle=True)[1]
        assert received == {"req-d"} and b.take_load_errors() == set()
        sent: set[str] = set()
        while not sent and time.monotonic() < deadline:
            sent = a.finished(idle=True)[0]
        assert sent == {"req"}
    finally:
        a.close()
        b.close()


def _daemon_id(daemon: DaemonProcess) -> str:
    with SidecarClient(daemon.config.endpoint, heartbeat=False) as c:
        assert c.daemon is not None
        return c.daemon.daemon_id


def test_a_scheduler_whose_daemon_answers_late_serves_without_it_for_retry_s(
    daemon: DaemonProcess,
) -> None:
    """A call past ``lookup_timeout_s`` is a miss, then no call for ``retry_s``, then calls again.

    A stopped daemon is one that answers late (a starved node): its lookup is a miss, and a
    prefill that finishes within ``retry_s`` is not published (its decode engine recomputes);
    neither holds up the scheduler beyond one timeout. Once ``retry_s`` has passed, the same
    scheduler looks up and publishes again.
    """
    prod, _ = worker(daemon, "prod")
    cons, _ = worker(daemon, "cons")
    settings = ConnectorSettings(endpoint=daemon.config.endpoint, lookup_timeout_s=0.3, retry_s=1.0)
    side = scheduler(settings, engine_id="prod")
    side.start()

    def finish(rid: str) -> tuple[bool, dict[str, Any] | None]:
        req = Req(rid, [], num_tokens=8, kv_transfer_params={"do_remote_decode": True})
        return side.request_finished(req, [1, 2], num_computed_tokens=8, capped=True)

    try:
        held, params = finish("before")  # the control: a daemon that answers
        assert held and params is not None and params["remote_block_ids"] == [1, 2]
        lookup = Req("l", [bytes([i]) * 32 for i in range(3)], num_tokens=13)
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert side.lookup(lookup, 0) == (0, False)  # timed out: a miss
            assert 0.25 < time.monotonic() - started < 1.0
            started = time.monotonic()
            assert finish("meanwhile") == (False, None)  # away: not even tried
            assert time.monotonic() - started < 0.1
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        time.sleep(settings.retry_s)
        held, params = finish("after")
        assert held and params is not None
        assert side.lookup(lookup, 0) == (0, False)  # answered now: nothing is stored under them
        assert side.conn.get() is not None  # and the daemon is not away after it
        # A decode engine pulls both: "after" is read, "meanwhile" was never published.
        digest = prompt_digest(list(range(8)))  # what the consumer's scheduler computes
        pulls = [
            PullSpec(f"{rid}-d", "prod", rid, "", _daemon_id(daemon), [1, 2], local, digest)
            for rid, local in (("after", [3, 4]), ("meanwhile", [6, 7]))
        ]
        cons.start_loads(StepPlan(1, "fp", pulls=pulls))
        deadline = time.monotonic() + 10
        received: set[str] = set()
        while len(received) < 2 and time.monotonic() < deadline:
            received |= cons.finished(idle=True)[1]
        assert received == {"after-d", "meanwhile-d"}
        assert cons.take_load_errors() == {6, 7}
    finally:
        side.close()
        prod.close()
        cons.close()
