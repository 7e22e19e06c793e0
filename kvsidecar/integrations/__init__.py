"""Engine integrations built on `kvsidecar.client`: each imports its engine, nothing imports them.

`kvsidecar.integrations.vllm` is vLLM's KV connector (docs/vllm.md).
"""
