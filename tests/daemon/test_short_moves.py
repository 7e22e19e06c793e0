"""Short plain moves, copied without a job (`kvsidecar.daemon.moves`), answer as every move.

Two daemons in this event loop, one with the fast path and one without
(``short_move_fast_path``), get the same engines (real shared memory, the same bytes) and the
same requests. The sequence mixes moves the fast path serves with moves it must hand to the
general path: out-of-range, repeated and overlapping ids, length mismatches, an unknown layer, a
stale epoch, a forbidden engine, negative ids, more ids than a short move, a first move of a new
layer list (no cached plan yet), and host-pool moves. Every reply, every byte of every cache, the
daemon's totals, its move and command metrics and the engines' completions must agree. (A short
move on blocks of a job in flight waits for it: tests/daemon/test_e2e.py,
`test_short_move_on_blocks_of_a_running_move_applies_after_it`.)
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import generate_latest

from kvsidecar.client import AsyncSidecarClient, BufferSetRef, SidecarError
from kvsidecar.daemon.server import Daemon
from tests.support.caches import random_caches
from tests.support.daemons import make_config, run_daemon

pytestmark = pytest.mark.timeout(120)

LAYERS, BLOCKS, SHAPE = 3, 40, (40, 16, 4, 32)  # split: K and V tensors, 4 KiB per block
ENGINES = ("A", "B", "C")


def _caches(seed: int) -> list[torch.Tensor]:
    return random_caches(LAYERS, SHAPE, seed)


def _requests(seed: int) -> list[tuple[str, str, Any, Any, dict[str, Any]]]:
    """(source, destination, source ids, destination ids, options) for client A to send.

    Option ``by``: another engine's client sends it instead.

    Sides: "A", "B", "C" (engines' device caches), "Ah" (A's host blocks), "stale" (A with a
    wrong epoch). Mostly valid short moves, so that plans are cached and the fast path serves
    them; between them, every kind of request it must leave to the general path.
    """
    rng = np.random.default_rng(seed)
    pairs = [("A", "B"), ("B", "A"), ("A", "A"), ("A", "Ah"), ("Ah", "B")]
    layer_lists: list[list[str] | None] = [None, ["l0"], ["l1", "l2"]]
    out: list[tuple[str, str, Any, Any, dict[str, Any]]] = []
    for i in range(90):
        src, dst = pairs[i % len(pairs)]
        layers = layer_lists[(i // len(pairs)) % len(layer_lists)]
        n = int(rng.integers(1, 5))
        picked = rng.choice(BLOCKS if dst != "Ah" and src != "Ah" else 8, 2 * n, replace=False)
        s, d = picked[:n], picked[n:]
        dtype = "<i4" if i % 2 else "<i8"
        opts: dict[str, Any] = {"layers": layers, "request_ids": [f"r{i}"]}
        out.append((src, dst, s.astype(dtype), d.astype(dtype), opts))
        bad = i % 9
        if bad == 1:
            out.append((src, dst, s, np.full(n, BLOCKS + 3), opts))  # out of range
        elif bad == 2 and n > 1:
            out.append((src, dst, s, np.full(n, d[0]), opts))  # a destination twice
        elif bad == 3:
            out.append(("A", "A", s, s[::-1], opts))  # reads what it writes
        elif bad == 4:
            out.append((src, dst, np.append(s, 0), d, opts))  # lengths disagree
        elif bad == 5:
            out.append((src, dst, s, d, {**opts, "layers": ["l9"]}))  # unknown layer
        elif bad == 6:
            out.append(("stale", dst, s, d, opts))
        elif bad == 7:
            out.append(("C", "B", s, d, opts))  # C granted A nothing
            out.append(("A", "B", s, d, {**opts, "by": "C"}))  # nor A or B anything to C
        elif bad == 8:
            out.append((src, dst, -1 - s, d, opts))  # negative ids
        elif bad == 0 and src != "Ah" and dst != "Ah":
            many = rng.choice(BLOCKS, 2 * 17, replace=False)
            out.append((src, dst, many[:17], many[17:], opts))  # more than a short move
    return out


async def _run(fast: bool, seed: int) -> dict[str, Any]:
    """Serve `_requests` on a daemon with the fast path on or off; everything it ends with."""
    caches = {e: _caches(i + 1) for i, e in enumerate(ENGINES)}
    config = make_config(lease_s=60.0, short_move_fast_path=fast)
    replies: list[tuple[Any, ...]] = []
    async with run_daemon(config) as daemon:
        clients = {e: AsyncSidecarClient(config.endpoint, heartbeat=False) for e in ENGINES}
        try:
            for e, client in clients.items():
                await client.start()
                tensors = {f"l{i}": t for i, t in enumerate(caches[e])}
                await client.register_kv_caches(
                    tensors, engine_id=e, arrangement="split", host_blocks=8
                )
            a = clients["A"]
            await clients["B"].grant("A", read=True, write=True)
            host = np.asarray(await a.host_alloc("A", 8))
            sides = {e: BufferSetRef(c.worker) for e, c in clients.items()}
            sides["Ah"] = BufferSetRef(a.worker, "host")
            sides["stale"] = BufferSetRef(a.worker, epoch=987654321)
            for src, dst, src_ids, dst_ids, options in _requests(seed):
                opts = dict(options)
                s = _on_host(host, src_ids) if src == "Ah" else src_ids
                d = _on_host(host, dst_ids) if dst == "Ah" else dst_ids
                sender = clients[opts.pop("by", "A")]
                try:
                    r = await sender.move(sides[src], sides[dst], s, d, **opts)
                    replies.append(("moved", r.blocks, r.nbytes, r.fixed, r.verified))
                except SidecarError as exc:
                    # Registration epochs differ between the two daemons; the rest must not.
                    replies.append(("error", exc.code, re.sub(r"\d{12,}", "<epoch>", exc.message)))
            status = await a.status()
        finally:
            for client in clients.values():
                await client.close()
        return {
            "replies": replies,
            "caches": {e: [t.clone() for t in caches[e]] for e in ENGINES},
            "totals": (
                status.moves_total,
                status.moves_failed_total,
                status.bytes_moved_total,
                status.errors_total,
            ),
            "metrics": _move_metrics(daemon),
            "completions": _completions(daemon),
            "short": daemon.totals.short_moves,
        }


def _on_host(host: Any, ids: Any) -> Any:
    """A's host block ids for indexes 0-7 of its allocation; other (bad) ids as they are."""
    return np.array([host[i] if 0 <= i < len(host) else i for i in ids.tolist()], ids.dtype)


