"""``kvsidecar demo``: the daemon with a small disaggregated workload, every byte checked.

The demo starts a daemon process and four engine-worker processes, as a node would run them:

- ``prefill``: TP 2, HND memory order, 16-token blocks (the layout NIXL-style senders prefer);
- ``decode``: TP 2, NHD memory order, 32-token blocks.

Each worker allocates its KV cache in shared memory with the package's allocator, fills it with
values derived from a seed, and registers it with the daemon. The demo (acting as both engines'
schedulers) then runs rounds of offload (worker -> host pool), onboard (host pool -> worker) and
engine-to-engine moves (prefill rank r -> decode rank r, which needs both an HND -> NHD permute
and a 16 -> 32 block-size remap on the destination). After each move the worker that owns the
destination recomputes what those blocks must hold from the seeds alone and compares every
element. The exit code is non-zero if any element differs or any command fails.

Workers are driven over their stdin/stdout with one JSON document per line, so the demo needs no
second control plane beside the daemon's.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np
import torch

from kvsidecar.wire.errors import SidecarError

HEADS = 8
HEAD_SIZE = 64
TP = 2
PREFILL_BLOCK = 16
DECODE_BLOCK = 32
DTYPE = torch.float16

# Used by both sides: the orchestrator and the workers derive every value from names alone.


def engine_shape(engine: str, blocks: int) -> tuple[int, int, int, int, int]:
    """Return the kv_first logical shape ``(2, B, N, H, C)`` of one layer of one ``engine`` rank."""
    if engine == "prefill":
        return (2, blocks, PREFILL_BLOCK, HEADS // TP, HEAD_SIZE)
    return (2, blocks // (DECODE_BLOCK // PREFILL_BLOCK), DECODE_BLOCK, HEADS // TP, HEAD_SIZE)


def seeded_layer(engine: str, rank: int, layer: int, blocks: int) -> torch.Tensor:
    """Return the initial logical values of one layer: a function of names and numbers alone."""
    seed = (0 if engine == "prefill" else 1) * 1_000_000 + rank * 1000 + layer
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(engine_shape(engine, blocks), generator=gen).to(DTYPE)


class _Worker:
    """One engine worker: owns a KV cache in shared memory and checks what lands in it."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from kvsidecar.client import SidecarClient
        from kvsidecar.memory import allocate_kv_caches

        self.engine: str = spec["engine"]
        self.rank: int = spec["rank"]
        self.layers: int = spec["layers"]
        self.blocks: int = spec["blocks"]
        self.order: str = "HND" if self.engine == "prefill" else "NHD"
        shape = list(engine_shape(self.engine, self.blocks))
        if self.order == "HND":
            shape[2], shape[3] = shape[3], shape[2]  # memory (2, B, H, N, C)
        self.caches = allocate_kv_caches(self.layers, shape, DTYPE)
        # Expected logical contents, kept in private memory: the reference the checks compare to.
        self.expected = [
            seeded_layer(self.engine, self.rank, i, self.blocks) for i in range(self.layers)
        ]
        for cache, values in zip(self.caches, self.expected, strict=True):
            self.logical(cache).copy_(values)
        self.client = SidecarClient(spec["endpoint"], timeout_s=30, name=f"demo-{self.engine}")
        self.ref = self.client.register_kv_caches(
            {f"layer{i}": c for i, c in enumerate(self.caches)},
            engine_id=self.engine,
            tp_rank=self.rank,
            tp_size=TP,
            memory_order=self.order,  # type: ignore[arg-type]
            shape_order="HN" if self.order == "HND" else "NH",
            host_blocks=spec["host_blocks"],
        ).worker
        if self.engine == "decode":
            # Prefill workers write into decode's blocks: decode's owner must allow it.
            self.client.grant("prefill", read=False, write=True)

    def logical(self, cache: torch.Tensor) -> torch.Tensor:
        """Return the (2, B, N, H, C) view of a cache in this worker's memory order."""
        return cache.transpose(2, 3) if self.order == "HND" else cache

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "offload_onboard":
            return self._offload_onboard(cmd)
        if op == "send":
            return self._send(cmd)
        if op == "check_recv":
            return self._check_recv(cmd)
        raise ValueError(f"unknown op {op!r}")

    def _offload_onboard(self, cmd: dict[str, Any]) -> dict[str, Any]:
        src = np.asarray(cmd["device_ids"], dtype=np.int64)
        host = np.asarray(cmd["host_ids"], dtype=np.int64)
        dst = np.asarray(cmd["onboard_ids"], dtype=np.int64)
        moved = self.client.offload(self.ref, src, host)
        # Clobber the destination blocks first so that a move that did nothing cannot pass.
        for cache in self.caches:
            self.logical(cache)[:, torch.from_numpy(dst)] = 0
        back = self.client.onboard(self.ref, host, dst)
        bad = 0
        for cache, values in zip(self.caches, self.expected, strict=True):
            got = self.logical(cache)[:, torch.from_numpy(dst)]
            want = values[:, torch.from_numpy(src)]
            bad += int((got.view(torch.int16) != want.view(torch.int16)).sum())
            values[:, torch.from_numpy(dst)] = want  # the reference follows the move
        return {
            "bytes": moved.nbytes + back.nbytes,
            "seconds": moved.seconds + back.seconds,
            "moves": 2,
            "mismatches": bad,
        }

    def _send(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from kvsidecar.wire.types import BufferSetRef, WorkerRef

        dst = BufferSetRef(WorkerRef("decode", tp_rank=self.rank))
        moved = self.client.move(
            BufferSetRef(self.ref),
            dst,
            np.asarray(cmd["src_ids"], dtype=np.int64),
            np.asarray(cmd["dst_ids"], dtype=np.int64),
        )
        return {"bytes": moved.nbytes, "seconds": moved.seconds, "moves": 1, "fixed": moved.fixed}

    def _check_recv(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Compare received blocks with the prefill rank's seeded values, token by token."""
        src = cmd["src_ids"]
        dst = cmd["dst_ids"]
        ratio = DECODE_BLOCK // PREFILL_BLOCK
        bad = 0
        for layer, cache in enumerate(self.caches):
            remote = seeded_layer("prefill", self.rank, layer, cmd["prefill_blocks"])
            remote = _prefill_state(remote, cmd["prefill_history"], layer)
            got = self.logical(cache)
            for j, d in enumerate(dst):
                # Local block d holds remote blocks src[ratio*j : ratio*j + ratio] in token order.
                want = torch.cat([remote[:, s] for s in src[ratio * j : ratio * j + ratio]], dim=1)
                bad += int((got[:, d].view(torch.int16) != want.view(torch.int16)).sum())
                self.expected[layer][:, d] = want
        return {"mismatches": bad}


def _prefill_state(
    values: torch.Tensor, history: list[list[list[int]]], layer: int
) -> torch.Tensor:
    """Replay the prefill rank's onboard moves (``[src, dst]`` pairs) on its seeded values."""
    del layer
    for src, dst in history:
        values[:, dst] = values[:, src]
    return values


def worker_main(spec_json: str) -> int:
    """Entry point of a demo worker process: register, then serve JSON commands from stdin."""
    worker = _Worker(json.loads(spec_json))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        try:
            reply = worker.handle(cmd)
        except SidecarError as exc:
            reply = {"error": exc.code, "message": exc.message}
        print(json.dumps(reply), flush=True)
    worker.client.close()
    return 0


# The orchestrator: starts the daemon and the workers, and drives them.


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[str]

    def call(self, cmd: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps(cmd) + "\n")
        self.popen.stdin.flush()
        return self.read(timeout)

    def read(self, timeout: float) -> dict[str, Any]:
        assert self.popen.stdout is not None
        line = _readline(self.popen.stdout, timeout)
        if not line:
            raise RuntimeError(f"{self.name} exited (code {self.popen.poll()}) without a reply")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.name}: {reply['error']}: {reply.get('message')}")
        return reply


def _readline(stream: IO[str], timeout: float) -> str:
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"no reply within {timeout} s")
    return stream.readline()


