"""Every setting, given a malformed or absurd value, is refused with one clear line.

A table of bad values for every setting of `kvsidecar.node.settings.SETTINGS` (negative, zero
where it means nothing, past the range, huge, NaN and infinity, the wrong type, empty, bad paths
and endpoints), each tried three ways: as a command-line flag, as its ``KVSIDECAR_*`` variable
and in a TOML file. Each must end the command with a non-zero exit code of
`kvsidecar.exitcodes` and exactly one line on stderr that names the setting, never a traceback,
and never a daemon that starts. The settings are checked by the same code for ``serve`` and
``check-config`` (`kvsidecar.cli._load_config`): the table runs ``check-config`` in this process
(it cannot start a daemon, whatever the value); ``serve`` itself runs as a process for a sample
of the table, and for the values only a start can find wrong (a runtime directory that is a
file, a socket path nobody can create, an address not this node's, a pool larger than memory).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsidecar.cli import main
from kvsidecar.exitcodes import EXIT_CONFIG, EXIT_FAILED, EXIT_USAGE
from kvsidecar.node.settings import SETTINGS, Setting
from tests.support import ROOT, python_env

pytestmark = pytest.mark.timeout(300)

BY_NAME = {s.name: s for s in SETTINGS}

WORDS: dict[str, list[str]] = {
    "endpoint": [
        "ipc://",
        "ipc://relative.sock",
        "tcp://",
        "tcp://nohost",
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:99999",
        "tcp://127.0.0.1:abc",
        "tcp://bad host:5555",
        "http://127.0.0.1:5555",
        "control.sock",
        "ipc:///" + "x" * 120,
    ],
    "runtime_dir": ["relative/dir", "./here"],
    "fd_socket": ["fd.sock", "relative/fd.sock", "/" + "y" * 120],
    "log_level": ["loud", "INFO!", "0"],
    "peer_endpoint": [
        "tcp://",
        "tcp://host",
        "tcp://127.0.0.1:99999",
        "tcp://127.0.0.1:-1",
        "ipc:///tmp/peer.sock",
        "udp://127.0.0.1:5555",
    ],
    "peer_data_plane": ["x", "rdma", "ZMQ"],
    "metrics_host": ["not a host", "999.1.1.1", "256.0.0.1", "-bad-", "a..b"],
    "allowed_uids": ["-1", "abc", "1,,2", "99999999999", ",", "0x10"],
    "curve_secret_key": ["/nonexistent/key_secret", "/etc/passwd"],
    "curve_authorized_keys": ["/nonexistent/keys", "/etc/passwd"],
    "peers": [
        "tcp://127.0.0.1",
        "tcp://127.0.0.1:0",
        "tcp://10.0.0.1:5555;127.0.0.1:5556",
        "tcp://*:5555",
        "ipc:///tmp/peer.sock",
        "tcp://127.0.0.1:5555,nonsense",
    ],
    "cache_dir": ["relative/cache", "./cache"],
    "cache_disk_admit": ["sometimes", "ALL", ""],
}
"""Bad values of the settings that are words (paths, endpoints, names, lists)."""


def _numbers(setting: Setting) -> list[str]:
    """Bad values of a number: below and past its range, huge, NaN, infinite, not a number."""
    assert setting.low is not None and setting.high is not None
    step = 1 if setting.type is int else 0.001
    values = [
        repr(type(setting.default)(setting.low - step)),
        repr(type(setting.default)(setting.high * 2 + step)),
        "nan",
        "inf",
        "-inf",
        "abc",
        "",
        "1e400",
    ]
    if setting.type is int:
        values += [str(1 << 63), str(1 << 70), "1.5", "0x"]
    return values


def _bad_values(setting: Setting) -> list[str]:
    if setting.type is bool:
        return ["maybe", "2", "", "yes please"]
    if setting.type is str:
        return WORDS[setting.name]
    return _numbers(setting)


CASES = [(s.name, v) for s in SETTINGS for v in _bad_values(s)]


def test_the_table_covers_every_setting() -> None:
    assert {name for name, _ in CASES} == set(BY_NAME)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """No KVSIDECAR_* from outside; a private runtime dir (nothing is created in it)."""
    for key in list(os.environ):
        if key.startswith("KVSIDECAR_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("KVSIDECAR_RUNTIME_DIR", str(tmp_path / "run"))
    yield tmp_path


def _toml_literal(setting: Setting, value: str) -> list[str]:
    """The TOML spellings of a bad value: the text as a string, and as a literal where the
    text is one (a number, a word TOML knows), plus a value of the wrong TOML type."""
    quoted = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    literals = [quoted] if setting.type is str else []
    if setting.type is not str and value not in ("", "abc", "0x", "yes please"):
        literals.append(value)
    wrong = {bool: ["2", '"maybe"', "[true]"], int: ["1.5", "true", "[1]"], float: ["true"]}
    return literals + wrong.get(setting.type, ["5", "true", '["x"]'])


def _one_refusal(err: str, name: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "Traceback" not in err
    assert name in lines[0] or BY_NAME[name].flag in lines[0], lines
    return lines[0]


def _check_config(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(["check-config", *argv])
    except SystemExit as exc:  # argparse's usage errors
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.err


@pytest.mark.parametrize(("name", "value"), CASES)
def test_a_bad_value_is_refused_from_every_source(
    name: str,
    value: str,
    clean_env: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    setting = BY_NAME[name]
    # The command line.
    code, err = _check_config([f"{setting.flag}={value}"], capsys)
    assert code in (EXIT_CONFIG, EXIT_USAGE), (code, err)
    _one_refusal(err, name)
    # The environment.
    monkeypatch.setenv(setting.env_var, value)
    code, err = _check_config([], capsys)
    assert code == EXIT_CONFIG, (code, err)
    _one_refusal(err, name)
    monkeypatch.delenv(setting.env_var)
    # A TOML file, in each spelling.
    for literal in _toml_literal(setting, value):
        path = clean_env / "kvsidecar.toml"
        path.write_text(f"[kvsidecar]\n{name} = {literal}\n")
        code, err = _check_config(["--config", str(path)], capsys)
        if code != EXIT_CONFIG and "not valid TOML" not in err:
            pytest.fail(f"{name} = {literal}: exit {code}: {err}")
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in err, (literal, err)


def _serve(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvsidecar.cli", "serve", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _refusal_of_serve(done: subprocess.CompletedProcess[str]) -> str:
    """The one line a refused ``serve`` wrote (log lines of the daemon's own aside)."""
    assert done.returncode in (EXIT_FAILED, EXIT_CONFIG, EXIT_USAGE), (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("kvsidecar")]
    assert len(said) == 1, done.stderr[-3000:]
    assert "serving on" not in done.stderr, done.stderr[-3000:]
    return said[0]


def _env(runtime: str, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in python_env().items() if not k.startswith("KVSIDECAR_")}
    env.update(
        KVSIDECAR_RUNTIME_DIR=runtime,
        KVSIDECAR_METRICS_PORT="0",
        KVSIDECAR_HOST_POOL_BYTES=str(8 << 20),
        KVSIDECAR_PEER_DATA_PLANE="zmq",
        UCX_NET_DEVICES="lo",
    )
    env.update({f"KVSIDECAR_{k.upper()}": v for k, v in settings.items()})
    return env


@pytest.fixture
def runtime() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="kvs-", dir="/tmp")
    yield path
    subprocess.run(["rm", "-rf", path], check=False)


