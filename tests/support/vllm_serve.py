"""vLLM's OpenAI server for tests: the real ``vllm serve`` CLI, and a plain HTTP client for it.

`VllmServer` starts ``vllm serve`` from a vLLM venv (``.venv-vllm``, made by
``scripts/setup-vllm-venv``) on the test model of `tests.procs.vllm_engine` (random weights and
a word-per-token tokenizer), in a process group of its own, with its log in a file; `stop` ends
the whole group. Requests go through ``urllib`` as JSON, prompts as token ids, greedy, with the
chosen tokens' log-probabilities (`Completion`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support import ROOT, python_env
from tests.support.ports import reserve_port
from tests.support.prometheus import scrape

VLLM_VENVS = {"0.32": ROOT / ".venv-vllm", "0.31": ROOT / ".venv-vllm-0.31"}
"""The vLLM minors the connector supports, and where each one's venv is (both made by
``scripts/test``: ``scripts/setup-vllm-venv``). Every minor gets the interface checks (the hooks'
signatures, the configs, the paged cache views); `ENGINE_MINORS` the tests that run engines."""

ENGINE_MINORS = [
    m.strip() for m in os.environ.get("KVSIDECAR_VLLM_ENGINE_MINORS", "0.32").split(",") if m
]
"""The minors whose engines the real-engine modules start (``KVSIDECAR_VLLM_ENGINE_MINORS``,
comma-separated; default the newest, ``0.31,0.32`` for both): each minor costs those modules'
whole time again, and the suite runs within its 40 minutes on two cores with one."""


def vllm_venv_params(*, engines: bool = True) -> list[Any]:
    """`VLLM_VENVS` as pytest parameters, each skipped (saying why) where its venv is missing.

    ``engines``: only the `ENGINE_MINORS` (the tests start engines); else every minor.
    """
    import pytest

    unknown = sorted(set(ENGINE_MINORS) - set(VLLM_VENVS))
    if unknown:
        raise ValueError(f"KVSIDECAR_VLLM_ENGINE_MINORS names {unknown}: known {list(VLLM_VENVS)}")
    return [
        pytest.param(
            venv,
            id=f"vllm-{minor}",
            marks=pytest.mark.skipif(
                not (venv / "bin" / "vllm").exists(),
                reason=f"no {venv.name} (scripts/test makes it; KVSIDECAR_SKIP_VLLM=1 skips it)",
            ),
        )
        for minor, venv in VLLM_VENVS.items()
        if not engines or minor in ENGINE_MINORS
    ]


CONNECTOR = {
    "kv_connector": "KVSidecarConnector",
    "kv_connector_module_path": "kvsidecar.integrations.vllm",
}


def tokens(seed: int, n: int) -> list[int]:
    """A deterministic prompt of ``n`` token ids in 3..1002 (the model's vocabulary is 1024)."""
    return [(i * (2 * seed + 31) + 7 * seed + 11) % 1000 + 3 for i in range(n)]


def block_hashes(prompt: list[int], block_size: int = 32) -> list[bytes]:
    """vLLM's default (sha256) block hashes of a prompt's full blocks, computed independently.

    ``pickle`` only as vLLM's hash input is defined: nothing here is read from a socket.
    """
    parent = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
    out = []
    for start in range(0, len(prompt) - block_size + 1, block_size):
        block = tuple(prompt[start : start + block_size])
        parent = hashlib.sha256(pickle.dumps((parent, block, None), protocol=5)).digest()
        out.append(parent)
    return out


def make_model(venv: Path, directory: Path) -> None:
    """Write the test model (random weights, a tokenizer) with that venv's Python."""
    subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "tests.procs.vllm_engine",
            "--make-model",
            str(directory),
        ],
        cwd=ROOT,
        env=python_env(),
        check=True,
        timeout=120,
    )


@dataclass(frozen=True)
class Completion:
    """One greedy completion: its tokens, each one's log-probability, and the top choices."""

    tokens: list[int]
    logprobs: list[float]
    top: list[dict[int, float]]
    """Per position, the top log-probabilities by token."""
    body: dict[str, Any]
    """The whole response."""


def _token(text: str) -> int:
    return int(text.removeprefix("token_id:"))


LOGPROB_TOL = 0.05
"""Largest difference of a token's log-probability allowed between two engines taking the same
cache path. Measured here: at most 0.0007 with 24 requests in flight against one at a time
(bfloat16 rounds differently in other batches); 1.3 with four blocks of wrong contents loaded."""


def same_outputs(got: Completion, want: Completion, tol: float = LOGPROB_TOL) -> None:
    """The same tokens, and log-probabilities within ``tol``, position by position.

    A different token is allowed only where ``want`` had a near tie (its own top choices within
    ``tol`` of each other): then the two sequences part and nothing after is compared.
    """
    for i, (t, lp) in enumerate(zip(got.tokens, got.logprobs, strict=True)):
        if t != want.tokens[i]:
            alt = want.top[i].get(t)
            assert alt is not None and want.logprobs[i] - alt <= tol, (i, got.tokens, want.tokens)
            return
        assert abs(lp - want.logprobs[i]) <= tol, (i, lp, want.logprobs[i])


