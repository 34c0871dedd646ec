"""Checking a request before it is queued: every field against the model and the pool.

A request that cannot run (an empty or out-of-vocabulary prompt, a grammar built for
another vocabulary, more tokens than the context or the KV pool holds) is refused with a
:class:`~attnlab.serving.params.ParamError` naming the field, before it takes any block;
the HTTP layer answers 400 with that field.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from attnlab.serving.params import ParamError, SamplingParams

__all__ = ["check_kv_dtype", "default_max_model_len", "validate_request"]


def validate_request(
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
) -> None:
    """Check a request against the model's vocabulary and context and the pool's size.

    Raises:
        ParamError: the first field that does not fit (``param`` names it).
    """
    vocab = vocab_size
    if len(prompt_ids) == 0:
        raise ParamError("prompt", "the prompt is empty")
    bad = next(
        (t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)),
        None,
    )
    if bad is not None:  # int(1.7) would silently make it token 1
        raise ParamError("prompt", f"token ids must be ints, got {bad!r} ({type(bad).__name__})")
    if any(not 0 <= t < vocab for t in prompt_ids):
        raise ParamError("prompt", f"token ids must lie in [0, {vocab})")
    for name, ids in (
        ("logit_bias", [t for t, _ in params.logit_bias]),
        ("stop_token_ids", params.stop_token_ids),
    ):
        if any(t >= vocab for t in ids):
            raise ParamError(name, f"{name}: token ids must lie in [0, {vocab}), got {max(ids)}")
    grammar = params.grammar
    if grammar is not None and getattr(grammar, "vocab_size", vocab) != vocab:
        raise ParamError(
            "response_format",
            f"the grammar was compiled for {grammar.vocab_size} tokens, the model has {vocab}",
        )
    if len(prompt_ids) >= max_model_len:
        raise ParamError(
            "prompt",
            f"the prompt has {len(prompt_ids)} tokens; the context is {max_model_len}, "
            "which leaves no room for a completion",
        )
    if len(prompt_ids) + params.max_tokens > max_model_len:
        raise ParamError(
            "max_tokens",
            f"max_tokens={params.max_tokens} with a {len(prompt_ids)}-token prompt exceeds "
            f"the context of {max_model_len} tokens",
        )
    blocks = -(-(len(prompt_ids) + params.max_tokens) // block_size)
    if blocks > num_blocks:
        raise ParamError(
            "max_tokens",
            f"the request needs {blocks} KV blocks, the pool has {num_blocks}",
        )


def check_kv_dtype(
    kv_dtype: str | None, specs: list[str], speculative: str | None = None
) -> str | None:
    """The paged pool's ``kv_dtype`` (None for the model's dtype), checked.

    Raises:
        ValueError: an unknown name, a model without attention layers, or keys per
            channel with speculative decoding (rejected drafts rewrite slots of a block
            that may already be quantized: its keys would be rounded again and the output
            would differ from plain decoding).
    """
    from attnlab.cache.paged.storage import PAGED_KV_DTYPES

    if kv_dtype is None or kv_dtype == "float":
        return None
    if kv_dtype not in PAGED_KV_DTYPES:
        raise ValueError(
            f"kv_dtype must be 'float' or one of {list(PAGED_KV_DTYPES)} (keys per token, "
            f"or per channel in each block), got {kv_dtype!r}"
        )
    if "kv" not in specs:
        raise ValueError(f"kv_dtype={kv_dtype!r}: this model has no attention layers to cache")
    if speculative is not None and kv_dtype.endswith("-channel"):
        raise ValueError(
            f"speculative={speculative!r} with kv_dtype={kv_dtype!r}: keys quantized per "
            "channel over a block would be re-rounded when rejected drafts are rewritten, so "
            "the output would differ from plain decoding; use kv_dtype 'int8'/'int4' (per "
            "token) or no speculative decoding"
        )
    return kv_dtype


def default_max_model_len(model: object) -> int:
    """The context the engine serves when ``max_model_len`` is not given: the config's
    ``max_position_embeddings``.

    Raises:
        ValueError: a config without one (a recurrent model has no context length of its
            own), naming ``max_model_len``.
    """
    config = getattr(model, "config", None)
    value = getattr(config, "max_position_embeddings", None)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"max_model_len: {type(model).__name__}'s config ({type(config).__name__}) has no "
            "max_position_embeddings (a recurrent model has no context length of its own), "
            "so the engine cannot size its pool and its requests: give max_model_len= "
            "(attnlab serve --max-model-len N)"
        )
    return value
