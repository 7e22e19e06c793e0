"""Node-to-node KV transfer: one daemon pulls a request's blocks from another node's daemon.

- `messages`: the peer wire protocol (its own tagged union, on its own socket).
- `handshake`: what a daemon tells its peers about its engines, and the compatibility check.
- `plan`: which remote ranks and byte ranges land where (TP mismatch, block size, MLA, DCP).
- `planes`: the `DataPlane` interface; `zmq_plane` (built in) and `nixl_plane` (NIXL READ).
- `service`: `PeerService`, wired into the daemon: peer endpoint, links, handshake answer,
  completion events.
- `pull`: the consumer side, one pull from its checks to its completion event; `context`: what
  a pull needs of the service (`PullContext`), and the data planes with the NIXL agent.
- `producer`: the producer side: publish, leases, reads served on the ZMQ plane.

Built on `kvsidecar.node` (config, registry, executor, auth), `core`, `wire` and `memory`; the
daemon hands it those parts and never the reverse: nothing here imports `kvsidecar.daemon`.
"""
