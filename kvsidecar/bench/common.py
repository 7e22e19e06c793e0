"""What every benchmark kind shares: options, timing, figures, tables, JSON, machine facts.

A *figure* is one measured quantity next to the baseline it is judged against, both timed in the
same run (methods take turns, so they share the background load of a busy machine). Its JSON form
is exactly ``{"name", "value", "unit", "baseline", "baseline_value", "ratio",
"higher_is_better"}``, with ``value`` and ``baseline_value`` the medians and ``ratio =
value / baseline_value``. The samples stay in memory for the table's min-max and the charts.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

RESULT_KEYS = (
    "name",
    "value",
    "unit",
    "baseline",
    "baseline_value",
    "ratio",
    "higher_is_better",
)
"""The keys of one JSON result entry, in order (other tools check the ratios by them)."""


class BenchUnavailable(RuntimeError):
    """A benchmark cannot run here (no CUDA, a missing optional package): say why and stop."""


@dataclasses.dataclass(frozen=True)
class Options:
    """The workload every kind shares, built once from the command line.

    ``layers`` K-or-V tensors of ``(num_blocks, *block_shape)`` of ``dtype``; ``blocks`` ids moved
    per layer; ``repeat`` timed rounds (``rounds`` x ``batch`` round trips for latency).
    ``processes``: ``aggregator`` also measures across worker processes (`aggregator_procs`).
    ``pin``: ``latency`` pins every server (the daemon and the echoes) to one CPU and itself, the
    client, to another (`kvsidecar.bench.latency`). ``dir``: where ``disk`` measures (its file
    system); ``rebuild``: blocks of its index-rebuild figure (0: none).
    """

    layers: int = 32
    blocks: int = 512
    num_blocks: int = 4096
    block_shape: tuple[int, ...] = (16, 8, 128)
    dtype: str = "float16"
    repeat: int = 7
    rounds: int = 20
    batch: int = 100
    run_lengths: tuple[int, ...] = (4, 16, 64)
    seed: int = 0
    quick: bool = False
    peer_data_plane: str = "auto"
    progress: bool = True
    processes: bool = False
    pin: bool = False
    dir: str = ""
    rebuild: int = 0

    def __post_init__(self) -> None:
        if min(self.layers, self.blocks, self.num_blocks, self.repeat, self.rounds) < 1:
            raise ValueError("layers, blocks, num-blocks, repeat and rounds must be >= 1")
        if self.blocks > self.num_blocks:
            raise ValueError(f"--blocks {self.blocks} > --num-blocks {self.num_blocks}")
        if not self.block_shape or min(self.block_shape) < 1:
            raise ValueError(f"bad --block-shape {self.block_shape}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer."""
        return math.prod(self.block_shape) * dtype_size(self.dtype)

    @property
    def moved_bytes(self) -> int:
        """Bytes one move of ``blocks`` ids over all ``layers`` carries."""
        return self.layers * self.blocks * self.block_bytes


QUICK = {"layers": 8, "blocks": 128, "num_blocks": 1024, "repeat": 3, "rounds": 3, "batch": 50}
"""Defaults of ``--quick``: every kind in well under a minute on a 2-core machine."""


def dtype_size(name: str) -> int:
    """Bytes per element of a torch dtype given by name (``float16``, ``bfloat16``, ...)."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return torch.empty((), dtype=dtype).element_size()


def torch_dtype(name: str) -> Any:
    """Return the torch dtype named ``name`` (so that options stay plain data)."""
    import torch

    return getattr(torch, name)


@dataclasses.dataclass
class Figure:
    """One measurement and its baseline, with their samples (medians go to the JSON).

    ``chart``/``series``/``x`` place it on a chart panel (`kvsidecar.bench.charts`); ``group``
    heads its block of table rows.
    """

    name: str
    unit: str
    samples: list[float]
    baseline: str
    baseline_samples: list[float]
    higher_is_better: bool = True
    group: str = ""
    chart: str = ""
    series: str = ""
    x: float = 0.0

    @property
    def value(self) -> float:
        """Median of the samples."""
        return statistics.median(self.samples)

    @property
    def baseline_value(self) -> float:
        """Median of the baseline's samples."""
        return statistics.median(self.baseline_samples)

    @property
    def ratio(self) -> float:
        """``value / baseline_value`` (read with ``higher_is_better``)."""
        base = self.baseline_value
        return self.value / base if base else math.nan

    def to_json(self) -> dict[str, Any]:
        """Return the JSON entry: exactly `RESULT_KEYS`."""
        return {
            "name": self.name,
            "value": self.value,
            "unit": self.unit,
            "baseline": self.baseline,
            "baseline_value": self.baseline_value,
            "ratio": self.ratio,
            "higher_is_better": self.higher_is_better,
        }


