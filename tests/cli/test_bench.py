"""``kvsidecar bench``: a real tiny run, the JSON schema, the chart (or its clear absence), help.

The runs are real (a daemon process, an echo process) with tiny shapes so each takes seconds;
every child runs under a bounded timeout, and the daemons it starts die with it (PDEATHSIG).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvsidecar.bench import charts, procs
from kvsidecar.bench.common import (
    RESULT_KEYS,
    BenchUnavailable,
    Figure,
    Options,
    cpu_idle,
    describe_cpu_idle,
    percentile,
    table,
)
from kvsidecar.bench.workload import id_sets

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--quick",
    "--layers", "2",
    "--blocks", "16",
    "--num-blocks", "64",
    "--block-shape", "4,2,16",
    "--repeat", "2",
    "--run-lengths", "4",
    "--no-progress",
]  # fmt: skip


def bench(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSIDECAR_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("UCX_NET_DEVICES", "lo")
    return subprocess.run(
        [sys.executable, "-m", "kvsidecar.cli", "bench", *args],
        env=env,
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def check_results(path: Path) -> list[dict[str, object]]:
    doc = json.loads(path.read_text())
    assert set(doc) == {"machine", "results"}
    assert doc["machine"]["cpus"] >= 1 and len(doc["machine"]["loadavg"]) == 3
    assert doc["machine"]["cpu_idle"] == cpu_idle()  # this machine's, as sysfs has it now
    assert doc["results"]
    for entry in doc["results"]:
        assert tuple(entry) == RESULT_KEYS
        assert isinstance(entry["name"], str) and isinstance(entry["baseline"], str)
        assert isinstance(entry["higher_is_better"], bool)
        assert entry["value"] > 0 and entry["baseline_value"] > 0
        assert math.isclose(entry["ratio"], entry["value"] / entry["baseline_value"], rel_tol=1e-9)
    return list(doc["results"])


def test_help_lists_kinds_and_options() -> None:
    out = bench("--help", timeout=60)
    assert out.returncode == 0, out.stderr
    for word in ("local", "peer", "latency", "aggregator", "scaling", "gpu", "all"):
        assert word in out.stdout
    for flag in ("--layers", "--blocks", "--block-shape", "--dtype", "--repeat", "--quick"):
        assert flag in out.stdout
    assert "--json" in out.stdout and "--chart" in out.stdout


def test_bad_shape_is_a_usage_error() -> None:
    out = bench("local", "--block-shape", "16,x", timeout=60)
    assert out.returncode == 2
    assert "16,8,128" in out.stderr


def test_local_tiny_run_writes_the_schema(tmp_path: Path) -> None:
    out = bench("local", *TINY, "--json", str(tmp_path / "local.json"))
    assert out.returncode == 0, out.stdout + out.stderr
    results = check_results(tmp_path / "local.json")
    names = {(r["name"], r["baseline"]) for r in results}
    # Every figure side by side with its baselines, for random ids and runs of 4.
    for ids in ("random", "runs4"):
        assert (f"local/{ids}/daemon w2w", "in-process run copy") in names
        assert (f"local/{ids}/in-process run copy", "numpy memcpy") in names
        assert any(n == f"local/{ids}/daemon w2w" and b.startswith("naive") for n, b in names)
    assert "| figure | median | min-max |" in out.stdout


def test_latency_tiny_run(tmp_path: Path) -> None:
    out = bench(
        "latency", *TINY, "--rounds", "2", "--batch", "5", "--json", str(tmp_path / "l.json")
    )
    assert out.returncode == 0, out.stdout + out.stderr
    results = check_results(tmp_path / "l.json")
    assert all(r["higher_is_better"] is False and r["unit"] == "µs" for r in results)
    assert any(r["name"] == "latency/1-block move, 1 layer p50" for r in results)
    assert describe_cpu_idle(cpu_idle()) in out.stdout


def test_cpu_idle_reads_driver_states_and_guest_halt_polling(tmp_path: Path) -> None:
    """The facts come from sysfs as it is laid out (a tree written here stands in for /sys)."""

    def put(path: str, text: str) -> None:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text + "\n")

    assert cpu_idle(tmp_path) == {
        "driver": None,
        "governor": None,
        "states": [],
        "guest_halt_poll_ns": None,
    }
    assert describe_cpu_idle(cpu_idle(tmp_path)) == "cpu idle: no cpuidle driver"
    put("devices/system/cpu/cpuidle/current_driver", "haltpoll")
    put("devices/system/cpu/cpuidle/current_governor", "haltpoll")
    for n, name in ((0, "POLL"), (1, "C1"), (2, "C2"), (10, "C10")):  # in number order
        put(f"devices/system/cpu/cpu0/cpuidle/state{n}/name", name)
    put("module/haltpoll/parameters/guest_halt_poll_ns", "0")
    idle = cpu_idle(tmp_path)
    assert idle == {
        "driver": "haltpoll",
        "governor": "haltpoll",
        "states": ["POLL", "C1", "C2", "C10"],
        "guest_halt_poll_ns": 0,
    }
    assert describe_cpu_idle(idle) == (
        "cpu idle: driver haltpoll, governor haltpoll, guest halt polling off"
    )
    put("module/haltpoll/parameters/guest_halt_poll_ns", "200000")
    put("devices/system/cpu/cpuidle/current_governor_ro", "menu")  # preferred where it exists
    assert describe_cpu_idle(cpu_idle(tmp_path)) == (
        "cpu idle: driver haltpoll, governor menu, guest halt polling up to 200000 ns"
    )


def test_latency_pinned_tiny_run(tmp_path: Path) -> None:
    """``--pin``: the servers on one CPU, the client on another, or a note why not."""
    out = bench(
        "latency",
        *TINY,
        "--pin",
        "--rounds",
        "2",
        "--batch",
        "5",
        "--json",
        str(tmp_path / "l.json"),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        assert f"servers pinned to CPU {cpus[0]}, the client to CPU {cpus[1]}" in out.stdout
    else:
        assert "--pin needs two CPUs; not pinned" in out.stdout
    assert check_results(tmp_path / "l.json")


def test_pin_restricts_every_thread_of_a_process() -> None:
    """`procs.pin` sets each thread's CPUs (a pid's affinity alone is its main thread's)."""
    code = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); "
    code += "print('ready', flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        cpu = min(os.sched_getaffinity(0))
        procs.pin(child.pid, {cpu})
        tasks = os.listdir(f"/proc/{child.pid}/task")
        assert len(tasks) == 2
        for task in tasks:
            assert os.sched_getaffinity(int(task)) == {cpu}
    finally:
        child.kill()
        child.wait(10)


