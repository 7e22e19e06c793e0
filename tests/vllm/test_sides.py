"""The connector's two halves without vLLM: settings, keys, and the worker half on a real daemon.

`kvsidecar.integrations.vllm.worker.WorkerSide` and `scheduler.SchedulerSide` take plain values,
so their contracts with vLLM (tests/vllm/test_engines.py runs them inside real engines) can also be
driven step by step here: what a load that the daemon cannot finish turns into, what a dead
daemon does to every kind of step, what one that answers late does to the scheduler, and how
the scheduler plans stores and refuses pulls it could only get wrong.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from kvsidecar.client import SidecarClient
from kvsidecar.integrations.vllm.keys import CacheFacts, shareable_hashes
from kvsidecar.integrations.vllm.layout import detect_layout
from kvsidecar.integrations.vllm.params import prompt_digest
from kvsidecar.integrations.vllm.plan import LoadSpec, PullSpec, Scheduled, StepPlan, StoreSpec
from kvsidecar.integrations.vllm.scheduler import SchedulerSide
from kvsidecar.integrations.vllm.settings import ConnectorSettings, SettingsError
from kvsidecar.integrations.vllm.worker import WorkerSide
from tests.support import ROOT, python_env
from tests.support.daemons import DaemonProcess, StartDaemon
from tests.support.prometheus import scrape

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
        ({"store_batch_steps": 0}, "in 1..1024"),
        ({"store_batch_steps": 1025}, "in 1..1024"),
        ({"store_batch_steps": "8"}, "integer"),
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
    assert ask(side, req, 4) == (0, False)  # no daemon: a miss
    side.after_alloc(req, [10, 11, 12, 13], 0)
    plan = side.build([Scheduled("r", 4, 9, None)], [])
    assert [(s.keys, s.block_ids, s.request_id, s.batched) for s in plan.stores] == [
        (hashes[1:3], [11, 12], "r", False)  # a prompt's blocks: sent at once
    ]
    req.block_hashes = hashes[:4]  # a generated token filled block 3
    plan = side.build([Scheduled("r", 13, 3, [14])], [])
    # Fewer tokens than a block (decoding): the worker may batch it with later stores.
    assert [(s.keys, s.block_ids, s.batched) for s in plan.stores] == [(hashes[3:4], [13], True)]
    last = side.build([Scheduled("r", 16, 1, None)], ["p"], ["f"])
    assert last.stores == [] and last.freed == ["p", "f"]
    # Its stores may still be copying: vLLM holds its blocks until the workers say they ended,
    # so the next forward does not wait for them (it is not among the freed).
    finished = side.request_finished(req, [10, 11, 12, 13, 14], num_computed_tokens=16, capped=True)
    assert finished == (True, None)
    other = Req("o", hashes[:1], num_tokens=5)  # nothing of it stored: let go at once
    side.after_alloc(other, [20, 21], 0)
    assert side.request_finished(other, [20, 21], num_computed_tokens=5, capped=True) == (
        False,
        None,
    )
    plan = side.build([], [], ["r", "o"])
    assert plan.held == ["r"] and plan.freed == ["o"]


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
    assert ask(side, Req("r", [], 100, handover(100, 48)), 0) == (0, False)  # 64 % 48
    side.layout = "opaque"
    assert ask(side, Req("r2", [], 100, handover(100, 32)), 0) == (0, False)  # cannot re-block
    # vLLM's vec and amx CPU kernels pack blocks differently: never pulled from one to the other,
    # whatever the block sizes; the same packing on both sides is pulled.
    side.layout = "vllm_cpu_amx"
    for remote_layout, remote_bs in (("vllm_cpu", 64), ("vllm_cpu", 32), ("opaque", 64)):
        mixed = handover(100, remote_bs, remote_layout=remote_layout)
        assert ask(side, Req(f"r-{remote_layout}{remote_bs}", [], 100, mixed), 0) == (0, False)
    assert side.counters["ignored:inconsistent"] == 5
    # Blocks of the same packing pass the layout checks, amx (re-blocked or not) and vec alike
    # (lookup itself needs a daemon to pull from).
    assert side._pull_problem(64, "vllm_cpu_amx") is None
    assert side._pull_problem(32, "vllm_cpu_amx") is None
    side.layout = "vllm_cpu"
    assert side._pull_problem(32, "vllm_cpu") is None
    assert "'vllm_cpu_amx'" in (side._pull_problem(32, "vllm_cpu_amx") or "")
    # vLLM 0.31+'s GPU cells (K then V in each token's head) are blocks of nothing else; their
    # memory orders and block sizes are the daemon's to convert.
    side.layout = "kv_cells"
    assert side._pull_problem(32, "kv_cells") is None
    for other in ("kv_first", "mla", "opaque", "vllm_cpu"):
        assert "'kv_cells'" in (side._pull_problem(64, other) or ""), other
    side.layout = "blocks_first"
    assert side._pull_problem(32, "kv_first") is None


def ask(side: SchedulerSide, req: Req, computed: int = 0, within_s: float = 5.0) -> Any:
    """Ask as vLLM's scheduler does, again while the answer is None (the daemon is asked in the
    background); no one call may wait on the daemon."""
    deadline = time.monotonic() + within_s
    while True:
        started = time.monotonic()
        answer = side.lookup(req, computed)
        assert time.monotonic() - started < 0.05, "a lookup waited on the daemon"
        if answer[0] is not None:
            return answer
        assert time.monotonic() < deadline, "no answer"
        time.sleep(0.001)


# ------------------------------------------------------------------ the worker half, a real daemon


@pytest.fixture
def daemon(daemon_factory: StartDaemon) -> DaemonProcess:
    return daemon_factory(host_pool_bytes=8 << 20, cache_bytes=4 << 20)


def worker(
    daemon: DaemonProcess, name: str, store_wait_s: float = 5.0, **kw: Any
) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    settings = ConnectorSettings(
        endpoint=daemon.config.endpoint, load_timeout_s=30.0, store_wait_s=store_wait_s, **kw
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


def test_a_lookup_is_one_round_trip_with_its_pin_and_a_waiting_request_costs_none_more(
    daemon: DaemonProcess,
) -> None:
    """The lookup pins its hits (no second call when vLLM admits the request), and a request
    that vLLM cannot admit yet is answered again and again from the reply it has."""
    a, a_caches = worker(daemon, "a")
    b, b_caches = worker(daemon, "b")
    settings = ConnectorSettings(endpoint=daemon.config.endpoint)
    side = scheduler(settings)
    side.start()
    keys = [bytes([i + 1]) * 32 for i in range(3)]
    try:
        a.store(StepPlan(1, "fp", stores=[StoreSpec(keys, [3, 4, 5], "r")]))
        a.fence(["r"])
        with SidecarClient(daemon.config.endpoint, heartbeat=False) as c:
            assert c.daemon is not None
            port = c.daemon.metrics_port

        def calls() -> tuple[float, float]:  # every lookup, and those that pinned
            metrics = scrape(port)
            return tuple(metrics.get((f"kvsidecar_cache_{n}_total", ()), 0.0) for n in NAMES)  # type: ignore[return-value]

        before = calls()
        req = Req("w", keys, num_tokens=13)  # blocks of 4: 3 full blocks before the last token
        assert ask(side, req) == (12, True)
        for _ in range(50):  # vLLM has no free blocks for it yet: asked every step
            assert side.lookup(req, 0) == (12, True)
        side.after_alloc(req, [7, 8, 9, 10], 12)
        plan = side.build([], [])
        after = calls()
        assert (after[0] - before[0], after[1] - before[1]) == (1, 1)  # one lookup, which pinned
        (load,) = plan.loads
        assert load.pin_id and load.block_ids == [7, 8, 9] and load.asynchronous
        b.start_loads(plan)
        assert _received(b) == {"w"}
        assert b.take_load_errors() == set()
        for name in a_caches:
            assert torch.equal(b_caches[name][[7, 8, 9]], a_caches[name][[3, 4, 5]])
    finally:
        side.close()
        a.close()
        b.close()


NAMES = ("lookups", "pins")


def _received(side: WorkerSide, within_s: float = 10.0) -> set[str]:
    """The requests ``side`` reports received, as vLLM asks: a call per (idle) step."""
    deadline = time.monotonic() + within_s
    while True:
        _, recving, _ = side.finished(idle=True)
        if recving or time.monotonic() > deadline:
            return recving


def test_an_async_load_covers_the_whole_aligned_prompt_and_is_reported_once(
    daemon: DaemonProcess,
) -> None:
    """An async load (the default) may end on the prompt's last token: vLLM recomputes that one
    itself; a sync load stops a token short. Neither is reported twice; a failed one is a load
    error, received all the same (vLLM would wait for it forever otherwise)."""
    a, a_caches = worker(daemon, "a")
    b, b_caches = worker(daemon, "b")
    keys = [bytes([i + 1]) * 32 for i in range(3)]
    sides = {
        flag: scheduler(ConnectorSettings(endpoint=daemon.config.endpoint, async_loads=flag))
        for flag in (True, False)
    }
    for side in sides.values():
        side.start()
    try:
        a.store(StepPlan(1, "fp", stores=[StoreSpec(keys, [3, 4, 5], "r")]))
        a.fence(["r"])
        aligned = Req("aligned", keys, num_tokens=12)  # 3 full blocks of 4, nothing beyond
        assert ask(sides[False], aligned) == (8, False)
        assert ask(sides[True], aligned) == (12, True)
        sides[True].after_alloc(aligned, [7, 8, 9], 12)
        plan = sides[True].build([], [])
        (load,) = plan.loads
        assert load.asynchronous and load.block_ids == [7, 8, 9]
        b.start_loads(plan)  # sent, not waited for
        assert b.transfers_pending
        assert _received(b) == {"aligned"}
        assert b.take_load_errors() == set() and b.take_outcomes() == [(0, "aligned", True)]
        for name in a_caches:
            assert torch.equal(b_caches[name][[7, 8, 9]], a_caches[name][[3, 4, 5]])
        assert b.finished(idle=True) == (set(), set(), set()) and not b.transfers_pending
        # A missing block (evicted since the lookup; here: never stored) is a load error.
        gone = LoadSpec("gone", [b"\x7f" * 32, keys[0]], [12, 13], asynchronous=True)
        b.start_loads(StepPlan(2, "fp", loads=[gone]))
        assert _received(b) == {"gone"}
        assert b.take_load_errors() == {12} and b.take_outcomes() == [(0, "gone", False)]
        # The request's later blocks are not stored by this rank until vLLM frees it.
        b.store(StepPlan(3, "fp", stores=[StoreSpec([b"\x70" * 32], [14], "gone")]))
        assert b.counters["not_stored"] == 1
    finally:
        for side in sides.values():
            side.close()
        a.close()
        b.close()


def test_an_async_load_past_its_deadline_is_received_with_every_block_an_error(
    daemon: DaemonProcess,
) -> None:
    """A stopped daemon: the load is reported (all blocks load errors) once no copy can start,
    ``load_timeout_s`` and the fence's second later; not before, not never."""
    b = WorkerSide(
        ConnectorSettings(endpoint=daemon.config.endpoint, load_timeout_s=0.5),
        engine_id="b",
        tp_rank=0,
        tp_size=1,
        model_hash="mh",
    )
    storage = torch.zeros(16 * 2 * 32 * 64, dtype=torch.bfloat16)
    caches = {"layer0": storage.view(16, 2, 32, 64)}
    b.register(caches, detect_layout(caches["layer0"], cpu_packing="vllm_cpu"))
    try:
        spec = LoadSpec("late", [b"\x01" * 32], [3], asynchronous=True)
        deadline = time.monotonic() + 10
        while b._client() is None:  # registered before the daemon stops
            assert time.monotonic() < deadline, "the worker never connected"
            time.sleep(0.01)
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            b.start_loads(StepPlan(2, "fp", loads=[spec]))
            assert time.monotonic() - started < 0.2  # not waited for
            assert _received(b, within_s=0.3) == set()  # still within its deadline
            assert _received(b, within_s=5.0) == {"late"}
            assert 1.4 < time.monotonic() - started < 3.0
            assert b.take_load_errors() == {3} and b.take_outcomes() == [(0, "late", False)]
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
    finally:
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


