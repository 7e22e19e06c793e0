"""An engine worker for aggregation tests: registers a small KV cache, then reports steps.

Run as ``python -m tests.procs.report_worker '<json spec>'`` (spec: ``endpoint``, ``engine``,
``tp_rank``, ``tp_size``, ``host_blocks``). Prints ``ready``, then obeys one JSON command per
stdin line and answers each with one JSON line:

- ``{"steps": [s, ...], "reports": {s: {...}}, "copies": n}``: send the report of each listed
  step, in the listed order (so a test can reorder them), each ``copies`` times (duplicates).
  A report refused with ``step_collected`` is carried into the next report this worker sends
  (as an engine worker must); answers ``{"duplicates": d, "carried": c}``.
- ``{"move": "offload"|"onboard", "ids": [block ids], "request_ids": [...]}``: move those blocks
  to (or from) the same ids of the host mirror, with the request ids attached (the daemon credits
  the completion); answers ``{"nbytes": bytes moved}``.
- ``{"exit": true}`` (or EOF): close the client and exit.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from kvsidecar.client import SidecarClient
from kvsidecar.memory import allocate_kv_caches
from kvsidecar.wire.errors import SidecarError

CACHE_SHAPE = (2, 16, 16, 2, 64)
"""Every layer's (K/V, blocks, tokens per block, heads, head size), in float16."""

_KEYS = ("finished_sending", "finished_recving", "failed_recving", "invalid_block_ids")


def main() -> None:
    spec = json.loads(sys.argv[1])
    caches = allocate_kv_caches(spec.get("layers", 1), CACHE_SHAPE, torch.float16)
    client = SidecarClient(spec["endpoint"], timeout_s=10)
    client.register_kv_caches(
        {f"layer{i}": c for i, c in enumerate(caches)},
        engine_id=spec["engine"],
        tp_rank=spec["tp_rank"],
        tp_size=spec["tp_size"],
        host_blocks=spec.get("host_blocks", 0),
    )
    print("ready", flush=True)
    carry: dict[str, set[Any]] = {k: set() for k in _KEYS}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("exit"):
            break
        if "move" in cmd:
            ids = cmd["ids"]
            go = client.offload if cmd["move"] == "offload" else client.onboard
            moved = go(client.worker, ids, ids, request_ids=cmd.get("request_ids", ()))
            print(json.dumps({"nbytes": moved.nbytes}), flush=True)
            continue
        duplicates = carried = 0
        for step in cmd["steps"]:
            body = cmd["reports"].get(str(step), {})
            fields = {k: set(body.get(k, ())) | carry[k] for k in _KEYS}
            for _ in range(cmd.get("copies", 1)):
                try:
                    reply = client.report(step, **fields)
                except SidecarError as exc:
                    if exc.code != "step_collected":
                        raise
                    carry = fields
                    carried += 1
                    break
                carry = {k: set() for k in _KEYS}
                duplicates += reply.duplicate
        print(json.dumps({"duplicates": duplicates, "carried": carried}), flush=True)
    client.close()


if __name__ == "__main__":
    main()
