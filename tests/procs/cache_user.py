"""An engine worker of another uid: what may it see of, or take from, this uid's engines?

Run as root: ``python -m tests.procs.cache_user '<json spec>'``. It allocates its KV caches and
imports everything first, drops to ``spec["uid"]``, registers as engine ``spec["engine"]``, then
answers, as one JSON line: how many of ``spec["keys"]`` (hex) its lookup of
``spec["fingerprint"]`` hits, what storing ``spec["store_keys"]`` there says, and what a local
pull from engine ``spec["pull_from"]`` of request ``spec["request"]`` gives (an error code, or
the pull's outcome).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

from kvsidecar.client import SidecarClient, SidecarError
from kvsidecar.memory import allocate_kv_caches


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    caches = allocate_kv_caches(2, (2, 16, 4, 2, 8), torch.float32)
    os.setgroups([])
    os.setgid(spec["uid"])
    os.setuid(spec["uid"])
    out: dict[str, Any] = {"uid": os.getuid()}
    fp = spec["fingerprint"]
    with SidecarClient(spec["endpoint"], heartbeat=False) as client:
        client.register_kv_caches(
            {f"layer{i}": t for i, t in enumerate(caches)}, engine_id=spec["engine"]
        )
        keys = [bytes.fromhex(k) for k in spec["keys"]]
        out["hits"] = client.cache_lookup(fp, keys).hits
        store = [bytes.fromhex(k) for k in spec["store_keys"]]
        ids = list(range(len(store)))
        stored = client.submit_cache_store(fp, store, ids, capacity_bytes=1 << 20).result()
        out["stored"] = stored.stored
        try:
            pulled = client.submit_pull(
                spec["engine"],
                "",
                spec["pull_from"],
                {spec["request"]: ([1], [1])},
                tp_rank=0,
            ).result()
            out["pull"] = {"finished": pulled.finished, "failed": pulled.failed}
        except SidecarError as exc:
            out["pull"] = exc.code
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
