"""What a daemon tells its peers about its engines, and whether two engines can share blocks.

`describe_engine` turns a registered engine into a `PeerEngine` (the handshake's unit);
`check_compatible` compares a local engine with a remote one and raises `IncompatiblePeer`
naming every field that differs, before any byte moves.

The compatibility hash covers what must be equal for raw block bytes to be reusable: the model
(the engines' ``model_hash``), the cache dtype, the head size, the total KV head count, the layer
count and MLA-ness. Sizes that may differ (TP, block size, memory order, PP, DCP) are not in it:
they travel as `EngineTransferInfo` and the transfer plan adapts to them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import msgspec

from kvsidecar.core import layout
from kvsidecar.core.layout import CPU_PACKED
from kvsidecar.core.topology import EngineTransferInfo
from kvsidecar.node.registry import Engine, Worker
from kvsidecar.peer.messages import CompatInfo, PeerEngine, PeerWorker
from kvsidecar.wire.types import Medium


class IncompatiblePeer(Exception):
    """Two engines cannot exchange blocks; the message names the mismatch."""


def compat_hash(info: CompatInfo) -> str:
    """Stable short hash of the compatibility fields (msgpack of the struct, sha256)."""
    return hashlib.sha256(msgspec.msgpack.encode(info)).hexdigest()[:16]


def _first_worker(engine: Engine) -> Worker:
    return min(engine.workers.values(), key=lambda w: (w.ref.pp_rank, w.ref.tp_rank))


def compat_of(engine: Engine) -> CompatInfo:
    """Return the compatibility fields of a registered engine (from its first worker's layers).

    The total KV head count is ``heads per rank * tp_size``; with more ranks than heads (heads
    replicated) that overcounts, which only makes two such engines look different, never alike.
    """
    first = _first_worker(engine)
    desc = next(iter(first.device.layers.values())).descriptor
    layers = {name for w in engine.workers.values() for name in w.device.layers}
    return CompatInfo(
        model_hash=engine.model_hash,
        cache_dtype=desc.dtype,
        head_size=desc.head_size,
        # MLA's latent is replicated on every rank: one "head" whatever the TP size.
        total_kv_heads=1 if desc.arrangement == "mla" else desc.num_heads * engine.tp_size,
        num_layers=len(layers),
        is_mla=desc.arrangement == "mla",
    )


def describe_engine(
    engine: Engine,
    layer_addr: Callable[[Worker, str], int] | None = None,
    *,
    medium: Medium = "device",
) -> PeerEngine:
    """Describe a registered engine for the handshake (or for planning a pull into it).

    ``layer_addr`` gives a layer's base address in the NIXL agent (None: the ZMQ plane only);
    ``medium`` picks the workers' registered layers or their host mirrors.
    PP layer ranges are numbered in the order of the PP ranks' layer lists.
    """
    compat = compat_of(engine)
    ordered = sorted(engine.workers.values(), key=lambda w: (w.ref.pp_rank, w.ref.tp_rank))
    starts: dict[int, int] = {}
    start = 0
    for w in ordered:
        if w.ref.pp_rank not in starts:
            starts[w.ref.pp_rank] = start
            start += len(w.device.layers)
    workers = []
    for w in ordered:
        buffers = w.buffer_set(medium)
        names = list(buffers.layers)
        descs = [buffers.layers[n].descriptor for n in names]
        first = descs[0]
        transfer = EngineTransferInfo(
            remote_tp_size=engine.tp_size,
            remote_block_len=layout.block_len(first),
            remote_block_size=first.block_size,
            remote_physical_blocks_per_logical=1,
            remote_pp_rank=w.ref.pp_rank,
            start_layer=starts[w.ref.pp_rank],
            end_layer=starts[w.ref.pp_rank] + len(names),
            remote_dcp_size=engine.dcp_size,
        )
        addrs = [layer_addr(w, n) for n in names] if layer_addr is not None else []
        workers.append(
            PeerWorker(
                tp_rank=w.ref.tp_rank,
                pp_rank=w.ref.pp_rank,
                dcp_rank=w.ref.dcp_rank,
                layers=names,
                descriptors=descs,
                transfer=transfer,
                layer_addrs=addrs,
            )
        )
    first_desc = workers[0].descriptors[0]
    return PeerEngine(
        engine_id=engine.engine_id,
        compat=compat,
        compat_hash=compat_hash(compat),
        tp_size=engine.tp_size,
        pp_size=engine.pp_size,
        dcp_size=engine.dcp_size,
        arrangement=first_desc.arrangement,
        memory_order=first_desc.memory_order,
        block_size=first_desc.block_size,
        workers=workers,
    )


def check_compatible(local: PeerEngine, remote: PeerEngine) -> None:
    """Raise `IncompatiblePeer` naming each compatibility field that differs (hash first)."""
    if local.compat_hash == remote.compat_hash and local.compat == remote.compat:
        pass
    else:
        diffs = [
            f"{field} {getattr(local.compat, field)!r} here vs {getattr(remote.compat, field)!r}"
            for field in local.compat.__struct_fields__
            if getattr(local.compat, field) != getattr(remote.compat, field)
        ]
        raise IncompatiblePeer(
            f"engine {local.engine_id!r} and remote engine {remote.engine_id!r} are not "
            f"compatible (hash {local.compat_hash} vs {remote.compat_hash}): " + "; ".join(diffs)
        )
    regions = {
        "kv_first": 2,
        "blocks_first": 2,
        "split": 1,
        "mla": 1,
        "vllm_cpu": 1,  # K and V interleave head by head: one region per block
        "vllm_cpu_amx": 1,
        "kv_cells": 1,  # K then V in each (token, head) cell
    }
    if regions[local.arrangement] != regions[remote.arrangement]:
        raise IncompatiblePeer(
            f"arrangement {local.arrangement!r} here vs {remote.arrangement!r} remote: K and V "
            "are split differently"
        )
    packed = {local.arrangement, remote.arrangement} & set(CPU_PACKED)
    if packed and local.arrangement != remote.arrangement:
        # Both one region per block, but packed inside it differently (vLLM's vec and amx
        # kernels): the bytes of one are not blocks of the other.
        raise IncompatiblePeer(
            f"arrangement {local.arrangement!r} here vs {remote.arrangement!r} remote: vLLM's CPU "
            "kernels pack a block differently"
        )
    if "kv_cells" in (local.arrangement, remote.arrangement) and (
        local.arrangement != remote.arrangement
    ):
        raise IncompatiblePeer(
            f"arrangement {local.arrangement!r} here vs {remote.arrangement!r} remote: one "
            "holds K and V in each cell of a block, the other does not"
        )
    if (
        local.tp_size != remote.tp_size
        and local.compat.cache_dtype == "uint8"
        and not local.compat.is_mla
    ):
        # vLLM's packed caches (NVFP4 keeps K's heads and V's heads as two groups of the head
        # axis): index h of that axis is not KV head h, so a rank's heads cannot be cut out.
        raise IncompatiblePeer(
            f"TP {local.tp_size} here vs {remote.tp_size} remote with a packed (uint8) KV "
            "cache: its heads cannot be sliced between ranks"
        )
    if local.block_size % remote.block_size:
        raise IncompatiblePeer(
            f"local block size {local.block_size} is not a multiple of the remote block size "
            f"{remote.block_size}"
        )
