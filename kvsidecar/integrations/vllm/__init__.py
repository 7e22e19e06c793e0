"""vLLM's KV connector for kvsidecar: ``kv_connector_module_path = "kvsidecar.integrations.vllm"``.

vLLM loads the class named by ``kv_connector`` (`KVSidecarConnector`) from this package. Its two
halves do the work: `kvsidecar.integrations.vllm.scheduler` (in vLLM's engine-core process:
lookups, what to load, store, publish and pull each step) and `kvsidecar.integrations.vllm.worker`
(in each worker process: the engine's KV cache registered with the daemon, the copies submitted
and their completions). `kvsidecar.integrations.vllm.connector` is the adapter between them and
vLLM's ``KVConnectorBase_V1``; it and the modules only it imports (its metrics, the metadata it
carries) are the only ones that import vLLM, imported here only when vLLM asks for the class, so
the rest can be used (and tested) without vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVSidecarConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVSidecarConnector":
        from kvsidecar.integrations.vllm.connector import KVSidecarConnector

        return KVSidecarConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