def percentile(values: Sequence[float], q: float) -> float:
    """Return the ``q``-th percentile (0-100), interpolated linearly as numpy does."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def round_robin(
    methods: Sequence[tuple[str, Callable[[], object]]],
    repeat: int,
    nbytes: int,
    progress: Progress | None = None,
) -> dict[str, list[float]]:
    """GB/s (1e9 bytes/s) of each method, one call each per round, so all see the same load."""
    rates: dict[str, list[float]] = {name: [] for name, _ in methods}
    for _ in range(repeat):
        for name, fn in methods:
            start = time.perf_counter()
            fn()
            rates[name].append(nbytes / (time.perf_counter() - start) / 1e9)
        if progress is not None:
            progress.step()
    return rates


def table(figures: Iterable[Figure]) -> list[str]:
    """Markdown rows: median, min-max, baseline median, ratio and its direction."""
    lines = [
        "| figure | median | min-max | unit | baseline | baseline median | ratio |",
        "| --- | ---: | ---: | --- | --- | ---: | ---: |",
    ]
    for f in figures:
        better = "" if f.higher_is_better else " (lower is better)"
        lines.append(
            f"| {f.name} | {_num(f.value)} | {_num(min(f.samples))}-{_num(max(f.samples))} | "
            f"{f.unit} | {f.baseline} | {_num(f.baseline_value)} | {f.ratio:.2f}{better} |"
        )
    return lines


def _num(x: float) -> str:
    if math.isnan(x):
        return "nan"
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.2f}"


def machine_info(**extra: Any) -> dict[str, Any]:
    """Facts to record next to the figures: versions, CPUs, load average (the machine is shared)."""
    import numpy as np
    import torch
    import zmq

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "numpy": np.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "loadavg": list(os.getloadavg()),
        "cpu_idle": cpu_idle(),
    }
    info.update(extra)
    return info


def cpu_idle(sysfs: Path = Path("/sys")) -> dict[str, Any]:
    """How this machine's idle CPUs wait for work: the cpuidle driver, governor and states.

    On a VM it sets what waking a thread on an idle CPU costs, which is most of a round trip
    between processes: with the guest's halt polling off (``guest_halt_poll_ns`` 0) every wait
    halts the vCPU, and a blocking pyzmq echo takes about twice as long as with it on
    (docs/benchmarks.md, "guest halt polling off and on"). Latency figures from two machines
    compare only with this beside them. Missing entries are None (no cpuidle, or not Linux).
    """
    base = sysfs / "devices/system/cpu"
    states = sorted((base / "cpu0/cpuidle").glob("state*"), key=lambda p: int(p.name[5:]))
    poll = _read(sysfs / "module/haltpoll/parameters/guest_halt_poll_ns")
    return {
        "driver": _read(base / "cpuidle/current_driver"),
        "governor": _read(base / "cpuidle/current_governor_ro")
        or _read(base / "cpuidle/current_governor"),
        "states": [name for s in states if (name := _read(s / "name")) is not None],
        "guest_halt_poll_ns": None if poll is None else int(poll),
    }


def describe_cpu_idle(idle: dict[str, Any]) -> str:
    """One line for a run's header: the cpuidle driver, and guest halt polling when it exists."""
    if idle.get("driver") is None:
        return "cpu idle: no cpuidle driver"
    line = f"cpu idle: driver {idle['driver']}, governor {idle['governor']}"
    poll = idle.get("guest_halt_poll_ns")
    if poll is not None:
        line += f", guest halt polling {'off' if poll == 0 else f'up to {poll} ns'}"
    return line


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def write_json(path: str | Path, machine: dict[str, Any], figures: Iterable[Figure]) -> None:
    """Write ``{"machine": ..., "results": [...]}``, one entry per figure."""
    doc = {"machine": machine, "results": [f.to_json() for f in figures]}
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(doc, indent=2) + "\n")


class Progress:
    """A one-line progress bar on stderr, drawn only on a terminal (logs and tests stay clean)."""

    def __init__(self, total: int, label: str, *, enabled: bool = True, out: TextIO | None = None):
        self.total = max(total, 1)
        self.done = 0
        self.label = label
        self.out = out or sys.stderr
        self.enabled = enabled and self.out.isatty()
        self._draw()

    def step(self, n: int = 1, label: str | None = None) -> None:
        """Advance by ``n`` steps (and rename the current stage)."""
        self.done = min(self.done + n, self.total)
        if label is not None:
            self.label = label
        self._draw()

    def close(self) -> None:
        """Erase the bar."""
        if self.enabled:
            self.out.write("\r\033[K")
            self.out.flush()

    def _draw(self) -> None:
        if not self.enabled:
            return
        width = 30
        filled = width * self.done // self.total
        self.out.write(
            f"\r\033[K[{'#' * filled}{' ' * (width - filled)}] {self.done}/{self.total} "
            f"{self.label}"
        )
        self.out.flush()


def note(message: str) -> None:
    """Print a status line on stdout, flushed (a long run should show that it lives)."""
    print(message, flush=True)
