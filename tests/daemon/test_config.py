"""Config: one table, precedence defaults < file < env < overrides, validation once."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvsidecar.node.config import Config, ConfigError
from kvsidecar.node.settings import SETTINGS


def test_defaults_fill_paths(tmp_path: Path) -> None:
    c = Config(runtime_dir=str(tmp_path))
    assert c.endpoint == f"ipc://{tmp_path}/control.sock"
    assert c.fd_socket == f"{tmp_path}/fd.sock"
    assert c.ipc_path == f"{tmp_path}/control.sock"


def test_default_runtime_dir_uses_xdg(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1234")
    assert Config.load(env={}).runtime_dir == "/run/user/1234/kvsidecar"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert Config.load(env={}).runtime_dir.startswith("/tmp/kvsidecar-")


def test_precedence(tmp_path: Path) -> None:
    f = tmp_path / "k.toml"
    f.write_text("[kvsidecar]\nlease_s = 3\ncopy_threads = 3\nhost_pool_bytes = 1024\n")
    env = {"KVSIDECAR_COPY_THREADS": "4", "KVSIDECAR_USE_UVLOOP": "false", "UNRELATED": "x"}
    c = Config.load(f, env=env, overrides={"host_pool_bytes": 2048, "lease_s": None})
    assert (c.lease_s, c.copy_threads, c.host_pool_bytes, c.use_uvloop) == (3.0, 4, 2048, False)


def test_flat_toml_and_int_syntax(tmp_path: Path) -> None:
    f = tmp_path / "k.toml"
    f.write_text('host-pool-bytes = 4096\nendpoint = "tcp://127.0.0.1:5555"\ninsecure = true\n')
    c = Config.load(f, env={"KVSIDECAR_MAX_IDS_PER_COMMAND": "0x100"})
    assert c.host_pool_bytes == 4096 and c.endpoint.startswith("tcp://") and c.ipc_path is None
    assert c.max_ids_per_command == 256


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("copy_threads", 0),
        ("lease_s", 0),
        ("host_pool_bytes", -1),
        ("endpoint", "http://x"),
        ("log_level", "chatty"),
        ("max_message_bytes", 10),
    ],
)
def test_bad_values_are_refused(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key.split("_", maxsplit=1)[0]):
        Config.load(env={}, overrides={key: value})


def test_bad_env_and_unknown_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="KVSIDECAR_LEASE_S"):
        Config.load(env={"KVSIDECAR_LEASE_S": "soon"})
    with pytest.raises(ConfigError, match="unknown"):
        Config.load(env={}, overrides={"leas_s": 1})
    f = tmp_path / "k.toml"
    f.write_text("typo = 1\n")
    with pytest.raises(ConfigError, match="typo"):
        Config.load(f, env={})


def test_table_documents_every_field() -> None:
    fields = {f.name for f in dataclasses.fields(Config)}
    assert fields == {s.name for s in SETTINGS}
    for s in SETTINGS:
        assert s.help and s.env_var.startswith("KVSIDECAR_") and s.flag.startswith("--")


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().lease_s = 1  # type: ignore[misc]
