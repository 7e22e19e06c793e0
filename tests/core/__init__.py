"""kvsidecar.core's pure semantics (layout, fixes, mover, topology, aggregator) by models."""
