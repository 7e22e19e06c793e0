"""The README's client example runs as written against a real daemon."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.daemons import daemon_process, make_config

pytestmark = pytest.mark.timeout(120)


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_client_example_runs_against_a_daemon() -> None:
    blocks = _python_blocks((ROOT / "README.md").read_text())
    assert blocks, "README.md has no python example"
    config = make_config()
    with daemon_process(config):
        # The example uses the default endpoint: the one this environment's daemon listens on.
        env = {**os.environ, "KVSIDECAR_RUNTIME_DIR": config.runtime_dir}
        for name in [k for k in env if k.startswith("KVSIDECAR_") and k != "KVSIDECAR_RUNTIME_DIR"]:
            del env[name]
        for block in blocks:
            done = subprocess.run(
                [sys.executable, "-c", block],
                check=False,
                cwd=Path(config.runtime_dir),
                env=env,
                capture_output=True,
                text=True,
                timeout=90,
            )
            assert done.returncode == 0, done.stderr