@pytest.mark.parametrize("source", ["flag", "env", "toml"])
def test_serve_refuses_a_bad_value_from_each_source(source: str, runtime: str) -> None:
    """The sample through ``serve`` itself: an absurd lease, a bad uid list, a malformed
    endpoint; one line, exit 3, no daemon."""
    bad = {"lease_s": "1e9", "allowed_uids": "0,,1", "peer_endpoint": "tcp://127.0.0.1:99999"}
    for name, value in bad.items():
        setting = BY_NAME[name]
        env, args = _env(runtime), []
        if source == "flag":
            args = [f"{setting.flag}={value}"]
        elif source == "env":
            env[setting.env_var] = value
        else:
            path = Path(runtime) / "settings.toml"
            literal = value if setting.type is float else f'"{value}"'
            path.write_text(f"{name} = {literal}\n")
            args = ["--config", str(path)]
        done = _serve(env, *args)
        assert done.returncode == EXIT_CONFIG, (name, done.stderr[-2000:])
        assert name in _refusal_of_serve(done)


START_FAILURES = [
    ("runtime_dir", "/etc/passwd", "not a directory"),
    ("runtime_dir", "/proc/kvsidecar-test", "cannot create runtime_dir"),
    ("endpoint", "ipc:///proc/kvsidecar-test/c.sock", "cannot create the directory of endpoint"),
    ("fd_socket", "/proc/kvsidecar-test/fd.sock", "cannot create the directory of fd_socket"),
    ("fd_socket", "/tmp", "cannot bind the fd channel"),
    ("metrics_host", "nonexistent.invalid", "cannot bind the metrics endpoint"),
    ("metrics_host", "192.0.2.1", "cannot bind the metrics endpoint"),
    ("host_pool_bytes", str(1 << 45), "more than this node's memory"),
    ("peer_endpoint", "tcp://192.0.2.1:5555", "cannot bind the peer endpoint"),
]
"""Values only a start can find wrong, and what the one line must say."""


@pytest.mark.parametrize(("name", "value", "said"), START_FAILURES)
def test_serve_refuses_what_only_a_start_can_find_with_one_line(
    name: str, value: str, said: str, runtime: str
) -> None:
    extra = {"insecure": "true"} if name == "peer_endpoint" else {}
    done = _serve(_env(runtime, **{name: value}, **extra))
    assert said in _refusal_of_serve(done), done.stderr[-2000:]