def test_a_decode_steps_blocks_are_stored_together_within_store_batch_steps(
    daemon: DaemonProcess,
) -> None:
    """Batched blocks (decode steps') go out with the next store, at the latest in the
    ``store_batch_steps``-th step; at once when their request is freed (before the fence waits),
    held, in a step that computes nothing, or when the namespace changes."""
    a, _ = worker(daemon, "a", store_batch_steps=4)
    k = [bytes([0x40 + i]) * 32 for i in range(16)]

    def batched(step: int, rid: str, fp: str = "fp", **plan: Any) -> StepPlan:
        spec = StoreSpec([k[step]], [step], rid, batched=True)
        return StepPlan(step, fp, stores=[spec], **plan)

    try:
        with SidecarClient(daemon.config.endpoint, heartbeat=False) as c:

            def hits(keys: list[bytes], fp: str = "fp", want: int = -1) -> int:
                deadline = time.monotonic() + 5
                while True:
                    got = c.cache_lookup(fp, keys).hits
                    if want < 0 or got == want or time.monotonic() > deadline:
                        return got
                    time.sleep(0.02)

            for step in (1, 2, 3):
                a.store(batched(step, f"r{step}"))
                a.fence([])
            time.sleep(0.3)
            assert hits(k[1:4]) == 0 and a.stores.batched  # nothing sent yet
            a.store(batched(4, "r4"))  # the fourth step since the oldest: all four sent
            assert not a.stores.batched and hits(k[1:5], want=4) == 4
            a.fence([])
            assert a.counters["stored_blocks"] == 4
            # A prompt's block is sent at once, and takes the batch with it.
            a.store(batched(5, "r5"))
            a.store(StepPlan(6, "fp", stores=[StoreSpec([k[6]], [6], "r6")]))
            assert hits(k[5:7], want=2) == 2
            # Freed: the fence sends the request's batched block and waits for it.
            a.store(batched(7, "gone"))
            a.fence(["gone"])
            assert hits(k[7:8]) == 1
            # A step that computes nothing, and a held request, send the batch at once.
            a.store(batched(8, "r8"))
            a.store(StepPlan(9, "fp", idle=True))
            assert hits(k[8:9], want=1) == 1
            a.store(batched(10, "held"))
            a.store(StepPlan(11, "fp", held=["held"]))
            deadline = time.monotonic() + 5
            sent: set[str] = set()
            while not sent and time.monotonic() < deadline:
                sent = a.finished(idle=False)[0]
            assert sent == {"held"} and hits(k[10:11]) == 1
            # A reset: the batch goes to the namespace it was computed for, the new one waits.
            a.store(batched(12, "r12"))
            a.store(batched(13, "r13", fp="fp2"))
            assert hits(k[12:13], want=1) == 1 and hits(k[13:14], fp="fp2") == 0
    finally:
        a.close()


