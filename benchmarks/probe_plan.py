"""Probe: what planning one pull costs a consumer daemon (`kvsidecar.peer.plan.plan_rank`).

Builds a producer and a consumer engine as a handshake describes them (TP 1, ``--layers`` layers
of one descriptor, NHD, 16-token blocks of 8 KV heads of 128 channels in fp16, 512 blocks each)
and times `plan_rank` for pulls of ``--blocks`` blocks, in order and at random ids, ``--calls``
calls each; prints the median per call. A pull plans once per local rank and request, before any
byte moves, so this is part of every pull's fixed cost.

    .venv/bin/python benchmarks/probe_plan.py [--layers 32] [--blocks 8 128 512] [--calls 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvsidecar.core.topology import EngineTransferInfo
from kvsidecar.peer.messages import CompatInfo, PeerEngine, PeerWorker
from kvsidecar.peer.plan import plan_rank
from kvsidecar.wire.types import BufferDescriptor

NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE = 512, 16, 8, 128


def engine(engine_id: str, layers: int) -> PeerEngine:
    """A TP-1 engine of ``layers`` layers as its daemon's handshake describes it."""
    desc = BufferDescriptor("kv_first", "NHD", "float16", NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    transfer = EngineTransferInfo(
        remote_tp_size=1,
        remote_block_len=BLOCK_SIZE * HEADS * HEAD_SIZE * 2,
        remote_block_size=BLOCK_SIZE,
        remote_physical_blocks_per_logical=1,
    )
    worker = PeerWorker(
        tp_rank=0,
        pp_rank=0,
        dcp_rank=0,
        layers=names,
        descriptors=[desc] * layers,
        transfer=transfer,
    )
    compat = CompatInfo("m", "float16", HEAD_SIZE, HEADS, layers, is_mla=False)
    return PeerEngine(
        engine_id=engine_id,
        compat=compat,
        compat_hash="same",
        tp_size=1,
        pp_size=1,
        dcp_size=1,
        arrangement="kv_first",
        memory_order="NHD",
        block_size=BLOCK_SIZE,
        workers=[worker],
    )


def main() -> None:
    """Time the plans and print one line per pull size and id order."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, nargs="+", default=[8, 128, 512])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    producer, consumer = engine("producer", args.layers), engine("consumer", args.layers)
    worker = consumer.workers[0]
    rng = np.random.default_rng(0)
    for n in args.blocks:
        orders = {
            "in order": (np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64)),
            "random": (rng.permutation(NUM_BLOCKS)[:n], rng.permutation(NUM_BLOCKS)[:n]),
        }
        for name, (remote, local) in orders.items():
            times = []
            for _ in range(args.calls):
                start = time.perf_counter()
                plan_rank(consumer, worker, producer, remote, local)
                times.append(time.perf_counter() - start)
            median = statistics.median(times) * 1e6
            print(f"{args.layers} layers, {n} blocks {name}: {median:.0f} µs", flush=True)


if __name__ == "__main__":
    main()