def test_disk_tiny_run_beside_fio(tmp_path: Path) -> None:
    """The disk tier against fio in a directory of the caller's: O_DIRECT and page cache apart,
    every block read back checked (the bench fails on a bad one), nothing left in the directory."""
    out = bench(
        "disk",
        "--quick",
        "--repeat",
        "1",
        "--layers",
        "2",
        "--dir",
        str(tmp_path),
        "--json",
        str(tmp_path / "d.json"),
        "--no-progress",
        timeout=150,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    results = check_results(tmp_path / "d.json")
    names = {r["name"] for r in results}
    for mode in ("O_DIRECT", "page cache"):
        for run in ("1 MiB", "16 MiB"):
            assert f"{mode}: tier write, {run} run" in names, names
    assert {r["baseline"] for r in results} >= {"fio write (direct=1)", "fio read (direct=1)"}
    assert [p.name for p in tmp_path.iterdir()] == ["d.json"]


def test_peer_tiny_run(tmp_path: Path) -> None:
    # Both planes pull published requests between two real daemons; the bench checks the
    # consumer's bytes against the producer's before it times anything.
    out = bench("peer", *TINY, "--json", str(tmp_path / "p.json"), timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr
    results = check_results(tmp_path / "p.json")
    planes = {r["name"].rsplit("/", 1)[-1] for r in results}
    assert {"zmq plane pull", "zmq plane pull, random ids"} <= planes
    try:
        import nixl  # noqa: F401
    except ImportError:
        return
    assert "nixl plane pull" in planes


def _figures() -> list[Figure]:
    return [
        Figure("a", "GB/s", [1.0, 2.0, 3.0], "base", [1.0], chart="run_length", series="a", x=1),
        Figure("a", "GB/s", [4.0], "base", [2.0], chart="run_length", series="a", x=16),
        Figure("p", "µs", [5.0], "echo p50", [2.0], False, chart="latency", series="p", x=50),
    ]


def test_chart_or_clear_message(tmp_path: Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(BenchUnavailable, match="pip install"):
            charts.draw(_figures(), tmp_path / "c.png")
        return
    assert charts.draw(_figures(), tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not charts.draw([Figure("x", "s", [1.0], "y", [1.0])], tmp_path / "none.png")


def test_missing_matplotlib_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    with pytest.raises(BenchUnavailable, match=r"kvsidecar\[bench\]"):
        charts.require_matplotlib()


def test_figure_ratio_table_and_percentile() -> None:
    f = Figure("m", "µs", [3.0, 1.0, 2.0], "echo", [4.0, 4.0], higher_is_better=False)
    assert f.value == 2.0 and f.baseline_value == 4.0 and f.ratio == 0.5
    assert tuple(f.to_json()) == RESULT_KEYS
    line = table([f])[-1]
    assert line == "| m | 2.00 | 1.00-3.00 | µs | echo | 4.00 | 0.50 (lower is better) |"
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([7.0], 99) == 7.0


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="blocks"):
        Options(blocks=10, num_blocks=5)
    assert Options(block_shape=(4, 2, 16), dtype="float32").block_bytes == 4 * 2 * 16 * 4


def test_id_sets_have_the_run_lengths() -> None:
    sets = id_sets(32, 256, (4, 16, 64), seed=1)
    assert list(sets) == ["random", "runs4", "runs16"]  # 64 > 32 blocks: left out
    src, _ = sets["runs4"]
    assert len(set(src)) == 32
    assert all(list(src[k : k + 4]) == [src[k] + j for j in range(4)] for k in range(0, 32, 4))


def test_gpu_fails_fast_without_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    out = bench("gpu", "--no-progress", timeout=60)
    assert out.returncode == 1
    assert "needs a CUDA device" in out.stderr
