"""An engine worker that keeps moving its own blocks and logs every outcome (fault tests, soak).

Run as ``python -m tests.procs.fault_worker '<json spec>'``. It registers one engine rank in
shared memory (with host blocks), prints ``ready``, then loops until stdin closes or says
``exit``: one offload (device -> host) per iteration, each with a unique request id. Every
outcome is one JSON line on stdout: ``{"i": n, "ok": true, "s": latency}`` or
``{"i": n, "code": "<error code>", "s": latency}``; the test counts them, so nothing can be
silently dropped. With ``report`` in the spec it also reports each step's finished request to
the completion aggregation. A final ``{"done": n, "reconnects": r}`` line ends the run.

With ``verify`` in the spec each iteration checks the data element by element: it writes fresh
random values into ``batch`` blocks of the first half of its cache, offloads them to the host
pool, onboards them back into the second half, and counts the elements that differ from what it
wrote (``"bad"``); ``"s2"`` is the onboard's latency.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

import torch

from kvsidecar.client import SidecarClient
from kvsidecar.memory import allocate_kv_caches
from kvsidecar.wire.errors import SidecarError


def _wait_for_exit(stop: threading.Event) -> None:
    """Set ``stop`` at an ``exit`` line or the end of stdin (read on a thread: the loop moves)."""
    for line in sys.stdin:
        if line.strip() == "exit":
            break
    stop.set()


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    # One thread: eight of these share two cores, and torch's intra-op threads made each small
    # tensor operation of the verify mode cost ~0.1 s there (160 rounds/s -> 1).
    torch.set_num_threads(1)
    blocks = spec.get("blocks", 64)
    shape = (2, blocks, spec.get("block_size", 16), spec.get("heads", 4), spec.get("head_size", 64))
    caches = allocate_kv_caches(spec.get("layers", 2), shape, torch.float16)
    for i, c in enumerate(caches):
        c.copy_(torch.full(shape, float(i + 1)))
    client = SidecarClient(spec["endpoint"], timeout_s=spec.get("timeout_s", 5.0))
    rank, tp = spec.get("tp_rank", 0), spec.get("tp_size", 1)
    client.register_kv_caches(
        {f"l{i}": c for i, c in enumerate(caches)},
        engine_id=spec["engine"],
        tp_rank=rank,
        tp_size=tp,
        host_blocks=blocks,
    )
    print("ready", flush=True)
    stop = threading.Event()
    threading.Thread(target=_wait_for_exit, args=(stop,), daemon=True).start()
    n, batch, pause = 0, spec.get("batch", 8), spec.get("pause_s", 0.0)
    step = 0
    while not stop.is_set():
        if spec.get("verify"):
            out = _verified_round(client, caches, n, batch, blocks // 2, seed=rank)
        else:
            src = [(n * batch + k) % blocks for k in range(batch)]
            t0 = time.perf_counter()
            out = {"i": n, "t": time.time()}
            try:
                client.offload(client.worker, src, src)
                out["ok"] = True
            except SidecarError as exc:
                out["code"] = exc.code
            out["s"] = time.perf_counter() - t0
        if spec.get("report") and "ok" in out:
            if not _report(client, step, out, stop):
                print(json.dumps(out), flush=True)
                n += 1
                break
            step += 1
        print(json.dumps(out), flush=True)
        n += 1
        if pause:
            time.sleep(pause)
    print(json.dumps({"done": n, "reconnects": client.reconnects}), flush=True)
    client.close()


def _report(client: SidecarClient, step: int, out: dict[str, Any], stop: threading.Event) -> bool:
    """Report ``step`` as finishing request ``req<step>``; wait and retry while ``busy``.

    ``busy`` is flow control (the scheduler has not collected enough steps yet), not a failure:
    a worker that runs ahead of its scheduler is held back here, as an engine's would be. False
    when asked to exit meanwhile (the step then counts as never reported).
    """
    while True:
        t1 = time.perf_counter()  # the round trip of the attempt that succeeds
        try:
            client.report(step, finished_sending={f"req{step}"})
            out["report_s"] = time.perf_counter() - t1
            break
        except SidecarError as exc:
            if exc.code != "busy":
                out["report_code"] = exc.code
                break
            out["report_busy"] = out.get("report_busy", 0) + 1
            if stop.wait(0.01):  # exit asked (or EOF)
                return False
    out["step"] = step
    return True


def _verified_round(
    client: SidecarClient, caches: list[torch.Tensor], n: int, batch: int, half: int, seed: int
) -> dict[str, Any]:
    """Device -> host -> device through the daemon, checked against what was written."""
    src = [(n * batch + k) % half for k in range(batch)]
    dst = [half + b for b in src]
    gen = torch.Generator().manual_seed(seed * 1_000_003 + n)
    want = []
    for c in caches:  # kv_first (2, B, N, H, C): blocks are dim 1
        fresh = torch.randn(c[:, src].shape, generator=gen).to(c.dtype)
        c[:, src] = fresh
        want.append(fresh)
    out: dict[str, Any] = {"i": n, "t": time.time()}
    t0 = time.perf_counter()
    try:
        client.offload(client.worker, src, src)
        t1 = time.perf_counter()
        out["s"] = t1 - t0
        client.onboard(client.worker, src, dst)
        out["s2"] = time.perf_counter() - t1
        out["ok"] = True
        out["bad"] = sum(int((c[:, dst] != w).sum()) for c, w in zip(caches, want, strict=True))
    except SidecarError as exc:
        out["code"] = exc.code
        out.setdefault("s", time.perf_counter() - t0)
    return out


if __name__ == "__main__":
    main()
