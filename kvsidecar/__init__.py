"""kvsidecar: a per-node daemon that moves KV-cache blocks for LLM inference engines."""

__version__ = "0.1.0"
