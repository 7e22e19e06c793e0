"""vLLM's GPU cache views (vLLM 0.31+: one buffer, a ``[B, H, N, C]`` view per layer), on the CPU.

tests/procs/vllm_paged.py builds each engine's cache with vLLM's own ``create_kv_cache_views``
under each ``KVCacheLayout`` the connector takes (``LBNHC``, ``LBHNC``; MLA's latent too; kernel
blocks smaller than the scheduler's), registers it through the connector's path on a real
daemon, and moves a request's blocks by `WorkerSide`'s stores and loads and its pulls between
engines of other memory orders, block sizes and TP sizes; MLA under TP 2 is stored once (rank
0's namespace) and loaded into both ranks. What the destination's attention
backend reads (vLLM's own split of its view into K and V) must be, element by element, what the
source's backend wrote; every other block must stay as it was. The layouts that cannot be held
are refused at registration, by name.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from kvsidecar.peer.handshake import IncompatiblePeer, check_compatible, compat_hash
from kvsidecar.peer.messages import CompatInfo, PeerEngine
from kvsidecar.wire.types import Arrangement
from tests.support import ROOT, python_env
from tests.support.daemons import daemon_process, make_config
from tests.support.vllm_serve import vllm_venv_params

pytestmark = pytest.mark.timeout(300)


def _engine(layout: str, dtype: str, block_size: int, **kw: Any) -> dict[str, Any]:
    return {
        "layout": layout,
        "dtype": dtype,
        "block_size": block_size,
        "heads": kw.pop("heads", 2),
        "head_size": kw.pop("head_size", 16),
        "num_blocks": kw.pop("num_blocks", 8),
        **kw,
    }


STORES = [
    ("nhd-bf16", _engine("LBNHC", "bfloat16", 16)),
    ("hnd-fp16", _engine("LBHNC", "float16", 16, heads=4, head_size=8)),
    ("nhd-fp32-kernel-blocks", _engine("LBNHC", "float32", 32, kernel_block_size=16)),
    ("hnd-fp8", _engine("LBHNC", "float8_e4m3fn", 16)),
    ("mla-nhd-bf16", _engine("LBNHC", "bfloat16", 16, mla=True, head_size=24)),
    ("mla-hnd-kernel-blocks", _engine("LBHNC", "float16", 32, mla=True, kernel_block_size=16)),
]
PULLS = [
    # (name, producer, consumer, consumer TP ranks)
    ("nhd16-to-hnd32", _engine("LBNHC", "bfloat16", 16), _engine("LBHNC", "bfloat16", 32), 1),
    ("hnd16-to-nhd16", _engine("LBHNC", "float16", 16), _engine("LBNHC", "float16", 16), 1),
    ("hnd16-to-hnd64", _engine("LBHNC", "float32", 16), _engine("LBHNC", "float32", 64), 1),
    (
        "kernel-blocks-to-hnd32",
        _engine("LBNHC", "bfloat16", 32, kernel_block_size=16),
        _engine("LBHNC", "bfloat16", 32),
        1,
    ),
    (
        "tp1-to-tp2",
        _engine("LBHNC", "bfloat16", 16, heads=4),
        _engine("LBNHC", "bfloat16", 32, heads=2),
        2,
    ),
    (
        "mla-nhd16-to-hnd32",
        _engine("LBNHC", "bfloat16", 16, mla=True, head_size=24),
        _engine("LBHNC", "bfloat16", 32, mla=True, head_size=24),
        1,
    ),
]
REFUSED = [
    ("BLNHC", _engine("BLNHC", "bfloat16", 16), True, "BLNHC does not keep a layer's block"),
    ("BLHNC", _engine("BLHNC", "bfloat16", 16), True, "BLHNC does not keep a layer's block"),
    ("LHBNC", _engine("LHBNC", "bfloat16", 16), True, "LHBNC does not keep a layer's block"),
    ("BHLNC", _engine("BHLNC", "bfloat16", 16), True, "BHLNC does not keep a layer's block"),
    ("BLNHC-unnamed", _engine("BLNHC", "bfloat16", 16), False, "cannot be registered"),
    (
        "hnd-kernel-blocks",
        _engine("LBHNC", "bfloat16", 32, kernel_block_size=16),
        True,
        "VLLM_KV_CACHE_LAYOUT=LBNHC",
    ),
]


def _cases() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    for name, engine in STORES:
        ids = {"src_ids": [5, 2, 7], "dst_ids": [1, 6, 3]}
        cases.append({"name": name, "kind": "store", "engine": engine, **ids})
    for name, producer, consumer, tp in PULLS:
        ratio = consumer["block_size"] // producer["block_size"]
        dst = [4, 1]
        src = [[6, 0, 3, 5, 2, 7, 1, 4][i] for i in range(len(dst) * ratio)]
        cases.append(
            {
                "name": name,
                "kind": "pull",
                "producer": producer,
                "consumer": consumer,
                "consumer_tp": tp,
                "src_ids": src,
                "dst_ids": dst,
            }
        )
    mla = _engine("LBNHC", "bfloat16", 16, mla=True, head_size=24)
    ids = {"src_ids": [4, 0, 6], "dst_ids": [2, 7, 5]}
    cases.append({"name": "mla-tp2-stored-once", "kind": "replicated", "engine": mla, **ids})
    for name, engine, named, _ in REFUSED:
        cases.append({"name": name, "kind": "refuse", "engine": engine, "named": named})
    return cases


@pytest.mark.parametrize("venv", vllm_venv_params(engines=False))
def test_vllm_gpu_views_move_element_by_element_and_what_cannot_is_refused(
    venv: Path, tmp_path: Path
) -> None:
    cases = _cases()
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    out = tmp_path / "out.npz"
    config = make_config(host_pool_bytes=16 << 20, cache_bytes=8 << 20)
    with daemon_process(config) as daemon:
        run = subprocess.run(
            [
                str(venv / "bin" / "python"),
                "-m",
                "tests.procs.vllm_paged",
                daemon.config.endpoint,
                str(tmp_path / "cases.json"),
                str(out),
            ],
            cwd=ROOT,
            env=python_env(),
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    arrays = np.load(out)
    for case in cases:
        name = case["name"]
        if case["kind"] == "refuse":
            continue
        want, got = arrays[f"{name}.want"], arrays[f"{name}.got"]
        # Mostly distinct values (fp8 has 256 in all), so that a misplaced element shows.
        assert len(np.unique(want)) > min(want.size // 8, 100), name
        np.testing.assert_array_equal(got, want, err_msg=name)
        assert report[name] == {"untouched": True}, name
    for name, _, _, why in REFUSED:
        assert why in report[name].get("refused", ""), (name, report[name])


def test_cells_are_never_exchanged_with_another_arrangement() -> None:
    """A peer daemon refuses to pair K-then-V cells with any other arrangement, one region or
    two; two engines of cells pair whatever their memory orders."""
    compat = CompatInfo("m", "bfloat16", 32, 2, 1, False)

    def engine(arrangement: Arrangement, order: str = "NHD") -> PeerEngine:
        return PeerEngine(
            engine_id=arrangement,
            compat=compat,
            compat_hash=compat_hash(compat),
            tp_size=1,
            pp_size=1,
            dcp_size=1,
            arrangement=arrangement,
            memory_order="HND" if order == "HND" else "NHD",
            block_size=32,
            workers=[],
        )

    check_compatible(engine("kv_cells"), engine("kv_cells", "HND"))
    # A packed cache (vLLM's NVFP4: uint8, K's and V's heads in two groups) moves whole blocks
    # between engines of one TP size, never head slices; an MLA latent has no heads to slice.
    packed = CompatInfo("m", "uint8", 32, 2, 1, False)
    latent = CompatInfo("m", "uint8", 32, 1, 1, True)
    for info, tp, ok in ((packed, 1, True), (packed, 2, False), (latent, 2, True)):
        local = msgspec.structs.replace(engine("kv_cells"), compat=info, compat_hash="h")
        remote = msgspec.structs.replace(local, tp_size=tp)
        if ok:
            check_compatible(local, remote)
        else:
            with pytest.raises(IncompatiblePeer, match="cannot be sliced between ranks"):
                check_compatible(local, remote)
    for other in ("split", "kv_first", "blocks_first", "vllm_cpu"):
        with pytest.raises(IncompatiblePeer, match=r"arrangement 'kv_cells' here"):
            check_compatible(engine("kv_cells"), engine(other))  # type: ignore[arg-type]
        with pytest.raises(IncompatiblePeer):
            check_compatible(engine(other), engine("kv_cells"))  # type: ignore[arg-type]
