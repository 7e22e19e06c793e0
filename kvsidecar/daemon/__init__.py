"""The server: one daemon per node, its control socket and everything behind it.

- `server`: lifecycle (config -> startup -> serve -> shutdown) and the services it composes;
  `state`: what those services share.
- `control`: the control socket (read, check and authorize each request once, send every reply);
  `dispatch`: the `Router`, which handler answers a checked request, and ``status``.
- `registration`: hello, register, unregister, heartbeat, grant; leases and worker release.
- `moves`: moves, batches, layout fixes, host blocks; `runner`: a checked job run and answered.
- `logs`: logging set-up; `runtime_dir`: one daemon per private directory; `gpu`: the CUDA check.
- `limits`: who may do what (`access`), how much may queue (`admission`), connections.
- `completions`: per-engine aggregation of workers' reports (``report`` / ``collect``).
- `cache`: the shared prefix cache and the connectors' completion events.
- `metrics`: Prometheus, health probes; `sdnotify`: systemd's notify protocol.

What the peer service shares with it (config, registry, jobs, executor, auth) is `kvsidecar.node`.
``python -m kvsidecar.daemon`` serves with settings from ``KVSIDECAR_*`` (``__main__``).
"""
