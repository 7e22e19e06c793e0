"""The ``kvsidecar`` command, run as a real subprocess: help, config checks, status, demo, logs.

Every child runs with a bounded timeout and is stopped (killed if need be) by the test that
started it. The environment of each child is stripped of ``KVSIDECAR_*`` variables, so settings
from the developer's shell cannot leak into the checks.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from kvsidecar import __version__
from kvsidecar.exitcodes import EXIT_CONFIG, EXIT_OK, EXIT_UNREACHABLE
from kvsidecar.node.settings import SETTINGS
from tests.support import ROOT
from tests.support.children import LineReader, workers
from tests.support.daemons import daemon_process, make_config

_SCRIPT = Path(sys.executable).parent / "kvsidecar"
# The installed console script when there is one (what a user runs), else the module.
KVSIDECAR = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "kvsidecar.cli"]


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment without any KVSIDECAR_* setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSIDECAR_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def kvsidecar(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run the command to completion (killed after ``timeout`` s) and capture its output."""
    return subprocess.run(
        [*KVSIDECAR, *args],
        env=clean_env(env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def tmp_short() -> Iterator[Path]:
    """A short temp dir under /tmp (Unix socket paths must stay under 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="kvcli-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def small_serve(runtime_dir: Path) -> list[str]:
    """``serve`` of a small daemon in ``runtime_dir``, without a metrics endpoint."""
    return [
        "serve",
        "--runtime-dir",
        str(runtime_dir),
        "--host-pool-bytes",
        str(1 << 20),
        "--metrics-port",
        "-1",
    ]


def settings_of(stdout: str) -> dict[str, str]:
    """``check-config`` output (``name = repr``) as a dict of name -> repr."""
    pairs = (line.split(" = ", 1) for line in stdout.splitlines() if " = " in line)
    return {name: value for name, value in pairs}


# ------------------------------------------------------------------------------ version, help


@pytest.mark.timeout(60)
def test_version() -> None:
    result = kvsidecar("--version")
    assert result.returncode == EXIT_OK, result.stderr
    assert result.stdout.strip() == f"kvsidecar {__version__}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", [None, "serve", "status", "demo", "check-config"])
def test_help_exits_0(command: str | None) -> None:
    result = kvsidecar(*([command] if command else []), "--help")
    assert result.returncode == EXIT_OK, result.stderr
    assert result.stdout.startswith("usage: kvsidecar")
    if command is None:
        for sub in ("serve", "status", "demo", "check-config"):
            assert sub in result.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["serve", "check-config"])
def test_help_lists_every_setting_with_its_flag_and_env_var(command: str) -> None:
    # Wide columns, so that argparse does not break a flag or variable name across lines.
    result = kvsidecar(command, "--help", env={"COLUMNS": "400"})
    assert result.returncode == EXIT_OK, result.stderr
    missing = [
        s.name
        for s in SETTINGS
        if s.flag not in result.stdout or f"env {s.env_var}" not in result.stdout
    ]
    assert not missing, f"settings without flag or env var in --help: {missing}"
    assert "KVSIDECAR_CONFIG" in result.stdout


# ------------------------------------------------------------------------------ check-config


@pytest.mark.timeout(60)
def test_check_config_precedence_file_env_flag(tmp_short: Path) -> None:
    config = tmp_short / "kvsidecar.toml"
    config.write_text(
        '[kvsidecar]\ncopy_threads = 3\nlease_s = 5.0\ndrain_timeout_s = 4.0\nlog_level = "debug"\n'
    )
    result = kvsidecar(
        "check-config",
        "--config",
        str(config),
        "--drain-timeout-s",
        "9",
        env={"KVSIDECAR_LEASE_S": "6", "KVSIDECAR_DRAIN_TIMEOUT_S": "8"},
    )
    assert result.returncode == EXIT_OK, result.stderr
    got = settings_of(result.stdout)
    assert set(got) == {s.name for s in SETTINGS}
    assert got["copy_threads"] == "3"  # file over default
    assert got["log_level"] == "'debug'"
    assert got["lease_s"] == "6.0"  # environment over file
    assert got["drain_timeout_s"] == "9.0"  # flag over environment and file
    assert got["max_ids_per_command"] == repr(1 << 20)  # untouched: the default


@pytest.mark.timeout(60)
def test_check_config_file_from_environment(tmp_short: Path) -> None:
    config = tmp_short / "flat.toml"
    config.write_text("copy-threads = 4\n")  # flat file, dashed key
    result = kvsidecar("check-config", env={"KVSIDECAR_CONFIG": str(config)})
    assert result.returncode == EXIT_OK, result.stderr
    assert settings_of(result.stdout)["copy_threads"] == "4"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("toml", "env", "flags", "expect"),
    [
        ("", {}, ["--copy-threads", "0"], "copy_threads"),
        ("", {"KVSIDECAR_LEASE_S": "soon"}, [], "lease_s"),
        ("", {"KVSIDECAR_USE_UVLOOP": "maybe"}, [], "use_uvloop"),
        ('lease_s = "five"\n', {}, [], "lease_s"),
        ("log_level = 'loud'\n", {}, [], "log_level"),
        ("copy_thread = 2\n", {}, [], "unknown setting"),
        ("[kvsidecar]\nnot_a_setting = 1\n", {}, [], "unknown setting"),
    ],
    ids=[
        "flag-range",
        "env-float",
        "env-bool",
        "file-type",
        "file-choice",
        "file-unknown-key",
        "table-unknown-key",
    ],
)
def test_check_config_invalid_exits_3(
    tmp_short: Path, toml: str, env: dict[str, str], flags: list[str], expect: str
) -> None:
    args = ["check-config", *flags]
    if toml:
        config = tmp_short / "bad.toml"
        config.write_text(toml)
        args += ["--config", str(config)]
    result = kvsidecar(*args, env=env)
    assert result.returncode == EXIT_CONFIG, (result.stdout, result.stderr)
    assert "invalid configuration" in result.stderr
    assert expect in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["missing", "directory", "not-toml"])
def test_check_config_unreadable_file_exits_3(tmp_short: Path, what: str) -> None:
    path = tmp_short / "kvsidecar.toml"
    if what == "directory":
        path.mkdir()
    elif what == "not-toml":
        path.write_text("this is = = not toml\n")
    for command in ("check-config", "serve"):
        result = kvsidecar(command, "--config", str(path), "--metrics-port", "-1")
        assert result.returncode == EXIT_CONFIG, (command, result.stdout, result.stderr)
        assert str(path) in result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.timeout(60)
def test_bad_flag_is_a_usage_error_and_a_bad_value_a_configuration_error() -> None:
    """An unknown flag is a usage error (2); a setting's bad value is refused as it is from the
    environment or a file (3). Each in one line."""
    result = kvsidecar("check-config", "--copy-threadz", "2")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--copy-threadz" in result.stderr
    result = kvsidecar("check-config", "--copy-threads", "many")
    assert result.returncode == EXIT_CONFIG
    assert result.stderr == (
        "kvsidecar: invalid configuration: copy_threads from --copy-threads: 'many' is not an "
        "integer\n"
    )


# ------------------------------------------------------------------------------ status


@pytest.mark.timeout(180)
def test_status_shows_the_registered_engine_and_worker() -> None:
    config = make_config(host_pool_bytes=16 << 20, lease_s=30.0, metrics_port=-1)
    spec = {
        "endpoint": config.endpoint,
        "engine": "prefill-cli",
        "layers": 2,
        "blocks": 16,
        "block_size": 16,
        "heads": 2,
        "head_size": 64,
        "seed": 7,
        "tp_rank": 1,
        "tp_size": 2,
        "host_blocks": 8,
    }
    with daemon_process(config), workers([spec]):
        result = kvsidecar("status", "--endpoint", config.endpoint, "--timeout", "10")
    assert result.returncode == EXIT_OK, result.stderr
    out = result.stdout
    assert f"on {config.endpoint}" in out
    assert "engine" in out and "worker" in out  # the two tables' headers
    engine_rows = [line for line in out.splitlines() if line.startswith("prefill-cli ")]
    assert engine_rows, out
    assert "0/8" in engine_rows[0]  # host blocks used / declared
    worker_rows = [line for line in out.splitlines() if "prefill-cli/tp1.pp0.dcp0" in line]
    assert worker_rows, out
    assert "1/2" in worker_rows[0]  # tp rank / size
    # 2 layers x (2, 16, 16, 2, 64) float16 = 256 KiB registered
    assert "256.0 KiB" in worker_rows[0]


@pytest.mark.timeout(120)
def test_status_shows_the_prefix_cache_and_pulls() -> None:
    """Namespaces with their blocks, hits, loads and stores; pulls and published requests."""
    import torch

    from kvsidecar.client import SidecarClient
    from kvsidecar.memory import allocate_kv_caches

    config = make_config(host_pool_bytes=16 << 20, cache_bytes=4 << 20, peer_lease_s=30.0)
    keys = [bytes([i]) * 32 for i in range(3)]
    with daemon_process(config), SidecarClient(config.endpoint) as client:
        caches = allocate_kv_caches(2, (2, 16, 4, 2, 8), torch.bfloat16)
        client.register_kv_caches(
            {f"l{i}": t for i, t in enumerate(caches)}, engine_id="eng-status"
        )
        assert client.submit_cache_store("fp-status", keys, [1, 2, 3]).result().stored == 3
        assert client.cache_lookup("fp-status", keys[:2]).hits == 2
        assert client.submit_cache_load("fp-status", keys[:1], [9]).result().loaded == 1
        client.publish("eng-status", "held", [4])
        client.publish("eng-status", "read", [5])
        pulled = client.submit_pull(
            "eng-status", "", "eng-status", {"r": ([5], [6])}, remote_request_ids={"r": "read"}
        ).result()
        assert pulled.finished == ["r"]
        result = kvsidecar("status", "--endpoint", config.endpoint, "--timeout", "10")
    assert result.returncode == EXIT_OK, result.stderr
    out = result.stdout
    assert "prefix cache: 1 namespaces, 3 blocks" in out, out
    assert "2 blocks hit by lookups, 1 loaded, 3 stored" in out, out
    (row,) = [line for line in out.splitlines() if "fp-status" in line]
    assert row.split()[2:4] == ["0", "3/" + row.split()[3].split("/")[1]], row
    assert "pulls: 1 (0 with failed requests)" in out, out
    assert "1 requests published" in out, out


def test_status_shows_the_disk_tier(tmp_path: Path) -> None:
    """The disk tier's line (its blocks, namespaces, room), and each namespace's blocks on disk;
    a tier that could not start says why."""
    import torch

    from kvsidecar.client import SidecarClient
    from kvsidecar.memory import allocate_kv_caches

    config = make_config(
        host_pool_bytes=16 << 20,
        cache_dir=str(tmp_path / "cache"),
        cache_disk_bytes=1 << 20,
        cache_disk_admit="all",
    )
    keys = [bytes([i]) * 32 for i in range(3)]
    with daemon_process(config), SidecarClient(config.endpoint) as client:
        caches = allocate_kv_caches(2, (2, 16, 4, 2, 8), torch.bfloat16)
        client.register_kv_caches({f"l{i}": t for i, t in enumerate(caches)}, engine_id="eng")
        assert client.submit_cache_store("fp-disk", keys, [1, 2, 3]).result().stored == 3
        deadline = time.monotonic() + 20
        while client.status().cache_tiers[0].blocks < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        result = kvsidecar("status", "--endpoint", config.endpoint, "--timeout", "10")
    assert result.returncode == EXIT_OK, result.stderr
    out = result.stdout
    assert f"disk tier {tmp_path / 'cache'}: 3 blocks" in out and "in 1 namespaces" in out, out
    (row,) = [line for line in out.splitlines() if "fp-disk" in line]
    assert row.split()[-1].startswith("3/"), row
    (tmp_path / "taken").symlink_to(tmp_path / "cache")
    config = make_config(cache_dir=str(tmp_path / "taken"), cache_disk_bytes=1 << 20)
    with daemon_process(config):
        result = kvsidecar("status", "--endpoint", config.endpoint, "--timeout", "10")
    assert f"disk tier {tmp_path / 'taken'}: off (" in result.stdout, result.stdout


@pytest.mark.timeout(60)
def test_status_without_a_daemon_exits_4_within_its_timeout(tmp_short: Path) -> None:
    endpoint = f"ipc://{tmp_short}/nobody.sock"
    started = time.monotonic()
    result = kvsidecar("status", "--endpoint", endpoint, "--timeout", "1.5", timeout=45)
    elapsed = time.monotonic() - started
    assert result.returncode == EXIT_UNREACHABLE, (result.stdout, result.stderr)
    assert "no answer from" in result.stderr and endpoint in result.stderr
    assert "Traceback" not in result.stderr
    # It waited for its timeout, and then gave up: the rest is interpreter and import time.
    assert 1.5 <= elapsed < 1.5 + 30, elapsed


# ------------------------------------------------------------------------------ demo


@pytest.mark.timeout(150)
def test_demo_small_run_is_ok() -> None:
    result = kvsidecar("demo", "--layers", "2", "--blocks", "64", "--rounds", "1", timeout=120)
    assert result.returncode == EXIT_OK, (result.stdout, result.stderr)
    assert "0 mismatches" in result.stdout
    assert "result: OK" in result.stdout


# ------------------------------------------------------------------------------ serve logs


class Serving:
    """``kvsidecar <args>`` as a child whose stderr lines a `LineReader` collects."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [*KVSIDECAR, *args],
            env=clean_env(),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,  # NIXL, when installed, prints its own lines there
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stderr is not None
        self.lines = LineReader(self.proc.stderr, "kvsidecar serve")

    def rest(self, timeout: float = 10) -> list[str]:
        """Every remaining line, once the child has exited."""
        self.lines.join(timeout)
        return self.lines.available()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.lines.join(10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@pytest.mark.timeout(120)
def test_serve_json_logs_and_sigterm_exits_0(tmp_short: Path) -> None:
    served = Serving("--log-format", "json", *small_serve(tmp_short))
    try:
        first = json.loads(served.lines.get(60))
        assert {"ts", "level", "logger", "message"} <= set(first)
        # Wait until it serves, so SIGTERM exercises the real shutdown path.
        deadline = time.monotonic() + 60
        while "serving on" not in first["message"]:
            first = json.loads(served.lines.get(deadline - time.monotonic()))
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(30) == EXIT_OK
        rest = [line for line in served.rest() if line.strip()]
    finally:
        served.kill()
    docs = [json.loads(line) for line in rest]  # every line is one JSON object
    assert any(d["message"] == "kvsidecar stopped" for d in docs), rest
    assert not (tmp_short / "control.sock").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["endpoint", "peer-endpoint"])
def test_serve_exits_with_the_reason_when_its_port_is_taken(tmp_short: Path, which: str) -> None:
    """A taken port ends `serve` at once with the reason; it used to hang in its shutdown (a
    socket left open by the failed bind kept the ZeroMQ context from terminating)."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        taken = f"tcp://127.0.0.1:{holder.getsockname()[1]}"
        result = kvsidecar(*small_serve(tmp_short), "--insecure", f"--{which}", taken)
    finally:
        holder.close()
    assert result.returncode not in (EXIT_OK, None), result.stderr
    what = "peer endpoint" if which == "peer-endpoint" else "control endpoint"
    assert f"cannot bind the {what} {taken}" in result.stderr, result.stderr
