"""vLLM's GPU cache views, built on the CPU with vLLM's own functions, through the connector.

Run inside a vLLM venv by tests/vllm/test_paged_layout.py, with a daemon it started:
``python -m tests.procs.vllm_paged <endpoint> <cases.json> <out.npz>``.

Each engine's cache is what vLLM's ``allocate_kv_cache`` makes on a GPU: one int8 buffer, one
``[B, H, N, C]`` view per layer from ``create_kv_cache_views`` under a ``KVCacheLayout``
(kernel blocks included). Tokens are written into it and read back from it the way vLLM's
attention backends address it (FlashAttention's, FlashInfer's and Triton's
``kv_cache.transpose(1, 2).split(head_size, dim=-1)``; MLA's ``kv_cache[:, 0]``), never through
kvsidecar's layout code. The engines register through the connector's own path
(`paged_views`, then `WorkerSide.register`) and move blocks with `WorkerSide`'s stores, loads
and pulls. Per case, ``out.npz`` holds ``<case>.want`` (the tokens written, as raw bits) and
``<case>.got`` (what the destination's backend reads there); refusals go to stdout as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvsidecar.integrations.vllm.layout import LayoutUnknown, paged_views
from kvsidecar.integrations.vllm.plan import LoadSpec, PullSpec, StepPlan, StoreSpec
from kvsidecar.integrations.vllm.scheduler import SchedulerSide
from kvsidecar.integrations.vllm.settings import ConnectorSettings
from kvsidecar.integrations.vllm.worker import WorkerSide

LAYERS = 2
DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


class Engine:
    """One engine's cache as vLLM allocates it, and its tokens as its backend addresses them."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.dtype = DTYPES[spec["dtype"]]
        self.mla = bool(spec.get("mla"))
        self.heads = 1 if self.mla else int(spec["heads"])
        self.head_size = int(spec["head_size"])
        self.block_size = int(spec["block_size"])
        self.kernel = int(spec.get("kernel_block_size") or self.block_size)
        self.num_blocks = int(spec["num_blocks"])
        kv = FullAttentionSpec if not self.mla else MLAAttentionSpec
        extra = {} if self.mla else {"head_size_v": self.head_size}
        self.kv_spec = kv(
            block_size=self.block_size,
            num_kv_heads=self.heads,
            head_size=self.head_size,
            dtype=self.dtype,
            **extra,
        )
        self.layout = KVCacheLayout[spec["layout"]]
        kernel = self.kernel if self.kernel != self.block_size else None
        strides = compute_layout_strides(self.kv_spec, self.num_blocks, LAYERS, self.layout, kernel)
        ratio = self.block_size // self.kernel
        page = self.kv_spec.page_size_bytes
        tensor = KVCacheTensor(
            size=page * self.num_blocks * LAYERS,
            layers=[f"layer{i}" for i in range(LAYERS)],
            layer_stride=strides[0],
            block_stride=strides[1] * ratio,
        )
        self.raw = torch.zeros(tensor.size, dtype=torch.int8)
        views = create_kv_cache_views(
            self.raw, self.kv_spec, self.num_blocks, self.layout, tensor, kernel
        )
        self.views = dict(zip(tensor.layers, views, strict=True))
        self.config = KVCacheConfig(
            num_blocks=self.num_blocks,
            kv_cache_tensors=[tensor],
            kv_cache_groups=[KVCacheGroupSpec(tensor.layers, self.kv_spec)],
            kv_cache_layout=self.layout.name,
        )

    def cells(self, layer: str) -> tuple[torch.Tensor, ...]:
        """The backend's own views: ``(K, V)`` of ``[kernel block, slot, head, channel]``, or
        MLA's one ``[kernel block, slot, channel]``."""
        view = self.views[layer]
        if self.mla:
            return (view[:, 0],)
        k, v = view.transpose(1, 2).split(self.head_size, dim=-1)
        return k, v

    def slots(self, block_ids: list[int], tokens: int) -> tuple[list[int], list[int]]:
        """The kernel block and slot of each of a request's tokens in ``block_ids``."""
        kb, slot = [], []
        for t in range(tokens):
            block, offset = block_ids[t // self.block_size], t % self.block_size
            ratio = self.block_size // self.kernel
            kb.append(block * ratio + offset // self.kernel)
            slot.append(offset % self.kernel)
        return kb, slot

    def write(self, block_ids: list[int], tokens: int, seed: int) -> np.ndarray:
        """Write a request's tokens as the backend does; return them as raw bits."""
        gen = torch.Generator().manual_seed(seed)
        kb, slot = self.slots(block_ids, tokens)
        written = []
        for layer in self.views:
            for part in self.cells(layer):
                shape = (tokens, *part.shape[2:])
                values = torch.randn(shape, generator=gen).to(self.dtype)
                part[kb, slot] = values
                written.append(values)
        return _bits(written)

    def read(self, block_ids: list[int], tokens: int) -> np.ndarray:
        """Read a request's tokens as the backend does, as raw bits."""
        kb, slot = self.slots(block_ids, tokens)
        return _bits([part[kb, slot] for layer in self.views for part in self.cells(layer)])

    def untouched(self, block_ids: list[int]) -> bool:
        """Whether every block but ``block_ids`` is still all zeros."""
        ratio = self.block_size // self.kernel
        kept = sorted({b * ratio + i for b in block_ids for i in range(ratio)})
        others = [b for b in range(self.num_blocks * ratio) if b not in kept]
        return all(
            not part[others].view(torch.uint8).any()
            for layer in self.views
            for part in self.cells(layer)
        )


def _bits(parts: list[torch.Tensor]) -> np.ndarray:
    flat = [p.contiguous().view(BITS[p.element_size()]).reshape(-1) for p in parts]
    return torch.cat([f.to(torch.int64) for f in flat]).numpy()


def worker(endpoint: str, engine: Engine, name: str, tp_rank: int = 0, tp_size: int = 1) -> Any:
    """Register ``engine`` through the connector's path; return its `WorkerSide`."""
    settings = ConnectorSettings(endpoint=endpoint, load_timeout_s=30.0, store_wait_s=10.0)
    side = WorkerSide(settings, engine_id=name, tp_rank=tp_rank, tp_size=tp_size, model_hash="m")
    views, cache_layout = paged_views(engine.views, engine.config, use_mla=engine.mla)
    side.register(views, cache_layout)
    deadline = time.monotonic() + 20
    while side._client() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # registration runs on the connection's thread
    assert side._client() is not None, "the worker did not register"
    return side


def store_and_load(endpoint: str, case: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, bool]:
    """One engine stores a request's blocks, another one of the same layout loads them."""
    a, b = Engine(case["engine"]), Engine(case["engine"])
    src, dst = case["src_ids"], case["dst_ids"]
    tokens = len(src) * a.block_size
    want = a.write(src, tokens, seed=len(src))
    fp = f"fp-{case['name']}"
    keys = [bytes([i + 1]) * 32 for i in range(len(src))]
    sa, sb = worker(endpoint, a, f"a-{case['name']}"), worker(endpoint, b, f"b-{case['name']}")
    try:
        sa.store(StepPlan(1, fp, stores=[StoreSpec(keys, src, "r")]))
        sa.fence(["r"])
        sb.start_loads(StepPlan(1, fp, loads=[LoadSpec("r", keys, dst)]))
        errors = sb.take_load_errors()
        assert not errors, f"load errors {errors}"
    finally:
        sa.close()
        sb.close()
    return want, b.read(dst, tokens), b.untouched(dst)


def replicated(endpoint: str, case: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, bool]:
    """MLA under TP 2: both ranks of ``a`` store the same latent, the daemon keeps it once (rank
    0's namespace: a lookup of TP 1 hits, rank 1 stores nothing); ``b``'s scheduler half finds
    it and plans an async load, which both ranks of ``b`` run under the lookup's one pin (held
    until the second rank's load)."""
    from kvsidecar.client import SidecarClient

    a = [Engine(case["engine"]) for _ in range(2)]
    b = [Engine(case["engine"]) for _ in range(2)]
    src, dst = case["src_ids"], case["dst_ids"]
    tokens = len(src) * a[0].block_size
    want = [e.write(src, tokens, seed=3) for e in a]  # replicated: the same latent on each rank
    assert all(np.array_equal(want[0], w) for w in want)
    fp = f"fp-{case['name']}"
    keys = [bytes([i + 9]) * 32 for i in range(len(src))]
    sa = [worker(endpoint, e, f"a-{case['name']}", r, 2) for r, e in enumerate(a)]
    sb = [worker(endpoint, e, f"b-{case['name']}", r, 2) for r, e in enumerate(b)]
    try:
        for side in sa:
            side.store(StepPlan(1, fp, stores=[StoreSpec(keys, src, "r")]))
            side.fence(["r"])
        stored = [side.counters["stored_blocks"] for side in sa]
        assert stored == [len(src), 0], f"stored per rank {stored}"
        with SidecarClient(endpoint, heartbeat=False) as client:
            hits = [client.cache_lookup(fp, keys, tp_size=n).hits for n in (1, 2)]
            assert hits == [len(src), 0], f"hits with TP 1 and 2: {hits}"  # one namespace

            def pinned() -> int:
                (ns,) = [n for n in client.status().cache_namespaces if n.fingerprint == fp]
                return ns.pinned_blocks

            plan = _planned_load(endpoint, fp, keys, dst, b[0].block_size)
            assert pinned() == len(src)
            for rank, side in enumerate(sb):
                side.start_loads(plan)
                deadline = time.monotonic() + 20
                while not side.finished(idle=True)[1]:
                    assert time.monotonic() < deadline, f"rank {rank}'s load did not end"
                errors = side.take_load_errors()
                assert not errors, f"load errors {errors}"
                left = pinned()
                assert left == (len(src) if rank == 0 else 0), f"after rank {rank}: {left} pinned"
    finally:
        for side in (*sa, *sb):
            side.close()
    got = np.concatenate([e.read(dst, tokens) for e in b])
    return np.concatenate([want[0], want[0]]), got, all(e.untouched(dst) for e in b)


@dataclasses.dataclass
class _Request:
    request_id: str
    block_hashes: list[bytes]
    num_tokens: int
    kv_transfer_params: dict[str, Any] | None = None


def _planned_load(
    endpoint: str, fp: str, keys: list[bytes], blocks: list[int], block_size: int
) -> StepPlan:
    """The plan of a TP-2 MLA engine's scheduler half for a request whose blocks are cached."""
    side = SchedulerSide(
        ConnectorSettings(endpoint=endpoint),
        role="kv_both",
        engine_id="sched",
        fingerprint=fp,
        block_size=block_size,
        tp_size=2,
        prefix_cache=True,
        replicated=True,
    )
    side.start()
    try:
        request = _Request("r", keys, len(keys) * block_size)
        deadline = time.monotonic() + 10
        while (answer := side.lookup(request, 0))[0] is None:
            assert time.monotonic() < deadline, "no lookup answer"
            time.sleep(0.005)
        assert answer == (len(keys) * block_size, True), answer
        side.after_alloc(request, blocks, len(keys) * block_size)
        plan = side.build([], [])
        (load,) = plan.loads
        assert load.asynchronous and load.pin_id and load.block_ids == blocks, load
        return plan
    finally:
        side.close()


def pull(endpoint: str, case: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, bool]:
    """A producer publishes a request; a consumer of another layout (and TP) pulls it."""
    prod = Engine(case["producer"])
    tp = int(case.get("consumer_tp", 1))
    cons = [Engine(case["consumer"]) for _ in range(tp)]
    src, dst = case["src_ids"], case["dst_ids"]
    tokens = len(dst) * cons[0].block_size
    want_all = prod.write(src, tokens, seed=7)
    name = case["name"]
    producer = worker(endpoint, prod, f"p-{name}")
    consumers = [worker(endpoint, c, f"c-{name}", r, tp) for r, c in enumerate(cons)]
    try:
        from kvsidecar.client import SidecarClient

        with SidecarClient(endpoint, heartbeat=False) as client:
            client.publish(f"p-{name}", "req", src)
            daemon_id = client.daemon.daemon_id if client.daemon else ""
        for side in consumers:
            spec = PullSpec("req-d", f"p-{name}", "req", "", daemon_id, src, dst)
            side.start_loads(StepPlan(1, "fp", pulls=[spec]))
        for side in consumers:
            deadline = time.monotonic() + 20
            received: set[str] = set()
            while not received and time.monotonic() < deadline:
                _, received, failed = side.finished(idle=True)
                assert not failed, f"pull failed: {failed}"
            assert received == {"req-d"}, "the pull did not end"
            errors = side.take_load_errors()
            assert not errors, f"load errors {errors}"
    finally:
        producer.close()
        for side in consumers:
            side.close()
    got = [c.read(dst, tokens) for c in cons]
    return (
        _heads_of_ranks(want_all, prod, tp, tokens),
        np.concatenate(got),
        all(c.untouched(dst) for c in cons),
    )


def _heads_of_ranks(bits: np.ndarray, prod: Engine, tp: int, tokens: int) -> np.ndarray:
    """The producer's tokens as ``tp`` consumer ranks hold them: rank r, heads r*H/tp onward."""
    if tp == 1:
        return bits
    parts = 1 if prod.mla else 2
    chunks = bits.reshape(LAYERS * parts, tokens, prod.heads, prod.head_size)
    rank_heads = prod.heads // tp
    return np.concatenate(
        [chunks[:, :, r * rank_heads : (r + 1) * rank_heads].reshape(-1) for r in range(tp)]
    )


def main() -> None:
    endpoint, cases_file, out_file = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    cases = json.loads(cases_file.read_text())
    arrays: dict[str, np.ndarray] = {}
    report: dict[str, Any] = {}
    for case in cases:
        name = case["name"]
        if case["kind"] == "refuse":
            engine = Engine(case["engine"])
            if not case.get("named", True):
                engine.config.kv_cache_layout = None  # read from the strides alone
            try:
                paged_views(engine.views, engine.config, use_mla=engine.mla)
            except LayoutUnknown as exc:
                report[name] = {"refused": str(exc)}
            else:
                report[name] = {"registered": True}
            continue
        run = {"store": store_and_load, "pull": pull, "replicated": replicated}[case["kind"]]
        want, got, untouched = run(endpoint, case)
        arrays[f"{name}.want"], arrays[f"{name}.got"] = want, got
        report[name] = {"untouched": untouched}
    np.savez(out_file, **arrays)  # type: ignore[arg-type]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