def test_a_held_request_is_reported_once_its_stores_ended_and_nothing_waits(
    daemon: DaemonProcess,
) -> None:
    """A finished request's blocks stay vLLM's until its stores have copied them (or passed their
    not_after, after which the daemon throws a copy away): no forward waits for a stopped daemon."""
    a, _ = worker(daemon, "a", store_wait_s=1.0)
    try:
        a.store(StepPlan(1, "fp", stores=[StoreSpec([b"\x21" * 32], [2], "on-time")]))
        a.store(StepPlan(2, "fp", held=["on-time"]))
        deadline = time.monotonic() + 5
        sent: set[str] = set()
        while not sent and time.monotonic() < deadline:
            sent = a.finished(idle=False)[0]
        assert sent == {"on-time"}  # the control: its store ended, it is let go
        os.kill(daemon.proc.pid, signal.SIGSTOP)  # no store can finish now
        try:
            a.store(StepPlan(3, "fp", stores=[StoreSpec([b"\x22" * 32], [3], "late")]))
            a.store(StepPlan(4, "fp", held=["late"]))
            started = time.monotonic()
            a.fence([])  # the scheduler names no held request freed: nothing to wait for...
            assert time.monotonic() - started < 0.05
            sent = set()
            while not sent and time.monotonic() - started < 5:
                before = time.monotonic()
                sent = a.finished(idle=False)[0]
                assert time.monotonic() - before < 0.05
            waited = time.monotonic() - started
            assert sent == {"late"} and 0.8 < waited < 3  # ...and let go at its not_after
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
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
            assert ask(side, lookup, 0) == (0, False)  # timed out: a miss
            assert 0.25 < time.monotonic() - started < 1.0
            started = time.monotonic()
            assert finish("meanwhile") == (False, None)  # away: not even tried
            assert time.monotonic() - started < 0.1
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        time.sleep(settings.retry_s)
        held, params = finish("after")
        assert held and params is not None
        assert ask(side, lookup, 0) == (0, False)  # answered now: nothing is stored under them
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


