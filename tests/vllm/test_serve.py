"""vLLM's OpenAI server with the connector, used and attacked as its API users do.

Real ``vllm serve`` processes (the CLI, `tests.support.vllm_serve`) of the test model (random
weights: outputs depend on the KV cache) share one daemon; requests come over HTTP as JSON:

- ``ref``: no connector, the reference. A prefix hit takes another numeric path than a full
  forward on vLLM's bfloat16 CPU kernels, so outputs are compared with ``ref`` taking the same
  path: a prompt the connector engine loads from the daemon is compared with ``ref`` serving it
  from its own prefix cache (it computed the same prompt just before), tokens and
  log-probabilities;
- ``pd``: role ``kv_both`` with disaggregated prefill on (``disaggregated``): the engine hostile
  request bodies are aimed at, publishing and pulling through the daemon;
- ``docs``: started from the ``vllm serve`` recipe of docs/vllm.md exactly (its
  ``--kv-transfer-config``, the daemon found through ``KVSIDECAR_RUNTIME_DIR``): the prefix-cache
  recipe, which ignores hand-over params; also the "fresh engine of the same user" that shows
  whether anything wrong reached the node cache.

After each hostile body: the engine is alive, the request ended within its bound, and normal
requests on it and on ``docs`` give ``ref``'s outputs. Faults on the load path are made where
they happen: the engine's worker process is stopped between the scheduler's pin and the load,
the pin lets go, the daemon evicts or is stopped itself. `vllm bench serve`, vLLM's own client,
drives many requests at once over both connector engines.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from kvsidecar.client import SidecarClient
from kvsidecar.memory import allocate_kv_caches
from kvsidecar.wire.cache import CacheNamespaceInfo
from tests.support import ROOT
from tests.support.daemons import DaemonProcess, make_config
from tests.support.ports import tcp_endpoint
from tests.support.vllm_serve import (
    CONNECTOR,
    VLLM_VENVS,
    Completion,
    VllmServer,
    block_hashes,
    make_model,
    same_outputs,
    tokens,
    vllm_venv_params,
)

pytestmark = pytest.mark.timeout(900)

BLOCK = 32
BLOCK_BYTES = 2 * 2 * 32 * 64 * 2
"""One block of the test model: 2 layers x 2 KV heads x 32 tokens x (K + V of 32) bf16."""
LOAD_TIMEOUT_S = 3.0
"""The ``pd`` engine's bound on a load (the faults below make loads wait this long)."""
PIN_S = 1.0
"""The daemon's ``cache_pin_s``: how long a pin holds, so that a fault can outlast it."""
REQUEST_S = 120.0
"""Bound on every request: a request that takes longer has hung."""

T = TypeVar("T")


def recipe_config() -> dict[str, Any]:
    """The ``--kv-transfer-config`` of docs/vllm.md's ``vllm serve`` recipe, as written there."""
    text = (ROOT / "docs" / "vllm.md").read_text()
    block = re.search(r"```sh\n(vllm serve [^`]*?)```", text)
    assert block is not None, "docs/vllm.md has no vllm serve recipe"
    found = re.search(r"--kv-transfer-config '(\{.*?\})'", block.group(1), re.S)
    assert found is not None, block.group(1)
    config: dict[str, Any] = json.loads(found.group(1))
    return config


