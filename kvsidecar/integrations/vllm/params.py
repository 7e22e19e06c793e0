"""A request's ``kv_transfer_params``, read as what they are: input from any API client.

vLLM hands a request's ``kv_transfer_params`` to the connector as the client sent them (the
OpenAI server passes the request body's field through), so a disaggregated-prefill hand-over can
be forged, truncated or aimed elsewhere by whoever can send a request. Everything here is checked
before the scheduler half plans anything, and before vLLM is told that a request waits for a
transfer: a request whose params do not hold up is computed here instead, counted under one of
`IGNORED_REASONS`.

The prompt's digest (`prompt_digest`) ties a published prefill to the prompt it was computed for:
the producer's daemon publishes the blocks with it, and serves a pull only when the consumer's own
digest of its prompt is the same, so blocks of one prompt never land under another's keys.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

IgnoredReason = Literal["disabled", "malformed", "inconsistent", "endpoint", "unsupported", "held"]
"""Why a request's ``kv_transfer_params`` were ignored (the ``reason`` label of the metric):

- ``disabled``: disaggregated prefill is not turned on for this engine (``disaggregated``);
- ``malformed``: a key is missing or of the wrong type or size;
- ``inconsistent``: they do not fit the request or this engine (token and block counts, block
  sizes, cache layouts);
- ``endpoint``: the producer's daemon is neither this engine's nor one of its ``peers``;
- ``unsupported``: a request this connector does not hand over (multimodal inputs, prompt
  embeddings);
- ``held``: a prefill not handed over because its engine holds its bound of blocks for
  hand-overs nobody has read yet (``max_held_blocks``).
"""
IGNORED_REASONS: tuple[IgnoredReason, ...] = (
    "disabled",
    "malformed",
    "inconsistent",
    "endpoint",
    "unsupported",
    "held",
)

MAX_NAME = 256
"""Longest engine id, request id, endpoint or daemon id accepted."""
MAX_BLOCK_SIZE = 1 << 16
"""Largest producer block size accepted (vLLM's are 16 to a few thousand tokens)."""
MAX_BLOCK_ID = (1 << 31) - 1
"""Largest block id accepted: no engine has that many blocks."""
LAYOUTS = frozenset(
    {"vllm_cpu", "vllm_cpu_amx", "opaque", "kv_first", "blocks_first", "mla", "kv_cells"}
)
"""The cache layouts a producer can report (`kvsidecar.integrations.vllm.layout.CacheLayout`)."""


class Ignored(ValueError):
    """The params cannot be used: ``reason`` (one of `IGNORED_REASONS`) and what was wrong."""

    def __init__(self, reason: IgnoredReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason: IgnoredReason = reason
        self.detail = detail


@dataclasses.dataclass(frozen=True)
class RemotePrefill:
    """A decode request's hand-over, checked (`parse_remote_prefill`)."""

    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    block_size: int
    layout: str
    endpoint: str
    daemon_id: str


def _text(params: Mapping[str, Any], key: str, *, empty: bool) -> str:
    value = params.get(key, "" if empty else None)
    if not isinstance(value, str) or len(value) > MAX_NAME or (not empty and not value):
        raise Ignored("malformed", f"{key} must be a string of 1..{MAX_NAME} characters")
    return value


def _count(params: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise Ignored("malformed", f"{key} must be an integer in {low}..{high}")
    return value


def parse_remote_prefill(params: Mapping[str, Any], *, num_prompt_tokens: int) -> RemotePrefill:
    """Check the keys of a ``do_remote_prefill`` hand-over against the request; raise `Ignored`.

    The producer must have computed exactly this request's prompt (``remote_num_tokens`` is its
    length, as vLLM's NIXL connector sizes a pull from the request's own prompt) and name one
    block id per ``remote_block_size`` tokens of it, each once.
    """
    if params.get("do_remote_prefill") is not True:
        raise Ignored("malformed", "do_remote_prefill must be true")
    num_tokens = _count(params, "remote_num_tokens", 1, 1 << 40)
    block_size = _count(params, "remote_block_size", 1, MAX_BLOCK_SIZE)
    ids = params.get("remote_block_ids")
    if not isinstance(ids, list) or any(
        isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= MAX_BLOCK_ID for b in ids
    ):
        raise Ignored("malformed", f"remote_block_ids must be a list of integers 0..{MAX_BLOCK_ID}")
    layout = _text(params, "remote_layout", empty=True)
    if layout and layout not in LAYOUTS:
        raise Ignored("malformed", f"remote_layout {layout[:40]!r} is no known cache layout")
    prefill = RemotePrefill(
        engine_id=_text(params, "remote_engine_id", empty=False),
        request_id=_text(params, "remote_request_id", empty=False),
        block_ids=tuple(ids),
        num_tokens=num_tokens,
        block_size=block_size,
        layout=layout,
        endpoint=_text(params, "remote_endpoint", empty=True),
        daemon_id=_text(params, "remote_daemon_id", empty=True),
    )
    if num_tokens != num_prompt_tokens:
        raise Ignored(
            "inconsistent",
            f"remote_num_tokens {num_tokens} for a prompt of {num_prompt_tokens} tokens",
        )
    if len(ids) != -(-num_tokens // block_size):
        raise Ignored(
            "inconsistent",
            f"{len(ids)} remote_block_ids for {num_tokens} tokens in blocks of {block_size}",
        )
    if len(set(ids)) != len(ids):
        raise Ignored("inconsistent", "a remote block id appears twice")
    return prefill


def prompt_digest(token_ids: Sequence[int], *, lora_name: str = "", cache_salt: str = "") -> str:
    """Return the digest of what a prompt's KV depends on beyond the model: tokens, LoRA, salt.

    The same in every process for the same prompt (no per-process seed): the producer's
    connector publishes its blocks under it, the consumer's computes it from its own request.
    """
    head = json.dumps(["kvsidecar-prompt-1", lora_name, cache_salt]).encode()
    tokens = np.asarray(token_ids, dtype=np.int64).tobytes()
    return hashlib.sha256(head + b"\0" + tokens).hexdigest()


def request_prompt(request: Any, num_tokens: int | None = None) -> tuple[Sequence[int], str, str]:
    """Return a request's first ``num_tokens`` tokens (all of its prompt when None), LoRA, salt.

    `Ignored` ``unsupported`` for what a token digest cannot name: multimodal inputs, prompt
    embeddings.
    """
    tokens = getattr(request, "prompt_token_ids", None)
    if tokens is None or getattr(request, "prompt_embeds", None) is not None:
        raise Ignored("unsupported", "prompts given as embeddings are not handed over")
    if getattr(request, "mm_features", None):
        raise Ignored("unsupported", "multimodal prompts are not handed over")
    if num_tokens is not None:
        tokens = list(getattr(request, "all_token_ids", tokens))[:num_tokens]
    lora = getattr(request, "lora_request", None)
    lora_name = "" if lora is None else str(getattr(lora, "lora_name", "") or "")
    return tokens, lora_name, str(getattr(request, "cache_salt", None) or "")
