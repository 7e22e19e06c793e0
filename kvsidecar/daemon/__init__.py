"""The server: one daemon per node, its settings, its control socket and everything behind it.

- `server`: lifecycle (config -> startup -> serve -> shutdown), the ROUTER edge, dispatch.
- `config`: the settings table and the frozen `Config`; `logs`: logging set-up.
- `registration`: hello, register, unregister, heartbeat, grant; leases and worker release.
- `commands`: moves, layout fixes, host blocks, status; `jobs` validates a move into a job.
- `executor`: the copy threads; `registry`: what the daemon holds (engines, workers, buffers).
- `access`, `auth`, `admission`: who may do what, who may connect, how much may queue.
- `completions`: per-engine aggregation of workers' reports (``report`` / ``collect``).
- `metrics`, `observability`, `sdnotify`: Prometheus, health probes, systemd's notify protocol.

``python -m kvsidecar.daemon`` serves with settings from ``KVSIDECAR_*`` (``__main__``).
"""
