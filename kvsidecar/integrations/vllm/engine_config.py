"""What the connector reads from vLLM's configuration, once, when an engine starts.

`cache_facts` gathers what names the namespace of the engine's blocks
(`kvsidecar.integrations.vllm.keys.CacheFacts`); `check_supported` refuses what the connector
cannot do right, with the reason. Plain attribute reads of vLLM's config objects: nothing here
imports vLLM (`kvsidecar.integrations.vllm.connector` passes what it needs).
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from kvsidecar.integrations.vllm.keys import CacheFacts
from kvsidecar.integrations.vllm.settings import SettingsError

# A child of vLLM's logger: what the connector says shows in the engine's own log, formatted alike.
log = logging.getLogger("vllm.kvsidecar")


def cache_facts(vllm_config: Any, vllm_version: str) -> CacheFacts:
    """Read what names the namespace from vLLM's config (`CacheFacts`)."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    parallel = vllm_config.parallel_config
    return CacheFacts(
        model=str(model.model),
        revision=str(model.revision or ""),
        dtype=str(model.dtype),
        cache_dtype=str(cache.cache_dtype),
        block_size=int(cache.block_size),
        kv_cache_layout=str(getattr(cache, "kv_cache_layout", "") or ""),
        num_kv_heads=int(model.get_num_kv_heads(parallel)),
        head_size=int(model.get_head_size()),
        num_layers=int(model.get_num_layers(parallel)),
        tp_size=int(parallel.tensor_parallel_size),
        hash_algo=str(cache.prefix_caching_hash_algo),
        device=str(getattr(vllm_config.device_config, "device_type", "")),
        weights=_weights_digest(vllm_config, vllm_version),
    )


def _weights_digest(vllm_config: Any, vllm_version: str) -> str:
    """Digest of the settings beyond the model's name that change what its KV blocks hold.

    The model's whole configuration (architecture, RoPE scaling, sliding windows ...) with
    ``hf_overrides`` applied, its quantization and implementation, the cache's skipped layers
    and KV-scale settings, and vLLM's version (kernels change the bytes they write).
    """
    model, cache = vllm_config.model_config, vllm_config.cache_config
    try:
        hf_config = model.hf_config.to_json_string(use_diff=False)
    except Exception:  # a config that does not serialise: its repr still tells them apart
        hf_config = repr(model.hf_config)
    facts = [
        hf_config,
        str(getattr(model, "quantization", None)),
        repr(getattr(model, "hf_overrides", None)),
        str(getattr(model, "model_impl", "")),
        str(getattr(model, "code_revision", None)),
        repr(getattr(cache, "kv_cache_dtype_skip_layers", None)),
        repr(getattr(cache, "calculate_kv_scales", None)),
        vllm_version,
    ]
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:32]


def _sliding_window(model: Any) -> int:
    """Return the model's attention window (0: none), from its config as vLLM read it."""
    try:
        window = model.get_sliding_window()
    except Exception:  # a vLLM without it: the HF config says
        window = getattr(model.hf_text_config, "sliding_window", None)
    return int(window or 0)


def check_supported(vllm_config: Any) -> None:
    """Refuse at start what the connector cannot do right: `SettingsError` says why.

    Pipeline parallelism and decode context parallelism (one rank does not hold a block's
    every layer, or every token), sleep mode (it remaps the cache the daemon mapped), hybrid
    models with SSM layers (their state is no KV block), and a prefix cache for models vLLM
    does not cache prefixes of (non-causal attention: a block's KV depends on tokens after it).
    Sliding-window models are served, with a warning: vLLM turns its hybrid KV-cache manager
    off for this connector, so their sliding-window layers keep every token's KV, as full
    attention layers do. MLA under TP is served: its latent is stored once (the daemon's
    `kvsidecar.daemon.cache.prefix`).
    """
    parallel = vllm_config.parallel_config
    pp = int(getattr(parallel, "pipeline_parallel_size", 1))
    dcp = int(getattr(parallel, "decode_context_parallel_size", 1))
    if pp > 1:
        raise SettingsError(
            f"kvsidecar connector: pipeline parallelism ({pp} stages) is not supported: each "
            "stage holds only its layers of a block, and the daemon stores whole blocks"
        )
    if dcp > 1:
        raise SettingsError(
            f"kvsidecar connector: decode context parallelism ({dcp} ranks) is not supported: "
            "each rank holds only some tokens of a block"
        )
    model = vllm_config.model_config
    if getattr(model, "enable_sleep_mode", False):
        raise SettingsError(
            "kvsidecar connector: sleep mode (--enable-sleep-mode) is not supported: its "
            "CuMemAllocator frees and remaps the KV cache that the daemon has mapped, so the "
            "daemon would read and write memory the engine no longer owns"
        )
    if getattr(model, "is_hybrid", False):
        raise SettingsError(
            f"kvsidecar connector: {model.model} is a hybrid model with state-space (Mamba) "
            "layers: their state is not a KV block the daemon can store or load, and vLLM runs "
            "such models only with its hybrid KV-cache manager, which it turns off for this "
            "connector; serve it without --kv-transfer-config"
        )
    window = _sliding_window(model)
    if window:
        log.warning(
            "kvsidecar: %s has sliding-window attention (window %d): vLLM's hybrid KV-cache "
            "manager is off with this connector, so those layers keep every token's KV (more "
            "memory per request, the same outputs) and the daemon stores and loads them whole",
            model.model,
            window,
        )
    supported = getattr(model, "is_prefix_caching_supported", True)
    attn_type = str(getattr(model, "attn_type", "decoder"))
    if not supported or attn_type not in ("decoder", "hybrid"):
        raise SettingsError(
            f"kvsidecar connector: {model.model} has {attn_type} attention, whose prefixes vLLM "
            "does not cache (a block's KV depends on later tokens): blocks must not be shared"
        )
    policy = str(getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "recompute"))
    if policy != "recompute":
        log.warning(
            "kvsidecar: kv_load_failure_policy=%r: a block the daemon cannot load (evicted, "
            "daemon restarted, pull failed) fails its request instead of being recomputed; "
            "set it to 'recompute'",
            policy,
        )