class Rig:
    """The daemon and the three servers of the module (see the module doc)."""

    def __init__(self, tmp: Path, venv: Path) -> None:
        self.tmp = tmp
        self.venv = venv
        self.model = tmp / "model"
        make_model(venv, self.model)
        self.daemon_config = make_config(
            host_pool_bytes=64 << 20,
            cache_bytes=4 << 20,  # 256 blocks: small enough to fill, for the eviction fault
            cache_pin_s=PIN_S,
            lease_s=5.0,
            peer_endpoint=tcp_endpoint(),
            peer_data_plane="zmq",
            peer_lease_s=60.0,
            insecure=True,
        )
        self.daemon = DaemonProcess(self.daemon_config)
        self.servers: dict[str, VllmServer] = {}

    def start(self) -> None:
        self.daemon.wait_ready()
        env = {"KVSIDECAR_RUNTIME_DIR": self.daemon_config.runtime_dir}
        pd = {
            **CONNECTOR,
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "disaggregated": True,
                "load_timeout_s": LOAD_TIMEOUT_S,
                "lease_s": 5.0,
                "lookup_timeout_s": 5.0,
            },
        }
        venv, model, tmp = self.venv, self.model, self.tmp
        self.servers = {
            "ref": VllmServer("ref", venv, model, tmp),
            # Its development endpoints on: /reset_prefix_cache, as a weight update calls it.
            "pd": VllmServer(
                "pd",
                venv,
                model,
                tmp,
                kv_transfer_config=pd,
                env={**env, "VLLM_SERVER_DEV_MODE": "1"},
            ),
            "docs": VllmServer(
                "docs", venv, model, tmp, kv_transfer_config=recipe_config(), env=env
            ),
        }
        for server in self.servers.values():
            server.wait_ready()

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.daemon.stop()
        shutil.rmtree(self.daemon_config.runtime_dir, ignore_errors=True)

    def client(self) -> SidecarClient:
        return SidecarClient(self.daemon_config.endpoint, heartbeat=False)


@pytest.fixture(scope="module", params=vllm_venv_params())
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    """The rig on each tested vLLM in turn (`tests.support.vllm_serve.VLLM_VENVS`)."""
    venv: Path = request.param
    keep = os.environ.get("KVSIDECAR_VLLM_LOGS")  # keeps the servers' logs where they can be read
    # Short, under /tmp: vLLM's ipc socket paths must fit in 107 bytes.
    tmp = (
        Path(keep) / venv.name if keep else Path(tempfile.mkdtemp(prefix="kvs-serve-", dir="/tmp"))
    )
    tmp.mkdir(parents=True, exist_ok=True)
    rig = Rig(tmp, venv)
    try:
        rig.start()
        yield rig
    finally:
        rig.stop()
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------ comparing outputs


def reference(rig: Rig, prompt: list[int], *, warm: list[int] | None = None) -> Completion:
    """``ref``'s completion of ``prompt``, after ``warm`` (a prompt sharing its prefix) when the
    engine compared with it loads that prefix (the same cache path)."""
    if warm is not None:
        rig.servers["ref"].complete(warm)
    return rig.servers["ref"].complete(prompt)


def test_the_comparison_catches_a_block_of_the_wrong_contents(rig: Rig) -> None:
    """The negative control: random blocks stored under a prompt's hashes (computed here, not by
    vLLM) are loaded by ``docs``, and its outputs are no longer ``ref``'s on the same path."""
    rig.servers["pd"].complete(tokens(103, 64))  # the engines' namespace exists from here on
    prompt = tokens(102, 200)
    store_random_blocks(rig, block_hashes(prompt)[:4])
    got = rig.servers["docs"].complete(prompt)
    want = reference(rig, prompt, warm=prompt[:128])
    with pytest.raises(AssertionError):
        same_outputs(got, want)


# ------------------------------------------------------------------ the recipe


