"""``kvsidecar bench``: the daemon measured against what an engine would otherwise do.

Each kind is a small module with ``run(options) -> list[Figure]``; every figure is timed in the
same run as its baseline (naive ``index_copy_``, the in-process coalesced copy, numpy memcpy, raw
pyzmq echo and stream, raw NIXL where installed). `kvsidecar.bench.cli` builds the options from
the command line, prints the table and writes the JSON and charts. See docs/benchmarks.md.
"""
