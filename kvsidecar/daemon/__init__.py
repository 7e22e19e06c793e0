"""The server: one daemon per node, its control socket and everything behind it.

- `server`: lifecycle (config -> startup -> serve -> shutdown), the ROUTER edge, dispatch.
- `logs`: logging set-up; `runtime_dir`: one daemon per private directory.
- `registration`: hello, register, unregister, heartbeat, grant; leases and worker release.
- `commands`: moves, layout fixes, host blocks, status; `short_moves`: short moves in one step.
- `limits`: who may do what (`access`), how much may queue (`admission`), connections.
- `completions`: per-engine aggregation of workers' reports (``report`` / ``collect``).
- `cache`: the shared prefix cache and the connectors' completion events.
- `metrics`: Prometheus, health probes; `sdnotify`: systemd's notify protocol.

What the peer service shares with it (config, registry, jobs, executor, auth) is `kvsidecar.node`.
``python -m kvsidecar.daemon`` serves with settings from ``KVSIDECAR_*`` (``__main__``).
"""
