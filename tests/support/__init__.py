"""The test harness: everything tests import to start, watch, attack and stop what they test.

Tests import helpers from here (child processes live in `tests.procs`, started through
`tests.support.children`):

- `tests.support.ports`: TCP ports for daemons and Prometheus (reserved, with a clash check).
- `tests.support.daemons`: configs, a daemon in this event loop (`run_daemon`) or as a process
  (`daemon_process`), both retried with fresh ports when a port was taken in between.
- `tests.support.clients`: the asyncio client behind the blocking client's interface.
- `tests.support.children`: ``tests.procs`` worker processes driven by lines on stdin/stdout.
- `tests.support.procfs`: what ``/proc`` and ``/dev/shm`` say (RSS, mappings, fds, segments).
- `tests.support.prometheus`: a real Prometheus server scraping test targets.
- `tests.support.promql`: the metric names dashboards and alert rules use, and those a scrape has.
- `tests.support.ids`: block-id frames as the wire carries them.
- `tests.support.raw`: raw ZeroMQ requests and SCM_RIGHTS messages, no project client.
- `tests.support.attack`: the attacker process and raw probes of the metrics endpoint.
- `tests.support.caches`, `.deploy`, `.vllm_layout`, `.vllm_serve`: KV caches of random bits, the
  shipped deployment files, a model of vLLM's CPU cache block, ``vllm serve`` for tests.

Test modules import from here, never from one another; from a `tests.procs` module they import
only what that child computes (the values it fills its caches with, its checks), so both sides
agree.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository root: the working directory and import root of every child process."""


def python_env(**extra: str) -> dict[str, str]:
    """This environment with the repository first on ``PYTHONPATH``, plus ``extra``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env
