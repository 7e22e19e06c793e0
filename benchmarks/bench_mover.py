"""Block-copy benchmark: kvsidecar.core.mover + copier against a naive per-layer copy and memcpy.

The in-process half of ``kvsidecar bench local``, with two layouts and two thread counts: a thin
wrapper whose workload (caches, ids, copies, baselines, checks) is `kvsidecar.bench.workload`.

Each layer is one K-or-V tensor of shape (num_blocks, 16, 8, 128) float16 (32 KiB per block);
``--blocks`` block ids move per layer. With the defaults, 32 layers x 4096 blocks are 4 GiB per
side and 512 blocks x 32 layers = 512 MiB move per copy. Two id sets: random distinct ids, and
runs of ``--run-length`` consecutive ids on both sides. Measured, as GB/s (1e9 bytes/s):

- mover: ``validate_move`` + ``plan_runs`` + ``copy_runs``, with the layers allocated as one
  region (they stack) and as separate tensors (they do not), at the default thread count and at 1;
- naive: per layer ``dst.index_copy_(0, dst_idx, src.index_select(0, src_idx))``, at torch's
  default intra-op thread count and at 1 (ratios use the faster of the two);
- memcpy: ``np.copyto`` of the same number of bytes between two contiguous buffers.

The machine is shared, so the methods of one (layout, ids) pair are timed round-robin, one call
each per round, and every ratio compares medians from the same rounds. At most two caches (8 GiB
with the defaults) plus 2 x the moved bytes are alive at once. Every buffer is written before
timing so no page faults are measured, and every method's result is checked once.

    .venv/bin/python benchmarks/bench_mover.py [--layers 32] [--blocks 512] [--repeat 7]
        [--num-blocks 4096] [--run-length 16] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvsidecar.bench import workload
from kvsidecar.bench.common import round_robin
from kvsidecar.core import copier, mover

BLOCK_SHAPE = (16, 8, 128)  # block_size, num_kv_heads, head_size
DTYPE = torch.float16
TORCH_THREADS = torch.get_num_threads()


def bench_ids(
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    memcpy: Callable[[], None],
    layout: str,
    kind: str,
    ids: workload.IdPair,
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    nbytes = args.layers * args.blocks * int(np.prod(BLOCK_SHAPE)) * DTYPE.itemsize
    src_ids, dst_ids = ids
    s_idx, d_idx = torch.from_numpy(src_ids), torch.from_numpy(dst_ids)
    threads = copier.default_copy_threads() if args.threads is None else args.threads
    methods = [
        ("memcpy (np.copyto, contiguous)", memcpy),
        (f"mover, {threads} threads", workload.run_copy(src, dst, src_ids, dst_ids, args.threads)),
        ("mover, 1 thread", workload.run_copy(src, dst, src_ids, dst_ids, 1)),
        (
            f"naive index_copy_, torch {TORCH_THREADS} threads",
            workload.naive_copy(src, dst, s_idx, d_idx, TORCH_THREADS),
        ),
        ("naive index_copy_, torch 1 thread", workload.naive_copy(src, dst, s_idx, d_idx, 1)),
    ]
    for name, fn in methods:  # warm-up and check, untimed
        workload.reset_marks(dst)
        fn()
        if name != methods[0][0]:
            workload.check_blocks(dst, src_ids, dst_ids)
    rates = round_robin(methods, args.repeat, nbytes)
    runs = len(mover.plan_runs(src_ids, dst_ids))
    rows = []
    for name, _ in methods:
        rows.append(
            {"layout": layout, "ids": kind, "runs": runs, "method": name, "gbps": rates[name]}
        )
        print(f"  {layout:16s} {kind:7s} {name:38s} {statistics.median(rates[name]):6.2f} GB/s")
    return rows


def bench_layout(
    region: bool,
    args: argparse.Namespace,
    id_sets: dict[str, workload.IdPair],
    memcpy: Callable[[], None],
) -> list[dict[str, Any]]:
    src = workload.allocate(args.layers, args.num_blocks, BLOCK_SHAPE, DTYPE, region)
    dst = workload.allocate(args.layers, args.num_blocks, BLOCK_SHAPE, DTYPE, region)
    workload.mark_blocks(src)
    layout = "one region" if region else "separate tensors"
    rows = []
    for kind, ids in id_sets.items():
        rows += bench_ids(src, dst, memcpy, layout, kind, ids, args)
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown rows, with ratios against the same (layout, ids) block's naive and memcpy."""
    lines = [
        "| layout | ids | runs | method | GB/s median | min-max | vs naive | vs memcpy |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        r["median"] = statistics.median(r["gbps"])
    for r in rows:
        block = [o for o in rows if (o["layout"], o["ids"]) == (r["layout"], r["ids"])]
        # against the faster of the two naive variants
        naive = max(o["median"] for o in block if o["method"].startswith("naive"))
        memcpy = next(o["median"] for o in block if o["method"].startswith("memcpy"))
        r.update(vs_naive=r["median"] / naive, vs_memcpy=r["median"] / memcpy)
        lines.append(
            f"| {r['layout']} | {r['ids']} | {r['runs']} | {r['method']} | {r['median']:.2f} | "
            f"{min(r['gbps']):.2f}-{max(r['gbps']):.2f} | {r['vs_naive']:.2f} | "
            f"{r['vs_memcpy']:.2f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=512, help="blocks moved per layer")
    parser.add_argument("--num-blocks", type=int, default=4096, help="blocks per layer tensor")
    parser.add_argument("--run-length", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="mover threads (default: auto)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()

    nbytes = args.layers * args.blocks * int(np.prod(BLOCK_SHAPE)) * DTYPE.itemsize
    rng = np.random.default_rng(args.seed)
    id_sets = {
        "random": workload.make_ids("random", args.blocks, args.num_blocks, 1, rng),
        f"runs{args.run_length}": workload.make_ids(
            "runs", args.blocks, args.num_blocks, args.run_length, rng
        ),
    }
    print(
        f"{args.layers} layers x ({args.num_blocks}, {', '.join(map(str, BLOCK_SHAPE))}) float16, "
        f"{args.blocks} blocks/layer moved = {nbytes / 2**20:.0f} MiB per copy; "
        f"torch threads {torch.get_num_threads()}, mover threads "
        f"{args.threads or copier.default_copy_threads()}, {args.repeat} repeats",
        flush=True,
    )

    memcpy = workload.memcpy(nbytes)  # every page touched now
    rows = bench_layout(True, args, id_sets, memcpy)
    gc.collect()  # free one layout's two caches before the next is allocated
    rows += bench_layout(False, args, id_sets, memcpy)
    print()
    print("\n".join(table(rows)))
    if args.json:
        result = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "torch": torch.__version__,
                "numpy": np.__version__,
                "torch_threads": torch.get_num_threads(),
            },
            "args": vars(args),
            "moved_bytes": nbytes,
            "rows": rows,
        }
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