# ------------------------------------------------------------------ hostile kv_transfer_params

HOSTILE: list[tuple[str, dict[str, Any], str]] = [
    # (what, the params, the reason they are ignored)
    ("no keys", {"do_remote_prefill": True}, "malformed"),
    ("flag not a bool", handover(40, 4, do_remote_prefill="yes"), "malformed"),
    ("tokens as a string", handover(40, 4, remote_num_tokens="40"), "malformed"),
    ("tokens a bool", handover(40, 4, remote_num_tokens=True), "malformed"),
    ("tokens past the prompt", handover(41, 4), "inconsistent"),
    ("tokens short of the prompt", handover(39, 4), "inconsistent"),
    ("tokens negative", handover(40, 4, remote_num_tokens=-1), "malformed"),
    ("tokens huge", handover(40, 4, remote_num_tokens=1 << 62), "malformed"),
    ("block size 0", handover(40, 4, remote_block_size=0), "malformed"),
    ("block size not dividing ours", handover(40, 3), "inconsistent"),
    ("ids not a list", handover(40, 4, remote_block_ids="1,2"), "malformed"),
    ("ids too few", handover(40, 4, remote_block_ids=[1, 2]), "inconsistent"),
    ("ids too many", handover(40, 4, remote_block_ids=list(range(11))), "inconsistent"),
    ("ids repeated", handover(40, 4, remote_block_ids=[1] * 10), "inconsistent"),
    ("an id negative", handover(40, 4, remote_block_ids=[-1, *range(9)]), "malformed"),
    ("an id huge", handover(40, 4, remote_block_ids=[1 << 40, *range(9)]), "malformed"),
    ("an id a float", handover(40, 4, remote_block_ids=[1.0, *range(1, 10)]), "malformed"),
    ("no engine", handover(40, 4, remote_engine_id=""), "malformed"),
    ("engine not a string", handover(40, 4, remote_engine_id=7), "malformed"),
    ("request id of 1 MB", handover(40, 4, remote_request_id="x" * (1 << 20)), "malformed"),
    ("unknown layout", handover(40, 4, remote_layout="hnd-of-my-own"), "malformed"),
    ("another layout", handover(40, 4, remote_layout="kv_first"), "inconsistent"),
    ("metadata service", handover(40, 4, remote_endpoint="tcp://169.254.169.254:80"), "endpoint"),
    ("loopback port", handover(40, 4, remote_endpoint="tcp://127.0.0.1:22"), "endpoint"),
    ("no endpoint, other daemon", handover(40, 4, remote_daemon_id="elsewhere"), "endpoint"),
]