def test_the_docs_recipe_serves_and_shares_a_prefix_between_engines(rig: Rig) -> None:
    """A prompt computed by ``pd`` is loaded by ``docs`` (the recipe as written): all but the
    last block's tail comes from the daemon, and the outputs are ``ref``'s on the same path."""
    prompt = tokens(101, 250)
    first = rig.servers["pd"].complete(prompt)
    same_outputs(first, reference(rig, prompt))
    docs = rig.servers["docs"]
    hits = docs.metric("vllm:external_prefix_cache_hits_total")
    second = docs.complete(prompt)
    assert docs.metric("vllm:external_prefix_cache_hits_total") - hits == 224  # 7 blocks
    same_outputs(second, reference(rig, prompt))  # ref's own cache holds it now
    assert second.body["usage"]["prompt_tokens"] == 250
    # The engine's log says once that the cache is on, with its daemon, namespace and layout.
    log = docs.log_path.read_text()
    ((daemon_at, namespace),) = re.findall(
        r"kvsidecar worker 0: cache on: daemon (\S+) \(\S*\), namespace ([^,]+),", log
    )
    assert (daemon_at, namespace) == (rig.daemon_config.endpoint, _namespace(rig))
    assert "layers registered as vllm_cpu" in log and "connector on (role kv_both" in log


# ------------------------------------------------------------------ hostile request bodies


def _daemon_id(rig: Rig) -> str:
    with rig.client() as c:
        assert c.daemon is not None
        return c.daemon.daemon_id


def _pulls_failed(rig: Rig) -> int:
    with rig.client() as c:
        return c.status().pulls_failed_total


