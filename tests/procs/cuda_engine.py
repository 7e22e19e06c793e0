"""A stand-in GPU engine: runs one check against a daemon the way an engine would.

    python tests/procs/cuda_engine.py CHECK ENDPOINT [--device cuda|cpu]

Prints one JSON line ``{"check", "ok", "detail", ...}`` and exits 0 when the check passed. Used
by tests/memory/test_gpu.py (the daemon is always another process: CUDA IPC cannot open a handle in
the process that exported it) and benchmarks/gpu_check.sh; ``--device cpu`` runs the same steps
on shared CPU memory, which is how tests/memory/test_cuda_vmm.py checks this script's own logic.

Checks:
- ``roundtrip``: engine A (NHD) -> A's host mirror -> engine B (HND: the daemon fixes the layout
  on B's memory), A -> B directly, and A -> C (HND, blocks twice as large: the block-size fix);
  every destination block compared element by element with its source, untouched blocks too.
- ``events``: a kernel still writing A's blocks when the offload is sent (a sleep kernel, then
  a fill, on the caller's stream, nothing synchronised) must not be read early; the onboard's
  result must be visible to the next kernel on that stream. A control without events reports
  whether it read stale data (informative: it shows the check can see the race).
- ``vmm``: A's cache in memory legacy CUDA IPC cannot share (run with
  ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``): registered as ``cuda_vmm``, moved and
  checked as in ``roundtrip``.
- ``refused``: the same memory against a daemon without ``cuda_vmm``: a typed ``not_shareable``
  naming the setting (or, against a daemon that cannot see this GPU, ``handle_error``).
- ``connector``: the vLLM connector's GPU path: caches allocated as vLLM 0.31+ does (one buffer,
  a ``[B, H, N, K+V]`` view per layer, ``LBNHC`` and ``LBHNC``), registered through
  `paged_views` and `WorkerSide`; A's blocks written behind a sleep kernel and stored at once
  (the store must wait for the writes), loaded into B, and pulled into C (HND, blocks twice as
  large); tokens compared as the attention backends read them. A control store without events
  reports whether it read stale data.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from types import SimpleNamespace
from typing import Any

import torch

from kvsidecar.client import BufferSetRef, SidecarClient, SidecarError, WorkerRef
from kvsidecar.integrations.vllm.layout import paged_views
from kvsidecar.integrations.vllm.plan import LoadSpec, PullSpec, StepPlan, StoreSpec
from kvsidecar.integrations.vllm.settings import ConnectorSettings
from kvsidecar.integrations.vllm.worker import WorkerSide
from kvsidecar.memory import HandleError, allocate_kv_caches

LAYERS = 2
BLOCKS = 32
TOKENS, HEADS, HEAD = 16, 4, 64
DTYPE = torch.float16


def make_cache(
    device: torch.device, *, hnd: bool = False, tokens: int = TOKENS, blocks: int = BLOCKS
) -> list[torch.Tensor]:
    """``LAYERS`` kv_first layers in one allocation, as logical ``(2, B, N, H, C)`` views."""
    phys = (2, blocks, HEADS, tokens, HEAD) if hnd else (2, blocks, tokens, HEADS, HEAD)
    if device.type == "cpu":
        layers = allocate_kv_caches(LAYERS, phys, DTYPE)
    else:
        layers = list(torch.zeros((LAYERS, *phys), dtype=DTYPE, device=device).unbind(0))
    return [t.permute(0, 1, 3, 2, 4) if hnd else t for t in layers]


def register(
    client: SidecarClient, caches: list[torch.Tensor], engine: str, *, hnd: bool = False, **kw: Any
) -> WorkerRef:
    layers = {f"l{i}": t for i, t in enumerate(caches)}
    order = "HND" if hnd else "NHD"
    return client.register_kv_caches(layers, engine_id=engine, memory_order=order, **kw).worker


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compare(
    dst: list[torch.Tensor], dst_ids: list[int], src: list[torch.Tensor], src_ids: list[int]
) -> str:
    """'' when every destination block holds its source block (logical order), else why not."""
    for layer, (d, s) in enumerate(zip(dst, src, strict=True)):
        got = d[:, dst_ids].cpu()
        want = s[:, src_ids].cpu()
        if not torch.equal(got, want):
            bad = (got != want).nonzero()[0].tolist()
            return f"layer {layer}: block {dst_ids[bad[1]]} differs at {bad}"
    return ""


def compare_packed(
    c: list[torch.Tensor], c_ids: list[int], a: list[torch.Tensor], a_ids: list[int]
) -> str:
    """'' when block c_ids[j] (2x the tokens) holds A's blocks a_ids[2j], a_ids[2j+1] in order."""
    for layer, (cc, aa) in enumerate(zip(c, a, strict=True)):
        for j, cid in enumerate(c_ids):
            want = torch.cat([aa[:, a_ids[2 * j]], aa[:, a_ids[2 * j + 1]]], dim=1).cpu()
            if not torch.equal(cc[:, cid].cpu(), want):
                return f"layer {layer}: packed block {cid} differs"
    return ""


