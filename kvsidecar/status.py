"""``kvsidecar status``: a running daemon's state as readable tables."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO

from kvsidecar.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE
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
    """Render the whole status reply as text: a summary, then engines and workers."""
    pool_pct = 100.0 * st.host_pool_used_bytes / st.host_pool_bytes if st.host_pool_bytes else 0.0
    out = [
        f"kvsidecar {st.daemon_version} (protocol {st.protocol_version}) on {st.endpoint}"
        + ("  [draining]" if st.draining else ""),
        f"uptime {st.uptime_s:.0f} s; host pool {human_bytes(st.host_pool_used_bytes)} of "
        f"{human_bytes(st.host_pool_bytes)} used ({pool_pct:.1f}%); "
        f"{st.in_flight_moves} moves in flight",
        f"totals: {st.moves_total} moves, {human_bytes(st.bytes_moved_total)} moved, "
        f"{st.moves_failed_total} failed moves, {st.errors_total} error replies",
        "",
    ]
    if not st.engines:
        out.append("no engines registered")
        return "\n".join(out)
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
