"""What a cached block's key means, and whether it means the same in every process.

A block is cached under vLLM's block hash (the hash of its tokens and of every token before it)
in a daemon namespace named by a **fingerprint**: the digest of everything else that must be
equal for two engines' blocks to be interchangeable. Both of vLLM's processes compute it from
the same config, so the scheduler's lookups and the workers' stores name the same namespace.

vLLM's default block hash (``sha256``, also ``sha256_cbor``) is seeded with a constant, so it is
the same in every process: blocks computed by one engine are found by the next. ``xxhash`` and
``xxhash_cbor`` are seeded from ``PYTHONHASHSEED`` or, when that is unset, from random bytes per
process: then no other process could ever find a block, and `shareable_hashes` says so (the
connector turns its prefix cache off with a warning rather than fill the daemon with blocks
nobody can hit).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping

PER_PROCESS_ALGOS = ("xxhash", "xxhash_cbor")
"""Hash algorithms vLLM seeds per process unless ``PYTHONHASHSEED`` is set."""


@dataclasses.dataclass(frozen=True)
class CacheFacts:
    """What must be equal for blocks to be shared (read from vLLM's config, see the module doc)."""

    model: str
    revision: str
    dtype: str
    cache_dtype: str
    block_size: int
    kv_cache_layout: str
    num_kv_heads: int
    """Per TP rank."""
    head_size: int
    num_layers: int
    tp_size: int
    hash_algo: str
    device: str
    weights: str = ""
    """Digest of the rest that changes a block's bytes: the model's whole configuration (with
    ``hf_overrides``), quantization, implementation, KV-scale settings, vLLM's version."""

    def model_hash(self) -> str:
        """Return what engines must share to exchange blocks at all (`Register.model_hash`).

        Block size, layout and TP size may differ between a prefill and a decode engine (the
        daemon adapts); the model, its dtypes and its KV heads may not.
        """
        heads = self.num_kv_heads * self.tp_size
        facts = [self.model, self.revision, self.dtype, self.cache_dtype, self.num_layers, heads]
        facts.extend((self.head_size, self.weights))
        return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:32]

    def fingerprint(self) -> str:
        """Return the namespace name: ``<short model name>-<32 hex digits of every fact>``."""
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        digest = hashlib.sha256(text.encode()).hexdigest()[:32]
        short = self.model.rstrip("/").rsplit("/", 1)[-1][:48] or "model"
        return f"{short}-{digest}"


def shareable_hashes(hash_algo: str, environ: Mapping[str, str]) -> str | None:
    """Return why block hashes differ between processes (None when they do not)."""
    if hash_algo in PER_PROCESS_ALGOS and environ.get("PYTHONHASHSEED") is None:
        return (
            f"prefix_caching_hash_algo={hash_algo!r} is seeded per process unless PYTHONHASHSEED "
            "is set: no other engine could find a stored block. Set PYTHONHASHSEED to the same "
            "value for every engine, or use the default sha256."
        )
    return None
