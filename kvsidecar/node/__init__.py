"""What the daemon and the peer service both build on: one node's state, settings and copies.

- `settings`: the one settings table; `config`: the frozen `Config` built from it.
- `registry`: what the node holds (engines, workers, buffer sets, the host pool).
- `jobs`: a move's ids checked and planned into a job; `batch`: a ``move_batch``, item by item.
- `executor`: the copy threads, claims in arrival order; `copy_events`: a copy's CUDA events.
- `auth`: who may connect (CURVE keys, peer uids, the ZAP handler), for both endpoints.
- `replies`: the bound on bytes of large replies not yet read; `identity`: the daemon's id.

May import `kvsidecar.core`, `kvsidecar.wire` and `kvsidecar.memory`; never the daemon or the peer.
"""