def prefill(rig: Rig, prompt: list[int]) -> dict[str, Any]:
    """Prefill ``prompt`` on ``pd`` for a decode engine: the ``kv_transfer_params`` it returns."""
    out = rig.servers["pd"].complete(
        prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    params = out.body.get("kv_transfer_params")
    assert params and params["do_remote_prefill"], out.body
    params.pop("remote_prefill_cached_tokens", None)  # vLLM's count of the producer's own hits
    return dict(params)


class Listener:
    """A TCP port that counts the connections made to it (a client-named endpoint)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


HOSTILE_PARAMS: list[tuple[str, Any]] = [
    ("a string", "do_remote_prefill"),
    ("a list", [1, 2, 3]),
    ("empty", {}),
    ("only the flag", {"do_remote_prefill": True}),
    ("the flag as a string", {"do_remote_prefill": "true", "remote_num_tokens": 10}),
    ("more tokens than the prompt", {"do_remote_prefill": True, "remote_num_tokens": 100000}),
    ("negative tokens", {"do_remote_prefill": True, "remote_num_tokens": -5}),
    ("nested junk", {"do_remote_prefill": True, "remote_block_ids": [[1], {"a": 2}]}),
    ("both flags", {"do_remote_prefill": True, "do_remote_decode": True}),
    ("decode flag as a number", {"do_remote_decode": 1}),
]


@pytest.mark.parametrize("what,params", HOSTILE_PARAMS, ids=[h[0] for h in HOSTILE_PARAMS])
def test_a_hostile_body_is_answered_and_leaves_the_engine_right(
    rig: Rig, what: str, params: Any
) -> None:
    """A malformed hand-over never kills, wedges or misleads the engine: the request is refused
    by vLLM's own validation (4xx) or computed here (``ref``'s outputs), within its bound; then
    the engine, and a fresh engine of the same user, serve it and others right."""
    pd, docs = rig.servers["pd"], rig.servers["docs"]
    case = HOSTILE_PARAMS.index((what, params))
    prompt = tokens(200 + case, 150)
    started = time.monotonic()
    status, answer = pd.completion(prompt, kv_transfer_params=params, timeout=REQUEST_S)
    assert time.monotonic() - started < REQUEST_S
    assert status in (200, 400, 422), (status, answer)
    assert pd.alive() and pd.metric("vllm:num_requests_running") == 0
    if status == 200:
        fresh = reference(rig, prompt)
        tokens_out = [
            int(t.removeprefix("token_id:")) for t in answer["choices"][0]["logprobs"]["tokens"]
        ]
        assert tokens_out == fresh.tokens
        same_outputs(pd.complete(prompt), reference(rig, prompt))  # pd's own cache now
        same_outputs(docs.complete(prompt), reference(rig, prompt))  # what pd stored of it
    normal = tokens(300 + case, 100)
    same_outputs(pd.complete(normal), reference(rig, normal))


def test_a_hand_over_naming_any_endpoint_connects_nowhere(rig: Rig) -> None:
    """Whatever endpoint a client names, the daemon is not sent there (only its own or
    configured peers): a listener on that port sees no connection, the prompt is computed."""
    listener = Listener()
    try:
        pd = rig.servers["pd"]
        prompt = tokens(310, 96)
        params = prefill(rig, tokens(311, 96))
        params.update(remote_endpoint=f"tcp://127.0.0.1:{listener.port}", remote_daemon_id="x")
        before = pd.metric("vllm:kvsidecar_kv_params_ignored_total", reason="endpoint")
        out = pd.complete(prompt, kv_transfer_params=params)
        time.sleep(1.0)
        assert listener.accepted == 0
        assert pd.metric("vllm:kvsidecar_kv_params_ignored_total", reason="endpoint") == before + 1
        same_outputs(out, reference(rig, prompt))
    finally:
        listener.close()


def test_a_hand_over_of_blocks_that_were_not_published_reads_none_of_them(rig: Rig) -> None:
    """An API user publishes a request of its own, then names other blocks of the engine's
    cache (another user's prompt may be in them) under that request: the daemon serves none of
    them, the pull fails, the prompt is computed here, unaffected by those blocks."""
    pd = rig.servers["pd"]
    victim = tokens(320, 224)
    pd.complete(victim)  # another user's private prompt, in pd's cache now
    mine = tokens(321, 128)
    params = prefill(rig, mine)
    published = params["remote_block_ids"]
    params["remote_block_ids"] = [(b + 7) % 2000 for b in published]  # as many, other blocks
    failed = _pulls_failed(rig)
    out = pd.complete(mine, kv_transfer_params=params)  # within the prefill's lease
    assert _pulls_failed(rig) == failed + 1
    assert "refused by the producer: out_of_range: blocks that request" in pd.tail(200)
    # The control: a prefill's params as published pull it.
    control = tokens(322, 128)
    params = prefill(rig, control)
    pulled = pd.metric("vllm:kvsidecar_pulled_requests_total")
    again = pd.complete(control, kv_transfer_params=params)
    assert pd.metric("vllm:kvsidecar_pulled_requests_total") == pulled + 1
    same_outputs(out, reference(rig, mine, warm=mine))  # pd computed it over its own hit
    same_outputs(again, reference(rig, control, warm=control))


def test_the_hand_over_of_one_prompt_sent_with_another_is_refused(rig: Rig) -> None:
    """Prompt B sent with the params of prompt A (same length): the daemon serves A's blocks only
    to a pull for A's prompt, so B is computed here; neither engine's cache, nor the daemon's,
    then names A's KV with B's hashes: a fresh engine gives ``ref``'s outputs for both."""
    pd, docs = rig.servers["pd"], rig.servers["docs"]
    a, b = tokens(330, 160), tokens(331, 160)
    params = prefill(rig, a)
    failed = _pulls_failed(rig)
    out = pd.complete(b, kv_transfer_params=params)
    assert _pulls_failed(rig) == failed + 1
    assert "refused by the producer: another_prompt: request" in pd.tail(200)
    same_outputs(out, reference(rig, b))
    # pd computed and stored B itself; docs has seen neither prompt: it loads both from the
    # daemon, and gets what ref gets from its own cache.
    for prompt in (a, b):
        same_outputs(docs.complete(prompt), reference(rig, prompt))
    with rig.client() as c:
        (space,) = {n.fingerprint for n in c.status().cache_namespaces}
        assert c.cache_lookup(space, block_hashes(b)).hits >= len(b) // BLOCK  # B's are B's


# ------------------------------------------------------------------ faults on the load path


def _namespace(rig: Rig) -> str:
    with rig.client() as c:
        (space,) = {n.fingerprint for n in c.status().cache_namespaces}
        return space


def _held(rig: Rig, prompt: list[int]) -> list[bool]:
    """Whether the daemon holds each full block of ``prompt`` (asked one by one)."""
    space = _namespace(rig)
    with rig.client() as c:
        return [c.cache_lookup(space, [h]).hits == 1 for h in block_hashes(prompt)]


def store_random_blocks(rig: Rig, keys: list[bytes] | None = None) -> None:
    """Store blocks of random contents, as a second client of the same user with the engines'
    layers could: under ``keys``, or under new keys, as many as the namespace holds (then every
    unpinned block is evicted, least recently used first)."""
    with rig.client() as c:
        status = c.status()
        (space,) = status.cache_namespaces
        layers = status.engines[0].workers[0].layers
    desc = layers[0].descriptor
    if keys is None:
        keys = [os.urandom(32) for _ in range(space.capacity_blocks)]
    shape = (len(keys), desc.num_heads, desc.block_size, 2 * desc.head_size)
    caches = allocate_kv_caches(len(layers), shape, torch.bfloat16)
    for t in caches:
        t.copy_(torch.randn(t.shape))
    with SidecarClient(rig.daemon_config.endpoint, heartbeat=False) as c:
        c.register_kv_caches(
            {lb.name: t for lb, t in zip(layers, caches, strict=True)},
            engine_id="random-blocks",
            arrangement=desc.arrangement,
            memory_order="HND",
            shape_order="NH",
        )
        stored = c.submit_cache_store(space.fingerprint, keys, list(range(len(keys)))).result()
        assert stored.stored == len(keys), stored


class Stopped:
    """``pd``'s worker processes stopped (SIGSTOP) until `resume`: its scheduler admits, looks
    up and pins a request, and its worker has not loaded yet."""

    def __init__(self, rig: Rig) -> None:
        self.pids = rig.servers["pd"].worker_pids()
        assert self.pids, rig.servers["pd"].tail()
        for pid in self.pids:
            os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        for pid in self.pids:
            os.kill(pid, signal.SIGCONT)


def _in_background(server: VllmServer, prompt: list[int]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(server.complete(prompt, timeout=REQUEST_S))
        except BaseException as exc:  # reported by the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _eventually(read: Callable[[], T], done: Callable[[T], bool], timeout_s: float = 30.0) -> T:
    """Read until ``done`` says so (what an engine's store changes lands after its answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = read()
        if done(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def _wait_pinned(rig: Rig, blocks: int) -> None:
    deadline = time.monotonic() + 60
    with rig.client() as c:
        while sum(n.pinned_blocks for n in c.status().cache_namespaces) < blocks:
            assert time.monotonic() < deadline, "the scheduler never pinned its load"
            time.sleep(0.05)


def _fault(rig: Rig, seed: int, between: Any) -> tuple[list[int], list[int], Completion]:
    """A prompt whose first 4 blocks ``docs`` computed (the daemon holds them) is sent to ``pd``;
    ``between`` runs once the scheduler pinned them and before the worker loads them."""
    base = tokens(seed, 256)
    rig.servers["docs"].complete(base)
    prompt = base[:128] + tokens(seed + 1, 130)  # 4 blocks loaded, 4 more and a tail computed
    stopped = Stopped(rig)
    try:
        thread, out = _in_background(rig.servers["pd"], prompt)
        _wait_pinned(rig, 4)
        between()
    finally:
        stopped.resume()
    thread.join(REQUEST_S + 10)
    assert out and isinstance(out[0], Completion), out
    return base, prompt, out[0]


def test_a_block_evicted_between_lookup_and_load_is_recomputed_and_not_built_on(rig: Rig) -> None:
    """The pin lets go and the blocks are evicted before the worker loads them: the load fails,
    vLLM recomputes, and nothing the failed step computed over them reaches the daemon."""
    failed = rig.servers["pd"].metric("vllm:kvsidecar_blocks_total", event="load_failed")

    def evict() -> None:
        time.sleep(PIN_S + 0.3)
        store_random_blocks(rig)

    base, prompt, out = _fault(rig, 400, evict)
    pd = rig.servers["pd"]
    assert pd.metric("vllm:kvsidecar_blocks_total", event="load_failed") - failed == 4
    assert pd.metric("vllm:kvsidecar_blocks_total", event="not_stored") >= 4
    same_outputs(out, reference(rig, prompt))  # recomputed from its first block
    assert _held(rig, prompt) == [False] * 8  # evicted, and nothing stored after the failure
    # docs has the first 4 blocks itself and finds no others: ref on the same path.
    same_outputs(rig.servers["docs"].complete(prompt), reference(rig, prompt, warm=base))


def test_a_daemon_stopped_between_pin_and_load_costs_one_load_timeout(rig: Rig) -> None:
    """The daemon stops (SIGSTOP) after the pin: the load times out after ``load_timeout_s``,
    vLLM recomputes, and once the daemon goes on nothing of that request is stored."""
    daemon = rig.daemon.proc.pid
    started = time.monotonic()

    def stop_daemon() -> None:
        os.kill(daemon, signal.SIGSTOP)

    try:
        base, prompt, out = _fault(rig, 410, stop_daemon)
    finally:
        os.kill(daemon, signal.SIGCONT)
    took = time.monotonic() - started
    assert LOAD_TIMEOUT_S < took < LOAD_TIMEOUT_S + 60
    same_outputs(out, reference(rig, prompt))
    time.sleep(2.0)  # what pd sent while the daemon was stopped has been served by now
    assert _held(rig, prompt) == [True] * 4 + [False] * 4
    same_outputs(rig.servers["docs"].complete(prompt), reference(rig, prompt, warm=base))
    assert rig.servers["pd"].alive() and rig.servers["docs"].alive()


# ------------------------------------------------------------------ many requests at once


def bench(server: VllmServer, out: Path, *, seed: int, prompts: int) -> subprocess.Popen[bytes]:
    """Start ``vllm bench serve`` (vLLM's own client) on ``server``: shared-prefix requests,
    16 at a time, greedy; its result (every request's output) goes to ``out``."""
    dataset = [
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        "256",
        "--prefix-repetition-suffix-len",
        "64",
        "--prefix-repetition-num-prefixes",
        "4",
        "--prefix-repetition-output-len",
        "16",
    ]
    cmd = server.bench_serve_command(out, dataset, prompts=prompts, concurrency=16, seed=seed)
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 - the child holds it
    return subprocess.Popen(
        cmd, cwd=out.parent, stdout=log, stderr=subprocess.STDOUT, env={**os.environ}
    )


def test_vllm_bench_serve_over_two_replicas_hits_and_leaves_nothing_held(rig: Rig) -> None:
    """32 requests at a time, four 256-token prefixes over two replicas (the same prompts on
    both, as a router spreading them would): every request completes, the prefixes one replica
    computed the other loads from the daemon, and afterwards nothing is held anywhere.

    ``docs`` starts once ``pd`` has finished half of its requests (each prefix is among them,
    the dataset shuffles 8 prompts of each): started together, both replicas compute every
    prefix at once and neither has anything to load. The two runs overlap from then on."""
    pd, docs = rig.servers["pd"], rig.servers["docs"]
    hits = {n: s.metric("vllm:external_prefix_cache_hits_total") for n, s in rig.servers.items()}
    with rig.client() as c:
        before = sum(n.loaded_blocks for n in c.status().cache_namespaces)
    done_before = pd.metric("vllm:request_success_total")
    runs = {"pd": bench(pd, rig.tmp / "bench-pd.json", seed=7, prompts=32)}
    deadline = time.monotonic() + 300
    while pd.metric("vllm:request_success_total") - done_before < 16:
        assert runs["pd"].poll() is None or runs["pd"].returncode == 0, (
            rig.tmp / "bench-pd.log"
        ).read_text()[-3000:]
        assert time.monotonic() < deadline, "pd finished fewer than 16 requests in 300 s"
        time.sleep(0.2)
    runs["docs"] = bench(docs, rig.tmp / "bench-docs.json", seed=7, prompts=32)
    for name, proc in runs.items():
        assert proc.wait(600) == 0, (rig.tmp / f"bench-{name}.log").read_text()[-3000:]
    for name in runs:
        result = json.loads((rig.tmp / f"bench-{name}.json").read_text())
        assert (result["completed"], result["failed"]) == (32, 0), result.get("errors")
    loaded = {
        n: rig.servers[n].metric("vllm:external_prefix_cache_hits_total") - hits[n] for n in runs
    }
    with rig.client() as c:
        daemon_loaded = sum(n.loaded_blocks for n in c.status().cache_namespaces) - before
    # docs found every prefix stored by pd (at least one block of each of the four), and every
    # hit vLLM counted is a block the daemon loaded.
    assert loaded["docs"] >= 4 * BLOCK, loaded
    assert daemon_loaded * BLOCK >= sum(loaded.values()), (daemon_loaded, loaded)
    if rig.venv != VLLM_VENVS["0.31"]:  # 0.32 counts hits by source: the daemon's are "host"
        by_source = "vllm:prompt_tokens_cached_by_source_total"
        host = sum(rig.servers[n].metric(by_source, source="host") for n in runs)
        unknown = sum(rig.servers[n].metric(by_source, source="external_unspecified") for n in runs)
        assert host >= sum(loaded.values()) and unknown == 0, (host, unknown)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with rig.client() as c:
            st = c.status()
        busy = [
            s.metric("vllm:num_requests_running") + s.metric("vllm:kv_cache_usage_perc")
            for s in (pd, docs)
        ]
        pinned = sum(n.pinned_blocks for n in st.cache_namespaces)
        if not any(busy) and not pinned and not st.in_flight_moves and not st.published_requests:
            break
        time.sleep(0.5)
    assert not any(busy) and not pinned and not st.in_flight_moves, (busy, pinned, st)
    assert st.published_requests == 0


def test_concurrent_outputs_match_the_reference_on_the_same_cache_path(rig: Rig) -> None:
    """16 requests in flight over both replicas, sharing four prefixes: each output equals
    ``ref``'s for the same prompt served from its own prefix cache, tokens and log-probabilities
    (within `LOGPROB_TOL`: other batches round bfloat16 otherwise)."""
    prefixes = [tokens(500 + i, 256) for i in range(4)]
    prompts = [p + tokens(600 + 10 * i + j, 40) for i, p in enumerate(prefixes) for j in range(6)]
    servers = [rig.servers["pd"], rig.servers["docs"]]
    results: dict[int, Any] = {}

    def run(k: int) -> None:
        try:
            results[k] = servers[k % 2].complete(prompts[k], timeout=REQUEST_S)
        except BaseException as exc:
            results[k] = exc

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_S + 30)
    for k, prompt in enumerate(prompts):
        got = results[k]
        assert isinstance(got, Completion), got
        same_outputs(got, reference(rig, prompt, warm=prefixes[k // 6]))


def test_a_prefill_nobody_reads_is_held_for_its_lease_only(rig: Rig) -> None:
    """``do_remote_decode`` from a client: on ``pd`` the blocks are published and held for the
    lease (5 s here), then released; on ``docs`` (the prefix-cache recipe) nothing is published,
    and its blocks are let go as soon as its stores ended (held that long, not for a lease)."""
    pd, docs = rig.servers["pd"], rig.servers["docs"]
    for server, held in ((docs, False), (pd, True)):
        out = server.complete(
            tokens(700, 200), max_tokens=1, kv_transfer_params={"do_remote_decode": True}
        )
        assert bool(out.body.get("kv_transfer_params")) == held, out.body
        with rig.client() as c:
            # The publish is sent as the request finishes, not waited for: it may land after
            # the answer (within the lease, which starts when it lands).
            want = 1 if held else 0
            published = _eventually(
                lambda: c.status().published_requests, want.__eq__, timeout_s=3.0
            )
        assert published == want
        if held:
            assert server.metric("vllm:kv_cache_usage_perc") > 0
            continue
        deadline = time.monotonic() + 6.0  # its stores end within store_wait_s (5 s)
        while time.monotonic() < deadline and server.metric("vllm:kv_cache_usage_perc") > 0:
            time.sleep(0.1)
        assert server.metric("vllm:kv_cache_usage_perc") == 0
    deadline = time.monotonic() + 5.0 + 15
    while time.monotonic() < deadline and pd.metric("vllm:kv_cache_usage_perc") > 0:
        time.sleep(0.5)
    assert pd.metric("vllm:kv_cache_usage_perc") == 0
    with rig.client() as c:
        assert c.status().published_requests == 0


# ------------------------------------------------------------------ last: a reset of the cache


def test_a_reset_of_the_connectors_cache_leaves_the_old_namespace_to_the_others(rig: Rig) -> None:
    """``reset_prefix_cache(reset_connector=True)``, as after a weight update: ``pd`` stores into a
    namespace of its own from then on, and loads nothing from the one it shared (its blocks were
    computed with the old weights); ``docs`` keeps the old one and finds nothing of ``pd``'s new
    blocks. The old namespace held all of the daemon's ``cache_bytes``: it is made again at half,
    empty, for the new one, and ``docs`` stores into it as before. Last in the module: ``pd`` and
    ``docs`` no longer share a cache after it."""
    pd, docs = rig.servers["pd"], rig.servers["docs"]
    before = tokens(800, 200)
    pd.complete(before)
    with rig.client() as c:
        (old,) = {n.fingerprint for n in c.status().cache_namespaces}
    # vLLM resets its prefix cache only with no block in use: wait for the stores to end.
    usage = _eventually(lambda: pd.metric("vllm:kv_cache_usage_perc"), lambda u: u == 0)
    assert usage == 0
    status, answer = pd.post("/reset_prefix_cache?reset_external=true", {})
    assert status == 200 and answer == {"success": True}, (status, answer)
    after = tokens(801, 200)
    fresh = reference(rig, after)  # computed whole, as pd and docs compute it below
    same_outputs(pd.complete(after), fresh)
    full = len(after) // BLOCK

    def namespaces() -> dict[str, CacheNamespaceInfo]:
        with rig.client() as c:
            return {n.fingerprint: n for n in c.status().cache_namespaces}

    # The stores are answered after the requests: wait for them, boundedly.
    spaces = _eventually(
        namespaces, lambda got: any(n.ready_blocks for f, n in got.items() if f != old)
    )
    (new,) = set(spaces) - {old}
    assert new.startswith(old + "~") and spaces[new].stored_blocks == full
    assert spaces[old].workers == 1 and spaces[old].ready_blocks == 0  # docs's, made again empty
    assert spaces[new].capacity_blocks + spaces[old].capacity_blocks <= (4 << 20) // BLOCK_BYTES
    hits = {s.name: s.metric("vllm:external_prefix_cache_hits_total") for s in (pd, docs)}
    same_outputs(docs.complete(after), fresh)  # computed: not in its namespace
    same_outputs(pd.complete(before), reference(rig, before))  # computed: the old one is not its
    assert {s.name: s.metric("vllm:external_prefix_cache_hits_total") for s in (pd, docs)} == hits
    # docs stored what it computed into the old namespace: its cache works as before.
    _eventually(namespaces, lambda got: got[old].ready_blocks >= full)
    with rig.client() as c:
        assert c.cache_lookup(old, block_hashes(after)).hits == full