def untouched(cache: list[torch.Tensor], written: set[int]) -> str:
    for layer, t in enumerate(cache):
        others = [b for b in range(t.shape[1]) if b not in written]
        if bool(t[:, others].ne(0).any()):
            return f"layer {layer}: a block that no move wrote is not zero"
    return ""


def roundtrip(endpoint: str, device: torch.device) -> dict[str, Any]:
    a, b = make_cache(device), make_cache(device, hnd=True)
    c = make_cache(device, hnd=True, tokens=2 * TOKENS, blocks=BLOCKS // 2)
    gen = torch.Generator().manual_seed(1)
    for t in a:
        t.copy_(torch.randn(t.shape, generator=gen).to(DTYPE))
    sync(device)
    with (
        SidecarClient(endpoint, timeout_s=60, heartbeat=False) as ca,
        SidecarClient(endpoint, timeout_s=60, heartbeat=False) as cb,
    ):
        wa = register(ca, a, "A", host_blocks=16)
        wb = register(cb, b, "B", hnd=True)
        wc = register(cb, c, "C", hnd=True)
        cb.grant("A", read=False, write=True, owner=wb)
        cb.grant("A", read=False, write=True, owner=wc)
        kinds = sorted(
            {layer.kind for e in ca.status().engines for w in e.workers for layer in w.layers}
        )
        host = [int(i) for i in ca.host_alloc("A", 8)]
        src, via_host = [3, 4, 5, 9, 20, 21, 22, 31], [0, 1, 2, 10, 11, 12, 30, 15]
        ca.offload(wa, src, host)
        moved = ca.move(BufferSetRef(wa, "host"), BufferSetRef(wb), host, via_host)
        ca.move(BufferSetRef(wa), BufferSetRef(wb), [7, 8], [5, 6])
        ca.move(BufferSetRef(wa), BufferSetRef(wc), [0, 1, 6, 2], [3, 9])
        sync(device)
        problems = [
            compare(b, via_host, a, src),
            compare(b, [5, 6], a, [7, 8]),
            untouched(b, {*via_host, 5, 6}),
            compare_packed(c, [3, 9], a, [0, 1, 6, 2]),
            untouched(c, {3, 9}),
            "" if moved.fixed else "the HND destination was not fixed",
        ]
        for w, client in ((wa, ca), (wb, cb), (wc, cb)):
            client.unregister(w)
    detail = "; ".join(p for p in problems if p)
    return {"ok": not detail, "detail": detail or "all blocks match", "kinds": kinds}


def sleep_then_fill(
    layers: list[torch.Tensor], blocks: list[int], value: float, seconds: float
) -> None:
    """Enqueue on the current stream: a kernel that spins ``seconds``, then the fills."""
    torch.cuda._sleep(int(seconds * 2e9))  # cycles: about 2 GHz on the GPUs this runs on
    for t in layers:
        t[:, blocks] = value


def events(endpoint: str, device: torch.device) -> dict[str, Any]:
    a = make_cache(device)
    sync(device)
    with SidecarClient(endpoint, timeout_s=60, heartbeat=False) as client:
        w = register(client, a, "E", host_blocks=8)
        host = [int(i) for i in client.host_alloc("E", 4)]
        gpu = client._session.cuda_syncs.get(w) is not None
        # The offload is sent while the sleep kernel still runs and the fill waits behind it.
        sleep_then_fill(a, [1, 2], 7.0, 0.5)
        started = time.monotonic()
        client.offload(w, [1, 2], host[:2])
        waited = time.monotonic() - started
        client.onboard(w, host[:2], [5, 6])
        # No synchronise: the next kernel on the caller's stream must see the onboarded blocks.
        seen = [t[:, [5, 6]].clone() for t in a]
        ok = all(bool((s == 7.0).all()) for s in seen)
        # Control without events: the daemon's copy does not wait for the caller's stream.
        syncs = dict(client._session.cuda_syncs)
        client._session.cuda_syncs.clear()
        sleep_then_fill(a, [3], 9.0, 0.5)
        client.offload(w, [3], host[2:3])
        client._session.cuda_syncs.update(syncs)
        client.onboard(w, host[2:3], [7])
        stale = not all(bool((t[:, 7] == 9.0).all()) for t in a)
        sync(device)
        client.unregister(w)
    detail = (
        f"offload answered after {waited:.2f} s (the kernel ran 0.5 s); onboarded blocks "
        f"{'right' if ok else 'WRONG'} on the next kernel; control without events read "
        f"{'stale' if stale else 'current'} data"
    )
    return {"ok": ok and gpu, "detail": detail if gpu else "no GPU sync on this worker"}


def vmm(endpoint: str, device: torch.device) -> dict[str, Any]:
    from kvsidecar.memory import cuda_driver

    probe = make_cache(device)
    legacy = cuda_driver.driver().legacy_ipc_capable(probe[0].data_ptr())
    if legacy:
        return {
            "ok": False,
            "detail": "the cache is in legacy-IPC memory: expandable_segments off?",
        }
    result = roundtrip(endpoint, device)
    if result["kinds"] != ["cuda_vmm"]:
        result.update(ok=False, detail=f"registered as {result['kinds']}, not cuda_vmm")
    return result


def refused(endpoint: str, device: torch.device) -> dict[str, Any]:
    a = make_cache(device)
    with SidecarClient(endpoint, timeout_s=60, heartbeat=False) as client:
        try:
            register(client, a, "R")
        except (HandleError, SidecarError) as exc:
            code = getattr(exc, "code", "")
            return {
                "ok": code in ("not_shareable", "handle_error"),
                "detail": str(exc),
                "code": code,
            }
    return {"ok": False, "detail": "registered: it should have been refused"}


def paged_cache(
    device: torch.device, layout: str, tokens: int, blocks: int = BLOCKS
) -> tuple[dict[str, torch.Tensor], SimpleNamespace]:
    """vLLM 0.31+'s allocation for a layer-compact layout: one int8 buffer, a ``[B, H, N, K+V]``
    view per layer (``LBNHC``: tokens outer in a block, ``LBHNC``: heads outer), and the
    ``KVCacheConfig`` fields the connector reads."""
    cell = 2 * HEAD
    page = HEADS * tokens * cell * DTYPE.itemsize
    raw = torch.zeros(LAYERS * blocks * page, dtype=torch.int8, device=device)
    views = {}
    for layer in range(LAYERS):
        region = raw[layer * blocks * page : (layer + 1) * blocks * page].view(DTYPE)
        if layout == "LBNHC":
            view = region.view(blocks, tokens, HEADS, cell).permute(0, 2, 1, 3)
        else:
            view = region.view(blocks, HEADS, tokens, cell)
        views[f"layer{layer}"] = view
    return views, SimpleNamespace(kv_cache_layout=layout, num_blocks=blocks)


def kv_tokens(views: dict[str, torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """Every layer's K and V of the blocks' tokens, as the attention backends split a view."""
    parts = []
    for view in views.values():
        for part in view.transpose(1, 2).split(HEAD, dim=-1):  # (B, N, H, C) each
            parts.append(part[block_ids].reshape(-1, HEADS, HEAD).cpu())
    return torch.stack(parts)


def paged_worker(endpoint: str, name: str, views: dict[str, torch.Tensor], config: Any) -> Any:
    """A connector worker half on ``views``, registered (waits for the registration)."""
    settings = ConnectorSettings(endpoint=endpoint, load_timeout_s=30.0, store_wait_s=30.0)
    side = WorkerSide(settings, engine_id=name, tp_rank=0, tp_size=1, model_hash="m")
    side.register(*paged_views(views, config, use_mla=False))
    deadline = time.monotonic() + 30
    while side._client() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if side._client() is None:
        raise RuntimeError(f"worker {name} did not register")
    return side


def write_behind_a_kernel(views: dict[str, torch.Tensor], blocks: list[int], seed: int) -> None:
    """Fill the blocks' cells with random values, behind a 0.5 s kernel on a GPU."""
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(v[blocks].shape, generator=gen).to(DTYPE) for v in views.values()]
    on_device = [x.to(next(iter(views.values())).device) for x in values]
    if next(iter(views.values())).is_cuda:
        torch.cuda._sleep(int(0.5 * 2e9))
    for view, x in zip(views.values(), on_device, strict=True):
        view[blocks] = x


def connector(endpoint: str, device: torch.device) -> dict[str, Any]:
    a, a_config = paged_cache(device, "LBNHC", TOKENS)
    b, b_config = paged_cache(device, "LBNHC", TOKENS)
    c, c_config = paged_cache(device, "LBHNC", 2 * TOKENS)
    sync(device)
    sa = paged_worker(endpoint, "PA", a, a_config)
    sb = paged_worker(endpoint, "PB", b, b_config)
    sc = paged_worker(endpoint, "PC", c, c_config)
    details: list[str] = []
    try:
        client = sa._client()
        gpu = client._session.cuda_syncs.get(client.worker) is not None
        keys = [bytes([i]) * 32 for i in (1, 2)]
        write_behind_a_kernel(a, [1, 2, 3, 4], seed=1)
        sa.store(StepPlan(1, "fp", stores=[StoreSpec(keys, [1, 2], "r")]))  # no synchronise
        sa.fence(["r"])
        sb.start_loads(StepPlan(1, "fp", loads=[LoadSpec("r", keys, [5, 6])]))
        errors = sb.take_load_errors()
        loaded = not errors and torch.equal(kv_tokens(b, [5, 6]), kv_tokens(a, [1, 2]))
        details.append(f"stored behind the kernel and loaded: {'right' if loaded else 'WRONG'}")
        with SidecarClient(endpoint, heartbeat=False) as scheduler:
            scheduler.publish("PA", "req", [1, 2, 3, 4])
            daemon_id = scheduler.daemon.daemon_id if scheduler.daemon else ""
        pull = PullSpec("req-c", "PA", "req", "", daemon_id, [1, 2, 3, 4], [0, 1])
        sc.start_loads(StepPlan(1, "fp", pulls=[pull]))
        received: set[str] = set()
        deadline = time.monotonic() + 30
        while not received and time.monotonic() < deadline:
            received = sc.finished(idle=True)[1]
        pulled = received == {"req-c"} and not sc.take_load_errors()
        pulled = pulled and torch.equal(kv_tokens(c, [0, 1]), kv_tokens(a, [1, 2, 3, 4]))
        details.append(f"pulled into HND blocks of 32: {'right' if pulled else 'WRONG'}")
        # Control without events: the store does not wait for the caller's stream.
        syncs = dict(client._session.cuda_syncs)
        client._session.cuda_syncs.clear()
        write_behind_a_kernel(a, [7], seed=2)
        sa.store(StepPlan(2, "fp", stores=[StoreSpec([b"\x03" * 32], [7], "s")]))
        sa.fence(["s"])
        client._session.cuda_syncs.update(syncs)
        sb.start_loads(StepPlan(2, "fp", loads=[LoadSpec("s", [b"\x03" * 32], [8])]))
        stale = not torch.equal(kv_tokens(b, [8]), kv_tokens(a, [7]))
        details.append(f"control without events read {'stale' if stale else 'current'} data")
        sync(device)
    finally:
        for side in (sa, sb, sc):
            side.close()
    ok = loaded and pulled and (gpu or device.type == "cpu")
    return {"ok": ok, "detail": "; ".join(details), "events": gpu}


CHECKS = {
    "roundtrip": roundtrip,
    "events": events,
    "vmm": vmm,
    "refused": refused,
    "connector": connector,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("check", choices=sorted(CHECKS))
    parser.add_argument("endpoint")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    try:
        result = CHECKS[args.check](args.endpoint, device)
    except Exception as exc:
        result = {
            "ok": False,
            "detail": f"{type(exc).__name__}: {exc}",
            "trace": traceback.format_exc(),
        }
    if device.type == "cuda":
        index = device.index or 0
        result["gpu"] = f"{torch.cuda.get_device_name(index)} (local index {index})"
    print(json.dumps({"check": args.check, **result}), flush=True)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