@dataclass
class _Totals:
    moves: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    mismatches: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, reply: dict[str, Any]) -> None:
        self.moves += int(reply.get("moves", 0))
        self.nbytes += int(reply.get("bytes", 0))
        self.seconds += float(reply.get("seconds", 0.0))
        self.mismatches += int(reply.get("mismatches", 0))
        self.by_kind[kind] = self.by_kind.get(kind, 0) + int(reply.get("moves", 0))


@contextlib.contextmanager
def _daemon(runtime_dir: str, pool_bytes: int) -> Iterator[str]:
    """Run ``kvsidecar serve`` as a child process; yield its endpoint; stop it with SIGTERM."""
    from kvsidecar.client import SidecarClient

    endpoint = f"ipc://{runtime_dir}/control.sock"
    env = dict(os.environ, KVSIDECAR_RUNTIME_DIR=runtime_dir, KVSIDECAR_ENDPOINT=endpoint)
    # A throwaway daemon: any free metrics port, never a node daemon's configured one.
    env["KVSIDECAR_METRICS_PORT"] = "0"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvsidecar.cli",
            "serve",
            f"--host-pool-bytes={pool_bytes}",
            "--log-level=warning",
        ],
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with code {proc.returncode}")
            try:
                with SidecarClient(endpoint, timeout_s=1.0, name="demo-probe"):
                    break
            except SidecarError:
                if time.monotonic() > deadline:
                    raise
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"the daemon exited with code {proc.returncode} on SIGTERM")