class VllmServer:
    """One ``vllm serve`` process group (see the module doc)."""

    def __init__(
        self,
        name: str,
        venv: Path,
        model: Path,
        log_dir: Path,
        *,
        kv_transfer_config: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        args: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.venv = venv
        self.model = str(model)
        self.port = reserve_port()
        self.log_path = log_dir / f"serve-{name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        cmd = [
            str(venv / "bin" / "vllm"),
            "serve",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "bfloat16",
            "--block-size",
            "32",
            "--max-model-len",
            "512",
            "--enforce-eager",
            "--seed",
            "0",
            *args,
        ]
        if kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        variables = {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            # vLLM leaves its ipc sockets in the temporary directory: the log folder's own.
            "TMPDIR": str(log_dir),
            **(env or {}),
        }
        self.proc = subprocess.Popen(
            cmd,
            cwd=log_dir,
            env=python_env(**variables),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def url(self) -> str:
        """The server's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        """Whether the server answers ``/health`` with 200."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                return resp.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def wait_ready(self, timeout: float = 420.0) -> None:
        """Wait until ``/health`` answers; fail with the log's tail if the server exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve {self.name} exited: {self.tail()}")
            if self.alive():
                return
            time.sleep(1.0)
        raise RuntimeError(f"vllm serve {self.name} not up in {timeout:.0f} s: {self.tail()}")

    def post(self, path: str, body: Any, timeout: float = 120.0) -> tuple[int, Any]:
        """POST JSON; return the status and the decoded answer (errors included)."""
        data = json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            text = err.read().decode(errors="replace")
            with contextlib.suppress(ValueError):
                return err.code, json.loads(text)
            return err.code, text

    def complete(
        self,
        prompt: list[int],
        *,
        max_tokens: int = 12,
        kv_transfer_params: Any = None,
        timeout: float = 120.0,
        **extra: Any,
    ) -> Completion:
        """A greedy completion of ``prompt`` (token ids); fails on anything but 200."""
        status, answer = self.completion(
            prompt,
            max_tokens=max_tokens,
            kv_transfer_params=kv_transfer_params,
            timeout=timeout,
            **extra,
        )
        assert status == 200, (status, answer, self.tail(30))
        choice = answer["choices"][0]
        lp = choice["logprobs"]
        return Completion(
            tokens=[_token(t) for t in lp["tokens"]],
            logprobs=[float(x) for x in lp["token_logprobs"]],
            top=[{_token(t): float(v) for t, v in top.items()} for top in lp["top_logprobs"]],
            body=answer,
        )

    def completion(
        self,
        prompt: Any,
        *,
        max_tokens: int = 12,
        kv_transfer_params: Any = None,
        timeout: float = 120.0,
        **extra: Any,
    ) -> tuple[int, Any]:
        """POST one ``/v1/completions`` request; return the status and the answer."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 5,
            "return_tokens_as_token_ids": True,
            **extra,
        }
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        return self.post("/v1/completions", body, timeout)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The server's ``/metrics``, ``{(name, sorted labels): value}``."""
        return scrape(self.port)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of ``/metrics``, summed over the labels not given (0 when absent)."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.metrics().items() if n == name and want <= set(ls))

    def worker_pids(self) -> list[int]:
        """The server's vLLM worker processes (titled ``VLLM::Worker``), found in /proc."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.getsid(int(entry.name)) != self.proc.pid:
                    continue
                title = (entry / "cmdline").read_bytes().split(b"\0")[0]
            except (OSError, ProcessLookupError):
                continue
            if title.startswith(b"VLLM::Worker"):
                pids.append(int(entry.name))
        return pids

    def bench_serve_command(
        self, out: Path, dataset: list[str], *, prompts: int, concurrency: int, seed: int
    ) -> list[str]:
        """``vllm bench serve`` (vLLM's own client) on this server: greedy, ``--ignore-eos``,
        every request's result saved to ``out``; ``dataset`` names the prompts and their sizes."""
        return [
            str(self.venv / "bin" / "vllm"),
            "bench",
            "serve",
            "--backend",
            "vllm",
            "--base-url",
            self.url,
            "--model",
            self.model,
            "--tokenizer",
            self.model,
            *dataset,
            "--num-prompts",
            str(prompts),
            "--max-concurrency",
            str(concurrency),
            "--ignore-eos",
            "--temperature",
            "0",
            "--seed",
            str(seed),
            "--save-result",
            "--save-detailed",
            "--result-dir",
            str(out.parent),
            "--result-filename",
            out.name,
            "--disable-tqdm",
        ]

    def tail(self, lines: int = 60) -> str:
        """The end of the server's log."""
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``timeout``; close the log."""
        for sig, wait in ((signal.SIGCONT, 0.0), (signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait)
        self._log.close()
