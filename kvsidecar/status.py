"""``kvsidecar status``: a running daemon's state as readable tables."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO

from kvsidecar.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE
from kvsidecar.wire.cache import CacheTierInfo
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.protocol import StatusReply


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``: binary units, one decimal."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned text table with a rule under the header."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def format_status(st: StatusReply) -> str:
    """Render the whole status reply as text: a summary, engines and workers, the prefix cache."""
    pool_pct = 100.0 * st.host_pool_used_bytes / st.host_pool_bytes if st.host_pool_bytes else 0.0
    out = [
        f"kvsidecar {st.daemon_version} (protocol {st.protocol_version}) on {st.endpoint}"
        + ("  [draining]" if st.draining else ""),
        f"uptime {st.uptime_s:.0f} s; host pool {human_bytes(st.host_pool_used_bytes)} of "
        f"{human_bytes(st.host_pool_bytes)} used ({pool_pct:.1f}%); "
        f"{st.in_flight_moves} moves in flight",
        f"totals: {st.moves_total} moves, {human_bytes(st.bytes_moved_total)} moved, "
        f"{st.moves_failed_total} failed moves, {st.errors_total} error replies",
        f"pulls: {st.pulls_total} ({st.pulls_failed_total} with failed requests), "
        f"{human_bytes(st.bytes_pulled_total)} pulled; {st.published_requests} requests "
        "published and waiting for their consumer",
        "",
    ]
    if st.engines:
        out.extend((_engines(st), ""))
    else:
        out.extend(("no engines registered", ""))
    out.append(_cache(st) if st.cache_namespaces else "prefix cache: no namespaces")
    out.extend(_tier(tier) for tier in st.cache_tiers)
    return "\n".join(out)


def _tier(tier: CacheTierInfo) -> str:
    """Render a tier below the host pool (the disk tier) in one line."""
    name = "disk tier" if tier.medium == "STORAGE" else f"{tier.medium} tier"
    if not tier.up:
        return f"{name} {tier.path}: off ({tier.reason}); the prefix cache serves from memory"
    free = (
        f", {human_bytes(tier.free_bytes)} free on its file system" if tier.free_bytes >= 0 else ""
    )
    return (
        f"{name} {tier.path}: {tier.blocks} blocks ({human_bytes(tier.used_bytes)}) in "
        f"{tier.spaces} namespaces, {human_bytes(tier.capacity_bytes)} allocated{free}"
    )


def _cache(st: StatusReply) -> str:
    """Render the prefix cache's namespaces: what each holds and how much it served."""
    spaces = st.cache_namespaces
    ready = sum(ns.ready_blocks * ns.block_bytes for ns in spaces)
    head = (
        f"prefix cache: {len(spaces)} namespaces, {sum(ns.ready_blocks for ns in spaces)} "
        f"blocks ({human_bytes(ready)}); since started: {sum(ns.hit_blocks for ns in spaces)} "
        f"blocks hit by lookups, {sum(ns.loaded_blocks for ns in spaces)} loaded, "
        f"{sum(ns.stored_blocks for ns in spaces)} stored"
    )
    rows: list[tuple[object, ...]] = [
        (
            ns.owner,
            ns.fingerprint if len(ns.fingerprint) <= 40 else ns.fingerprint[:39] + "…",
            ns.tp_rank,
            f"{ns.ready_blocks}/{ns.capacity_blocks}",
            human_bytes(ns.capacity_blocks * ns.block_bytes),
            ns.pinned_blocks,
            ns.hit_blocks,
            ns.loaded_blocks,
            ns.stored_blocks,
            ns.workers,
        )
        for ns in spaces
    ]
    headers = ("owner", "namespace", "rank", "blocks", "size", "pinned", "hits", "loaded")
    if st.cache_tiers:  # and each namespace's blocks on disk
        disk = [f"{ns.disk_blocks}/{ns.disk_capacity_blocks}" for ns in spaces]
        rows = [(*row, d) for row, d in zip(rows, disk, strict=True)]
        return head + "\n" + table((*headers, "stored", "workers", "on disk"), rows)
    return head + "\n" + table((*headers, "stored", "workers"), rows)


def _engines(st: StatusReply) -> str:
    """Render the registered engines, then their workers."""
    out = []
    out.append(
        table(
            ("engine", "workers", "registered", "host blocks used", "model hash"),
            [
                (
                    e.engine_id,
                    len(e.workers),
                    human_bytes(sum(w.nbytes for w in e.workers)),
                    f"{e.host_blocks_used}/{e.host_blocks}",
                    e.model_hash or "-",
                )
                for e in st.engines
            ],
        )
    )
    out.append("")
    out.append(
        table(
            ("worker", "tp", "layers", "registered", "host mirror", "lease left", "in flight"),
            [
                (
                    w.worker.label(),
                    f"{w.worker.tp_rank}/{w.tp_size}",
                    len(w.layers),
                    human_bytes(w.nbytes),
                    human_bytes(w.host_mirror_bytes),
                    f"{w.lease_left_s:.1f} s",
                    w.in_flight,
                )
                for e in st.engines
                for w in e.workers
            ],
        )
    )
    return "\n".join(out)


def print_status(endpoint: str | None, *, timeout: float, out: TextIO = sys.stdout) -> int:
    """Query the daemon at ``endpoint`` and print its state; returns the CLI exit code."""
    from kvsidecar.client import SidecarClient

    try:
        with SidecarClient(endpoint, timeout_s=timeout, name="kvsidecar-status") as client:
            reply = client.status()
    except SidecarError as exc:
        where = endpoint or "the default endpoint"
        print(f"kvsidecar: no answer from {where}: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE if exc.code == "timeout" else EXIT_FAILED
    print(format_status(reply), file=out)
    return EXIT_OK
