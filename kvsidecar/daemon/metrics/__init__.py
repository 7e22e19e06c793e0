"""The daemon's metrics and health probes, on an injected Prometheus registry.

- `families`: `DaemonMetrics`, the metric families and their label values.
- `tally`: the hot-path counters and histograms, kept as numbers and built at each scrape.
- `state`: the gauges read from the daemon's live state at scrape time.
- `cache`: the prefix cache's metrics; `server`: the HTTP endpoint (``/metrics``, probes).
- `observability`: the daemon's side of them (what a move records, readiness, the snapshot).
"""
