"""An engine worker that keeps moving its own blocks and logs every outcome (fault tests, soak).

Run as ``python -m tests.helpers.fault_worker '<json spec>'``. It registers one engine rank in
shared memory (with host blocks), prints ``ready``, then loops until stdin closes or says
``exit``: one offload (device -> host) per iteration, each with a unique request id. Every
outcome is one JSON line on stdout: ``{"i": n, "ok": true, "s": latency}`` or
``{"i": n, "code": "<error code>", "s": latency}``; the test counts them, so nothing can be
silently dropped. With ``report`` in the spec it also reports each step's finished request to
the completion aggregation. A final ``{"done": n, "reconnects": r}`` line ends the run.
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
        src = [(n * batch + k) % blocks for k in range(batch)]
        t0 = time.perf_counter()
        out: dict[str, Any] = {"i": n, "t": time.time()}
        try:
            client.offload(client.worker, src, src)
            out["ok"] = True
        except SidecarError as exc:
            out["code"] = exc.code
        out["s"] = time.perf_counter() - t0
        if spec.get("report") and "ok" in out:
            t1 = time.perf_counter()
            try:
                client.report(step, finished_sending={f"req{step}"})
                out["report_s"] = time.perf_counter() - t1
            except SidecarError as exc:
                out["report_code"] = exc.code
            out["step"] = step
            step += 1
        print(json.dumps(out), flush=True)
        n += 1
        if pause:
            time.sleep(pause)
    print(json.dumps({"done": n, "reconnects": client.reconnects}), flush=True)
    client.close()


if __name__ == "__main__":
    main()
