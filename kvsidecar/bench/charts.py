"""PNG charts of a run's figures (optional: needs matplotlib, the ``bench`` extra).

Panels, each drawn when the run has figures for it: throughput by block-run length (``local``),
throughput by transfer size (``scaling`` blocks per move, ``peer``), latency percentiles
(``latency``), and the scaling curves (workers, layers, registered workers).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvsidecar.bench.common import BenchUnavailable, Figure

PANELS: dict[str, tuple[str, str, bool]] = {
    # chart tag: (title, x label, log x)
    "run_length": (
        "Throughput by block-run length",
        "consecutive blocks per run (1 = random)",
        True,
    ),
    "size": ("Throughput by transfer size", "MiB per move", True),
    "latency": ("Round-trip latency percentiles", "percentile", False),
    "workers": ("Throughput as workers grow", "concurrent workers", True),
    "layers": ("Throughput as layers grow", "layers per move", True),
    "registry": ("1-block move p50 as registrations grow", "registered workers", True),
}

_MISSING = (
    "charts need matplotlib, which is not installed: pip install 'kvsidecar[bench]' "
    "(or pip install matplotlib)"
)


def require_matplotlib() -> Any:
    """Import matplotlib with a headless backend, or raise `BenchUnavailable` saying what to do."""
    try:
        import matplotlib
    except ImportError:
        raise BenchUnavailable(_MISSING) from None
    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    return plt


def _series_name(name: str) -> str:
    # Baselines carry run-specific detail in brackets ("(faster of 2t/1t: 1t)"); one line each.
    return name.split(" (", maxsplit=1)[0]


def draw(figures: Sequence[Figure], path: Path, title: str = "kvsidecar bench") -> bool:
    """Draw one panel per chart tag present; returns False when no figure has a chart."""
    panels = [tag for tag in PANELS if any(f.chart == tag for f in figures)]
    if not panels:
        return False
    plt = require_matplotlib()
    cols = min(len(panels), 2)
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.8 * rows), squeeze=False)
    for ax, tag in zip(axes.flat, panels, strict=False):
        _panel(ax, tag, [f for f in figures if f.chart == tag])
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    _shrink(path)
    return True


def _shrink(path: Path) -> None:
    """Re-save with a 64-colour palette: a third of the bytes, for charts kept in git."""
    try:
        from PIL import Image  # matplotlib's own dependency
    except ImportError:  # pragma: no cover - matplotlib requires Pillow
        return
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=64)
    small.save(path, optimize=True)


def _panel(ax: Any, tag: str, figures: list[Figure]) -> None:
    heading, xlabel, logx = PANELS[tag]
    # (series -> x -> median); a baseline shared by several figures is drawn once.
    lines: dict[str, dict[float, float]] = {}
    for f in figures:
        lines.setdefault(f.series, {})[f.x] = f.value
        lines.setdefault(_series_name(f.baseline), {}).setdefault(f.x, f.baseline_value)
    unit = figures[0].unit
    if tag == "latency":
        _bars(ax, lines)
    else:
        for name, points in lines.items():
            xs = sorted(points)
            ax.plot(xs, [points[x] for x in xs], marker="o", label=name)
        if logx:
            ax.set_xscale("log", base=2)
    ax.set_title(heading, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(unit)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _bars(ax: Any, lines: dict[str, dict[float, float]]) -> None:
    # Percentile groups side by side; the echo baselines of every method collapse into one series.
    merged: dict[str, dict[float, float]] = {}
    for name, points in lines.items():
        key = name.rsplit(" p", 1)[0]
        merged.setdefault(key, {}).update(points)
    qs = sorted({q for points in merged.values() for q in points})
    width = 0.8 / max(len(merged), 1)
    for i, (name, points) in enumerate(merged.items()):
        ax.bar(
            [j + i * width for j in range(len(qs))],
            [points.get(q, 0.0) for q in qs],
            width,
            label=name,
        )
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(qs))], [f"p{q:g}" for q in qs])
    ax.set_yscale("log")