@pytest.mark.parametrize("what,params,reason", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_params_are_ignored_before_vllm_is_told_to_wait(
    daemon: DaemonProcess, what: str, params: dict[str, Any], reason: str
) -> None:
    """Each is answered as a request without params (a prefix-cache lookup, synchronous), counted
    under its reason; no pull is planned, so vLLM never puts the request in
    WAITING_FOR_REMOTE_KVS and no daemon connects anywhere."""
    settings = ConnectorSettings(endpoint=daemon.config.endpoint, peers=("tcp://10.0.0.2:7000",))
    side = scheduler(settings)
    side.start()
    side.layout = "vllm_cpu"
    try:
        req = Req("hostile", [bytes([i]) * 32 for i in range(9)], 40, params)
        assert ask(side, req, 0) == (0, False), what
        assert side.counters == {f"ignored:{reason}": 1}, (what, side.counters)
        side.after_alloc(req, list(range(10)), 0)
        plan = side.build([Scheduled("hostile", 0, 40, None)], [])
        assert plan.pulls == [] and plan.failed_pulls == [] and plan.loads == []
        assert [s.request_id for s in plan.stores] == ["hostile"]  # computed here, stored
    finally:
        side.close()


def test_a_valid_hand_over_waits_for_its_pull_and_names_the_prompt(daemon: DaemonProcess) -> None:
    """The control of the hostile cases: the same params, whole, make an asynchronous load."""
    daemon_id = _daemon_id(daemon)
    settings = ConnectorSettings(endpoint=daemon.config.endpoint, peers=("tcp://10.0.0.2:7000",))
    side = scheduler(settings)
    side.start()
    side.layout = "vllm_cpu"
    try:
        for rid, params in (
            ("local", handover(40, 4, remote_daemon_id=daemon_id)),
            ("peer", handover(40, 4, remote_endpoint="tcp://10.0.0.2:7000")),
            ("ratio", handover(40, 2, remote_daemon_id=daemon_id)),
        ):
            req = Req(rid, [], 40, params, prompt=list(range(100, 140)))
            assert side.may_load_async(req)
            assert ask(side, req, 0) == (40, True), rid
            side.after_alloc(req, list(range(10)), 40)
            assert params["do_remote_prefill"] is False  # pulled once, never again
        plan = side.build([], [])
        digest = prompt_digest(list(range(100, 140)))
        assert [(p.request_id, p.prompt_digest, len(p.remote_ids)) for p in plan.pulls] == [
            ("local", digest, 10),
            ("peer", digest, 10),
            ("ratio", digest, 20),
        ]
        assert side.counters == {}
    finally:
        side.close()


def test_an_engine_without_disaggregated_prefill_ignores_every_hand_over(
    daemon: DaemonProcess,
) -> None:
    """The prefix-cache recipe (kv_both): neither pulls nor publishes, whatever a client sends."""
    settings = ConnectorSettings(endpoint=daemon.config.endpoint)
    side = scheduler(settings, disaggregated=False)
    side.start()
    side.layout = "vllm_cpu"
    try:
        pull = Req("d", [], 40, handover(40, 4, remote_daemon_id=_daemon_id(daemon)))
        assert not side.may_load_async(pull)
        assert ask(side, pull, 0) == (0, False)
        prefill = Req("p", [], 8, {"do_remote_decode": True})
        assert side.request_finished(prefill, [1, 2], num_computed_tokens=8, capped=True) == (
            False,
            None,
        )
        assert side.counters == {"ignored:disabled": 2}
        with SidecarClient(daemon.config.endpoint, heartbeat=False) as c:
            assert c.status().published_requests == 0
    finally:
        side.close()


def test_prompts_the_digest_cannot_name_are_not_handed_over(daemon: DaemonProcess) -> None:
    settings = ConnectorSettings(endpoint=daemon.config.endpoint)
    side = scheduler(settings)
    side.start()
    try:
        embeds = Req("e", [], 8, {"do_remote_decode": True}, prompt_embeds=torch.zeros(8, 4))
        images = Req("i", [], 8, {"do_remote_decode": True}, mm_features=["an image"])
        for req in (embeds, images):
            assert side.request_finished(req, [1, 2], num_computed_tokens=8, capped=True) == (
                False,
                None,
            )
        assert side.counters == {"ignored:unsupported": 2}
    finally:
        side.close()


# -------------------------------------------------------- nothing computed over a failed load


def test_a_failed_load_stores_nothing_computed_after_it(daemon: DaemonProcess) -> None:
    """Block 1 of a request fails to load; the blocks the same step computed are not stored,
    nor those of later steps, until vLLM frees the request; the scheduler learns the outcome."""
    a, _ = worker(daemon, "a")
    b, _ = worker(daemon, "b")
    cached = [b"\x31" * 32, b"\x32" * 32]
    later = [b"\x41" * 32, b"\x42" * 32]
    try:
        a.store(StepPlan(1, "fp", stores=[StoreSpec(cached[:1], [3], "r")]))
        a.fence(["r"])
        step = StepPlan(
            2,
            "fp",
            loads=[LoadSpec("r", cached, [5, 6])],  # the second key was never stored
            stores=[StoreSpec(later[:1], [7], "r")],
        )
        b.start_loads(step)
        assert b.take_load_errors() == {6}
        b.store(step)
        assert b.take_outcomes() == [(0, "r", False)]
        b.store(StepPlan(3, "fp", stores=[StoreSpec(later[1:], [8], "r")]))
        b.fence(["r"])  # freed: its stores are done
        with SidecarClient(daemon.config.endpoint, heartbeat=False) as c:
            assert c.cache_lookup("fp", later[:1]).hits == 0
            assert c.cache_lookup("fp", later[1:]).hits == 0
        assert b.counters["not_stored"] == 2
        # Re-admitted after its blocks were freed, it loads afresh: its stores go through.
        good = StepPlan(
            4, "fp", loads=[LoadSpec("r", cached[:1], [5])], stores=[StoreSpec(later[:1], [7], "r")]
        )
        b.start_loads(good)
        b.store(good)
        assert b.take_outcomes() == [(0, "r", True)]
        b.fence(["r"])
        with SidecarClient(daemon.config.endpoint, heartbeat=False) as c:
            assert c.cache_lookup("fp", later[:1]).hits == 1
    finally:
        a.close()
        b.close()


def _loading(side: SchedulerSide, rid: str, hashes: list[bytes]) -> Req:
    """A request admitted with the daemon holding its first two blocks (a sync load)."""
    req = Req(rid, hashes, 24)
    side.after_alloc(req, [10, 11, 12, 13, 14, 15], 8)  # 8 tokens = 2 blocks of 4 loaded
    return req


def test_a_request_whose_load_failed_on_any_rank_stores_nothing_more() -> None:
    hashes = [bytes([i]) * 32 for i in range(6)]
    # TP 1: the worker knows its own outcome in the step: stores go out with the load (the
    # worker drops them if it failed); a failure reported stops later stores.
    one = scheduler(tp_size=1)
    _loading(one, "r", hashes)
    plan = one.build([Scheduled("r", 8, 12, None)], [])
    assert [s.keys for s in plan.loads] == [hashes[:2]]
    assert [s.keys for s in plan.stores] == [hashes[2:5]]
    one.confirm([(0, "r", False)])
    assert one.build([Scheduled("r", 20, 4, None)], []).stores == []
    # TP 2: one rank cannot know the other's outcome: stores wait for both ranks.
    two = scheduler(tp_size=2)
    _loading(two, "ok", hashes)
    _loading(two, "bad", hashes)
    plan = two.build([Scheduled("ok", 8, 12, None), Scheduled("bad", 8, 12, None)], [])
    assert len(plan.loads) == 2 and plan.stores == []
    two.confirm([(0, "ok", True), (0, "bad", True)])
    assert two.build([Scheduled("ok", 20, 1, None), Scheduled("bad", 20, 1, None)], []).stores == []
    two.confirm([(1, "ok", True), (1, "bad", False)])
    plan = two.build([Scheduled("ok", 21, 3, None), Scheduled("bad", 21, 3, None)], [])
    assert [(s.request_id, s.keys) for s in plan.stores] == [("ok", hashes[2:6])]


# ------------------------------------------------------------------ hooks that fail answer closed


def test_a_failed_hook_turns_planned_loads_into_load_errors_and_pulls_into_failures(
    daemon: DaemonProcess,
) -> None:
    """`fail_alloc` and `fail_build` (a hook raised on a bug): vLLM has counted the tokens as
    loaded, so the workers report them, without asking the daemon; sends stay held."""
    side = scheduler(ConnectorSettings(endpoint=daemon.config.endpoint))
    side.start()
    b, _ = worker(daemon, "b")
    try:
        req = Req("load", [bytes([i]) * 32 for i in range(6)], 24)
        side.fail_alloc(req, [10, 11, 12, 13, 14, 15], 8)  # two blocks were to be loaded
        pull = Req("async", [], 40, handover(40, 4, remote_daemon_id=_daemon_id(daemon)))
        side.layout = "vllm_cpu"
        assert ask(side, pull, 0) == (40, True)
        side.fail_alloc(pull, list(range(20, 30)), 40)
        plan = side.build([], [])
        assert [s.block_ids for s in plan.failed_loads] == [[10, 11]]
        assert [s.local_ids for s in plan.failed_pulls] == [list(range(20, 30))]
        b.start_loads(plan)
        # Both are waited for in WAITING_FOR_REMOTE_KVS: both are received, the pull failed.
        assert b.finished(idle=True) == (set(), {"load", "async"}, {"async"})
        assert b.take_load_errors() == {10, 11} | set(range(20, 30))
        assert b.take_outcomes() == [(0, "load", False)]
        assert b.finished(idle=True) == (set(), set(), set())  # each reported once
        # build_connector_meta raised: what was queued fails, the published request stays held.
        _loading(side, "queued", [bytes([i]) * 32 for i in range(6)])
        side._next.sends.append("published")
        failed = side.fail_build(["pre"], ["fin"])
        assert [s.request_id for s in failed.failed_loads] == ["queued"]
        assert failed.sends == ["published"] and failed.freed == ["pre", "fin"]
        assert failed.stores == [] and failed.loads == []
        side._next.sends.append("p2")
        assert side.fail_finished(Req("p2", [], 8)) == (True, None)  # published: held
        assert side.fail_finished(Req("never", [], 8)) == (False, None)
        # A worker hook that raised half-way reports what it did not settle, once.
        again = StepPlan(9, "fp", loads=[LoadSpec("x", [b"\x01" * 32], [4])])
        b.fail_loads(again)
        b.fail_loads(again)
        assert b.take_load_errors() == {4} and b.take_outcomes() == [(0, "x", False)]
    finally:
        side.close()
        b.close()


# ------------------------------------------------------------------ completions never lost


def test_a_send_read_before_its_plan_reached_the_worker_is_still_reported(
    daemon: DaemonProcess,
) -> None:
    """Async scheduling: a prefill is published and read by its consumer while the producer's
    worker still waits for the plan naming the send. Its event, taken along with another send's,
    is kept, and reported once the plan comes; vLLM frees the blocks."""
    prod, _ = worker(daemon, "prod")
    cons, _ = worker(daemon, "cons")
    try:
        with SidecarClient(daemon.config.endpoint, heartbeat=False) as sched:
            sched.publish("prod", "other", [1])
            sched.publish("prod", "early", [2])
        prod.store(StepPlan(1, "fp", sends=["other"]))  # "early" is in the next plan
        pull = PullSpec("early-d", "prod", "early", "", _daemon_id(daemon), [2], [6])
        cons.start_loads(StepPlan(1, "fp", pulls=[pull]))
        deadline = time.monotonic() + 10
        while not cons.finished(idle=True)[1] and time.monotonic() < deadline:
            pass
        sent: set[str] = set()
        while time.monotonic() < deadline and not prod._early:  # the event of "early" came
            sent |= prod.finished(idle=True)[0]
        assert "early" in prod._early and "early" not in sent
        prod.store(StepPlan(2, "fp", sends=["early"]))
        sent |= prod.finished(idle=False)[0]
        assert "early" in sent
    finally:
        prod.close()
        cons.close()


def test_events_for_sends_never_known_are_kept_within_a_bound() -> None:
    side = WorkerSide(ConnectorSettings(), engine_id="e", tp_rank=0, tp_size=1, model_hash="")
    old = time.monotonic() - 1e6
    side._early.update((f"old-{i}", old) for i in range(3))
    now = time.monotonic()
    side._early.update((f"new-{i}", now) for i in range(5000))
    side._match_early()
    assert len(side._early) == 4096 and "old-0" not in side._early
    assert side.counters["events_dropped"] == 3 + 5000 - 4096


# ------------------------------------------------------------------ reset_cache


def test_a_reset_cache_moves_the_engine_to_a_namespace_of_its_own() -> None:
    side = scheduler()
    _loading(side, "before", [bytes([i]) * 32 for i in range(6)])
    side.reset()
    plan = side.build([Scheduled("before", 8, 16, None)], [])
    assert plan.fingerprint != "fp" and plan.fingerprint.startswith("fp~")
    assert plan.stores == []  # computed before the reset: never stored under the new one
    other = scheduler()
    other.reset()
    assert other.fingerprint != plan.fingerprint  # two resets never share a namespace


# ------------------------------------------------------------------ /dev/shm


def _in_small_shm(size: str, *cmd: str) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in a mount namespace of its own whose /dev/shm is a tmpfs of ``size``."""
    script = f"mount -t tmpfs -o size={size} tmpfs /dev/shm && exec {shlex.join(cmd)}"
    return subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        cwd=ROOT,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _can_mount() -> bool:
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "true"], capture_output=True, check=False
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _can_mount(), reason="needs mount namespaces (root) for a small /dev/shm")
def test_a_cache_larger_than_dev_shm_is_refused_before_anything_moves() -> None:
    """Docker's default /dev/shm is 64 MiB: a cache that does not fit is refused with the sizes
    and what to do, before any page moves (torch would fail half-way, or the daemon map it)."""
    out = _in_small_shm("8m", sys.executable, "-m", "tests.procs.small_shm", "16")
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["shared"] is False
    assert result["error"].startswith(
        "SharedMemoryTooSmall: the KV cache (16.0 MiB) does not "
        "fit in /dev/shm (8.0 MiB, 8.0 MiB free)"
    ), result
    assert "--shm-size" in result["error"]
    fits = _in_small_shm("32m", sys.executable, "-m", "tests.procs.small_shm", "16")
    assert json.loads(fits.stdout.strip().splitlines()[-1]) == {"error": "", "shared": True}


# ------------------------------------------------------- hand-overs nobody reads hold a bound


def _connected(side: SchedulerSide) -> bool:
    client = side.conn.get()
    return client is not None and client.daemon is not None


def test_hand_overs_nobody_reads_hold_at_most_max_held_blocks(daemon: DaemonProcess) -> None:
    """An API client asks a prefill engine of 16 blocks for hand-overs (``do_remote_decode``)
    and never reads them: the engine holds at most half its blocks for them (the default
    ``max_held_blocks``), a request past it is not handed over (its blocks freed at once,
    counted ``ignored:held``), and once a consumer reads one, its room comes back."""
    producer, _ = worker(daemon, "prod")
    consumer, _ = worker(daemon, "cons")
    settings = ConnectorSettings(endpoint=daemon.config.endpoint)
    side = scheduler(settings, role="kv_producer", engine_id="prod", block_size=32, num_blocks=16)
    side.start()
    try:
        deadline = time.monotonic() + 10
        while not _connected(side) and time.monotonic() < deadline:
            time.sleep(0.01)

        def finish(rid: str, first: int) -> Any:
            prompt = list(range(first, first + 128))  # 4 blocks of 32 tokens
            req = Req(rid, [], 128, {"do_remote_decode": True}, prompt=prompt)
            blocks = [first // 128 * 4 + i for i in range(4)]
            return side.request_finished(req, blocks, num_computed_tokens=128, capped=True)

        handed = [finish(f"unread-{i}", i * 128) for i in range(2)]
        assert all(held and params for held, params in handed), handed
        assert finish("past-the-bound", 1024) == (False, None)  # 8 + 4 > 8: freed, not held
        assert side.counters == {"ignored:held": 1}
        assert side.held_blocks == 8
        plan = side.build([], [], ["unread-0", "unread-1", "past-the-bound"])
        assert plan.sends == ["unread-0", "unread-1"] and "past-the-bound" in plan.freed
        producer.store(plan)
        with SidecarClient(daemon.config.endpoint, heartbeat=False) as c:
            assert c.status().published_requests == 2
        # A consumer reads one: vLLM reports it sent (aggregated over the producer's workers),
        # its blocks are freed, and the next hand-over fits again.
        params = handed[0][1]
        pull = PullSpec(
            "d-0",
            "prod",
            "unread-0",
            "",
            params["remote_daemon_id"],
            params["remote_block_ids"],
            [8, 9, 10, 11],
            prompt_digest(list(range(128))),
        )
        consumer.start_loads(StepPlan(1, "fp", pulls=[pull]))
        sent: set[str] = set()
        while not sent and time.monotonic() < deadline + 10:
            consumer.finished(idle=True)
            sent = producer.finished(idle=True)[0]
        assert sent == {"unread-0"}
        side.sent(sent)
        assert side.held_blocks == 4
        held, params = finish("after-a-read", 2048)
        assert held and params is not None
    finally:
        side.close()
        producer.close()
        consumer.close()