def _move_metrics(daemon: Daemon) -> list[str]:
    """The exposition's move, byte and command counts (not durations, which differ)."""
    text = generate_latest(daemon.observability.registry).decode()
    keep = ("moves_total", "moved_bytes", "move_failures", "commands_total", "_count{")
    return sorted(
        line
        for line in text.splitlines()
        if not line.startswith("#") and any(k in line for k in keep)
    )


def _completions(daemon: Daemon) -> dict[str, dict[str, tuple[Any, ...]]]:
    return {
        engine: {
            label: (
                acc.finished_sending,
                acc.finished_recving,
                acc.failed_recving,
                acc.invalid_block_ids,
            )
            for label, acc in state.accrued.items()
        }
        for engine, state in daemon.completions.engines.items()
    }


async def test_short_moves_answer_exactly_as_the_general_path() -> None:
    fast = await _run(True, seed=7)
    slow = await _run(False, seed=7)
    assert slow["short"] == 0
    moved = sum(r[0] == "moved" for r in fast["replies"])
    assert {r[0] for r in fast["replies"]} == {"moved", "error"}
    # Most moves are short and plain with a cached plan: the fast path served them.
    assert fast["short"] > moved // 2, (fast["short"], moved)
    assert fast["replies"] == slow["replies"]
    for e in ENGINES:
        for layer, (x, y) in enumerate(zip(fast["caches"][e], slow["caches"][e], strict=True)):
            # Bit for bit (random bits hold NaNs, which never compare equal as floats).
            assert torch.equal(x.view(torch.int16), y.view(torch.int16)), f"{e} l{layer} differs"
    assert fast["totals"] == slow["totals"]
    assert fast["metrics"] == slow["metrics"]
    assert any("moves_total" in line for line in fast["metrics"])
    assert fast["completions"] == slow["completions"]
    assert any(acc[1] for per in fast["completions"].values() for acc in per.values())


async def test_checksummed_moves_take_the_general_path() -> None:
    """The daemon's ``checksum`` setting: every move is verified, none is a plain short one."""
    config = make_config(checksum=True)
    caches = _caches(1)
    async with run_daemon(config) as daemon, AsyncSidecarClient(config.endpoint) as c:
        await c.register_kv_caches(
            {f"l{i}": t for i, t in enumerate(caches)}, engine_id="e", arrangement="split"
        )
        me = BufferSetRef(c.worker)
        for i in range(3):
            reply = await c.move(me, me, [i], [10 + i])
            assert reply.verified
        assert daemon.totals.short_moves == 0
    for t in caches:
        assert torch.equal(t[10:13].view(torch.int16), t[0:3].view(torch.int16))


async def test_a_short_move_is_at_most_sixteen_ids_a_side_whatever_their_dtype() -> None:
    """16 ids a side (`mover.SMALL_MOVE_IDS`) are copied without a job; 17, as int32 or as
    int64 ids, become a job; all three copy right."""
    config = make_config()
    caches = _caches(3)
    l0 = caches[0].view(torch.int16)
    async with run_daemon(config) as daemon, AsyncSidecarClient(config.endpoint) as c:
        await c.register_kv_caches(
            {f"l{i}": t for i, t in enumerate(caches)}, engine_id="e", arrangement="split"
        )
        me = BufferSetRef(c.worker)
        await c.move(me, me, [0], [39], layers=["l0"])  # caches this layer list's plan
        cases = [(0, 16, "<i8", 1), (1, 17, "<i4", 0), (2, 17, "<i8", 0)]
        for first, n, dtype, short in cases:
            before = daemon.totals.short_moves
            src = np.arange(first, first + n, dtype=dtype)
            dst = np.arange(20, 20 + n, dtype=dtype)
            reply = await c.move(me, me, src, dst, layers=["l0"])
            assert reply.blocks == n
            assert daemon.totals.short_moves - before == short, (n, dtype)
            assert torch.equal(l0[20 : 20 + n], l0[first : first + n]), (n, dtype)
