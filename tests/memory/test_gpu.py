"""What only a GPU can show: run with ``pytest -m gpu``, or benchmarks/gpu_check.sh.

The daemon is always a process of its own (CUDA IPC cannot open a handle in the process that
exported it), and so is each engine that needs its own environment (allocator settings,
``CUDA_VISIBLE_DEVICES``): tests/procs/cuda_engine.py, whose checks
tests/memory/test_cuda_ipc.py runs on CPU memory too. Every result is compared element by element
with its source.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvsidecar.core.fixes import fix_received
from kvsidecar.memory import HostPool
from kvsidecar.memory.cuda_ipc import device_uuid
from tests.support import ROOT
from tests.support.daemons import DaemonProcess, config_env, daemon_process, make_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(240),
]

EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


@contextlib.contextmanager
def gpu_daemon(env: dict[str, str] | None = None) -> Iterator[DaemonProcess]:
    with daemon_process(make_config(host_pool_bytes=64 << 20), env) as daemon:
        yield daemon


def engine(check: str, daemon: DaemonProcess, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one tests/procs/cuda_engine.py check as its own process; its JSON verdict."""
    endpoint = daemon.config.endpoint
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "procs" / "cuda_engine.py"), check, endpoint],
        input="",
        capture_output=True,
        text=True,
        timeout=180,
        env={**config_env(daemon.config), **(env or {})},
        cwd=ROOT,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no verdict (exit {proc.returncode}):\n{proc.stderr}\n{daemon.log()}"
    result: dict[str, Any] = json.loads(lines[-1])
    result["stderr"] = proc.stderr[-4000:]
    print(json.dumps({k: v for k, v in result.items() if k != "stderr"}))
    return result


def test_gpu_engine_to_host_pool_to_other_engine() -> None:
    """CUDA-registered buffers: A -> host pool -> B (HND, fixed on the GPU), A -> B, A -> C."""
    with gpu_daemon() as daemon:
        result = engine("roundtrip", daemon, {})
    assert result["ok"] and result["kinds"] == ["cuda_ipc"], result


def test_gpu_move_waits_for_the_engines_kernel() -> None:
    """A block still being written when the move is sent is read after the write, not before."""
    with gpu_daemon() as daemon:
        result = engine("events", daemon)
    assert result["ok"], result


def test_gpu_connector_paged_views_store_load_and_pull_after_the_engines_kernel() -> None:
    """vLLM 0.31+'s cache views through the connector: stores wait for the forward's writes."""
    with daemon_process(make_config(host_pool_bytes=64 << 20, cache_bytes=32 << 20)) as daemon:
        result = engine("connector", daemon)
    assert result["ok"] and result["events"], result


def test_gpu_vmm_path_serves_expandable_segments() -> None:
    """A cache legacy CUDA IPC cannot share goes by VMM fds and moves like any other."""
    with gpu_daemon() as daemon:
        result = engine("vmm", daemon, EXPANDABLE)
    assert result["ok"], result


def test_gpu_vmm_refused_by_a_daemon_without_it_names_the_setting() -> None:
    with gpu_daemon({"KVSIDECAR_LIBCUDA": "/nonexistent/libcuda.so.1"}) as daemon:
        result = engine("refused", daemon, EXPANDABLE)
    assert result["ok"] and result["code"] == "not_shareable", result
    assert "expandable_segments" in result["detail"]


def test_gpu_processes_with_different_visible_devices() -> None:
    """The engine names its GPU by index 0 or N-1; the daemon by UUID: same GPU, right index."""
    last = torch.cuda.device_count() - 1
    with gpu_daemon({"CUDA_VISIBLE_DEVICES": device_uuid(last)}) as daemon:
        result = engine("roundtrip", daemon, {"CUDA_VISIBLE_DEVICES": str(last)})
    assert result["ok"], result
    # A daemon that sees no GPU at all refuses the registration with a typed error.
    with gpu_daemon({"CUDA_VISIBLE_DEVICES": ""}) as daemon:
        result = engine("refused", daemon)
    assert result["ok"] and result["code"] == "handle_error", result
    if last >= 1:  # the daemon sees GPU 0 only, the engine runs on another one
        with gpu_daemon({"CUDA_VISIBLE_DEVICES": "0"}) as daemon:
            result = engine("refused", daemon, {"CUDA_VISIBLE_DEVICES": str(last)})
        assert result["ok"] and "device_not_visible" in result["detail"], result


@pytest.mark.parametrize(
    ("remote", "local", "ratio", "arrangement"),
    [
        ("HND", "NHD", 1, "kv_first"),
        ("NHD", "HND", 1, "kv_first"),
        ("NHD", "HND", 2, "blocks_first"),
        ("HND", "HND", 4, "kv_first"),
    ],
)
def test_gpu_fix_received_matches_cpu(
    remote: str, local: str, ratio: int, arrangement: str
) -> None:
    gen = torch.Generator().manual_seed(ratio)
    # The memory in ``local`` order: HND is (.., H, N, C) in memory, viewed as (.., N, H, C).
    tokens_heads = (4, 16) if local == "HND" else (16, 4)
    lead = (2, 12) if arrangement == "kv_first" else (12, 2)
    phys = torch.randn((*lead, *tokens_heads, 32), generator=gen).to(torch.bfloat16)
    as_local = (lambda t: t.permute(0, 1, 3, 2, 4)) if local == "HND" else (lambda t: t)
    cpu, gpu = as_local(phys.clone()), as_local(phys.cuda())
    ids = [0, 5, 6, 11]
    kw: dict[str, Any] = {
        "remote_layout": remote,
        "local_layout": local,
        "block_size_ratio": ratio,
        "arrangement": arrangement,
    }
    fix_received(cpu, ids, **kw)
    fix_received(gpu, torch.tensor(ids, device="cuda"), **kw)
    assert not torch.equal(cpu, as_local(phys))  # the fix did change the blocks
    assert torch.equal(gpu.cpu(), cpu)


def test_gpu_pinned_host_pool() -> None:
    pool = HostPool(8 << 20)
    try:
        assert pool.pinned and pool.arena.is_pinned()
        extent = pool.reserve(1 << 20)
        extent.flat.copy_(torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8))
        on_gpu = extent.flat.to("cuda", non_blocking=True)
        back = torch.empty_like(extent.flat).pin_memory()
        back.copy_(on_gpu, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(back, extent.flat)
        extent.close()
    finally:
        pool.close()