def run_demo(*, layers: int = 8, blocks: int = 512, rounds: int = 3) -> int:
    """Run the demo; print a summary; return 0 when every byte checked out, else 1."""
    from kvsidecar.client import SidecarClient

    if blocks % (DECODE_BLOCK // PREFILL_BLOCK) or blocks < 64:
        print("kvsidecar demo: --blocks must be even and >= 64", file=sys.stderr)
        return 2
    rng = np.random.default_rng(2026)
    host_blocks = blocks // 2
    per_worker = layers * int(np.prod(engine_shape("prefill", blocks))) * 2
    # Host mirrors: two prefill ranks of host_blocks blocks, two decode ranks of blocks twice as
    # large (6 prefill-block units per host block), plus room for alignment.
    pool_bytes = 6 * host_blocks * (per_worker // blocks) + (64 << 20)
    totals = _Totals()
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="kvsd-") as runtime_dir,
        _daemon(runtime_dir, pool_bytes) as endpoint,
    ):
        procs: dict[tuple[str, int], _Proc] = {}
        try:
            for engine in ("prefill", "decode"):
                for rank in range(TP):
                    spec = {
                        "engine": engine,
                        "rank": rank,
                        "layers": layers,
                        "blocks": blocks,
                        "host_blocks": host_blocks,
                        "endpoint": endpoint,
                    }
                    popen = subprocess.Popen(
                        [sys.executable, "-m", "kvsidecar.demo", json.dumps(spec)],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                    procs[engine, rank] = _Proc(f"{engine}[{rank}]", popen)
            for proc in procs.values():
                proc.read(timeout=120)
            with SidecarClient(endpoint, timeout_s=30, name="demo-scheduler") as scheduler:
                history: dict[int, list[list[list[int]]]] = {r: [] for r in range(TP)}
                for _ in range(rounds):
                    _round(scheduler, procs, rng, blocks, host_blocks, history, totals)
                status = scheduler.status()
        finally:
            for proc in procs.values():
                with contextlib.suppress(Exception):
                    proc.call({"op": "exit"}, timeout=1)
            for proc in procs.values():
                try:
                    proc.popen.wait(30)
                except subprocess.TimeoutExpired:
                    proc.popen.kill()
    elapsed = time.monotonic() - started
    gib = totals.nbytes / 2**30
    rate = totals.nbytes / totals.seconds / 1e9 if totals.seconds else 0.0
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(totals.by_kind.items()))
    print(
        f"kvsidecar demo: {len(procs)} workers (prefill TP{TP} HND/{PREFILL_BLOCK}-token blocks, "
        f"decode TP{TP} NHD/{DECODE_BLOCK}-token blocks), {layers} layers, {blocks} blocks"
    )
    print(f"  moves: {totals.moves} ({kinds}); daemon errors: {status.moves_failed_total}")
    print(f"  moved: {gib:.2f} GiB in {totals.seconds:.2f} s of copy time = {rate:.2f} GB/s")
    print(f"  checked every element: {totals.mismatches} mismatches; wall time {elapsed:.1f} s")
    ok = totals.mismatches == 0 and status.moves_failed_total == 0
    print("  result: OK" if ok else "  result: FAILED")
    return 0 if ok else 1


def _round(  # noqa: PLR0917 - private, called once
    scheduler: Any,
    procs: dict[tuple[str, int], _Proc],
    rng: np.random.Generator,
    blocks: int,
    host_blocks: int,
    history: dict[int, list[list[list[int]]]],
    totals: _Totals,
) -> None:
    """One round: offload+onboard on every worker, then prefill -> decode on every rank."""
    n = blocks // 8
    for engine in ("prefill", "decode"):
        engine_blocks = blocks if engine == "prefill" else blocks // 2
        host_ids = scheduler.host_alloc(engine, n)
        for rank in range(TP):
            src = rng.choice(engine_blocks, n, replace=False)
            dst = rng.choice(engine_blocks, n, replace=False)
            reply = procs[engine, rank].call(
                {
                    "op": "offload_onboard",
                    "device_ids": src.tolist(),
                    "host_ids": host_ids.tolist(),
                    "onboard_ids": dst.tolist(),
                }
            )
            totals.add("offload+onboard", reply)
            if engine == "prefill":
                history[rank].append([src.tolist(), dst.tolist()])
        scheduler.host_free(engine, host_ids)
    ratio = DECODE_BLOCK // PREFILL_BLOCK
    for rank in range(TP):
        dst = rng.choice(blocks // ratio, n // ratio, replace=False)
        src = rng.choice(blocks, len(dst) * ratio, replace=False)
        reply = procs["prefill", rank].call(
            {"op": "send", "src_ids": src.tolist(), "dst_ids": dst.tolist()}
        )
        totals.add("prefill->decode", reply)
        check = procs["decode", rank].call(
            {
                "op": "check_recv",
                "src_ids": src.tolist(),
                "dst_ids": dst.tolist(),
                "prefill_blocks": blocks,
                "prefill_history": history[rank],
            }
        )
        totals.add("prefill->decode", check)


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1]))
