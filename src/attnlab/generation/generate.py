"""Autoregressive generation with a KV cache: greedy or sampled, batched with left padding.

Shape notation: ``B`` batch, ``P`` prompt length (padding included), ``N`` new tokens.

The loop runs the prompt once through the model's forward, then one token per step
through the model's own :meth:`~attnlab.models.decoder.DecoderLM.decode_step`: eagerly
over a growing cache, or, with ``compile=True``, compiled once by ``torch.compile``
over a :class:`~attnlab.cache.StaticKVCache` (fixed shapes, the slot as a tensor, no
graph break; gpt-fast's recipe, with no second copy of the forward). It follows
transformers' ``generate``: positions of a left-padded row start at its first real
token, a finished row (one that produced an EOS token) continues with the pad token,
and generation stops when every row has finished or after ``max_new_tokens``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.functional._checks import check_binary_mask, check_int, check_tensor
from attnlab.functional.positions import positions_from_mask
from attnlab.functional.sampling import check_sampling, next_token
from attnlab.generation.streaming import is_sink_cache, prefill_sink_cache

__all__ = ["generate", "stream"]

#: Static caches of compiled generation hold a multiple of this many slots.
STATIC_BUCKET = 128


def _eos_tensor(eos_token_id: int | Sequence[int] | None, device: torch.device) -> Tensor | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, dtype=torch.long, device=device)


def _check_inputs(
    model: nn.Module, input_ids: Tensor, max_new_tokens: int, attention_mask: Tensor | None
) -> None:
    check_tensor("input_ids", input_ids)
    if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.shape[1] == 0:
        raise ValueError(
            f"input_ids must be a non-empty integer (batch, prompt_len) tensor, got "
            f"{input_ids.dtype} {tuple(input_ids.shape)}"
        )
    check_int("max_new_tokens", max_new_tokens, min_value=0)
    if attention_mask is not None:
        check_binary_mask("attention_mask", attention_mask)
        if attention_mask.shape[0] != input_ids.shape[0]:
            raise ValueError(
                f"batch sizes differ: input_ids has {input_ids.shape[0]} rows, attention_mask "
                f"has {attention_mask.shape[0]}"
            )
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got "
                f"{tuple(attention_mask.shape)}"
            )
    config = model.config
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and not getattr(model, "is_encoder_decoder", False):
        p = input_ids.shape[1]
        if p > limit:
            raise ValueError(
                f"the prompt has {p} tokens, longer than the model's maximum positions "
                f"(max_position_embeddings={limit})"
            )
        if getattr(config, "position_embedding", None) in ("learned", "sinusoidal") and (
            p + max_new_tokens > limit
        ):
            raise ValueError(
                f"prompt ({p}) + max_new_tokens ({max_new_tokens}) = {p + max_new_tokens} exceeds "
                f"the model's learned positions (max_position_embeddings={limit})"
            )


@torch.no_grad()
def stream(
    model: nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    attention_mask: Tensor | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    *,
    pad_token_id: int | None = None,
    cache: Any = None,
    compile: bool = False,
    kv_dtype: str | None = None,
) -> Iterator[Tensor]:
    """Yield the next token of every row, ``[B]`` long, as soon as it is chosen.

    Arguments as :func:`generate`. Rows that have finished yield the pad token.
    """

    check_sampling(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
    _check_inputs(model, input_ids, max_new_tokens, attention_mask)
    if max_new_tokens == 0:
        return
    config: Any = model.config
    device = input_ids.device
    b, p = input_ids.shape
    eos = _eos_tensor(eos_token_id, device)
    if pad_token_id is None:
        pad_token_id = getattr(config, "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = int(eos[0]) if eos is not None else 0
    _check_token_id("pad_token_id", pad_token_id, config.vocab_size)

    steps = itertools.count()

    def choose(logits: Tensor) -> Tensor:
        return next_token(
            logits[:, -1],
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            generator=generator,
            step=next(steps),
        )

    if getattr(model, "is_encoder_decoder", False):
        yield from _stream_seq2seq(
            model, input_ids, max_new_tokens, attention_mask, choose, eos, pad_token_id, cache
        )
        return

    needed = p + max_new_tokens
    if kv_dtype is not None:
        cache = _quantized_cache(model, kv_dtype, cache, compile, needed)
    elif compile:
        cache = _static_cache(model, cache, b, needed)
    elif cache is None:
        cache = model.new_cache(max_length=needed)  # type: ignore[operator]
    else:
        _check_fresh_cache(cache)
        _check_cache_room(cache, needed)
    full_mask: Tensor | None = None
    next_pos: Tensor | None = None
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        # Over every slot of a static cache when compiling: one shape for every step.
        slots = cache.layers[0].max_length if compile else needed
        full_mask = torch.ones(b, slots, dtype=torch.long, device=device)
        full_mask[:, :p] = attention_mask
        next_pos = positions_from_mask(attention_mask)[:, -1:] + 1  # [B, 1]
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    if is_sink_cache(cache):  # a stream past the context: fixed-size cache, prompt in chunks
        if compile or full_mask is not None:
            raise ValueError(
                "a sink cache decodes eagerly and unpadded (its rows share one layout): "
                "pass compile=False and no padded attention_mask"
            )
        logits = prefill_sink_cache(model, input_ids, cache)
    else:
        logits = model(
            input_ids,
            attention_mask=full_mask[:, :p] if full_mask is not None else None,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits
    # models without a trusted decode step (recurrent, encoder-decoder) run their forward
    step_fn: Any = compiled_decode_step(model) if compile else getattr(model, "decode_step", None)
    backend: str | None = None
    # LongRoPE switches its frequencies once the sequence passes its original length: at
    # that slot the whole sequence is encoded again (as transformers' Phi-3 does)
    again_at = getattr(model, "prefill_again_at", None)
    tokens = [input_ids] if again_at is not None and p <= again_at < needed else None
    for step in range(max_new_tokens):
        tok = choose(logits)
        if eos is not None:
            tok = tok.masked_fill(finished, pad_token_id)
        if tokens is not None:
            tokens.append(tok[:, None])
        yield tok
        if eos is not None:
            finished |= torch.isin(tok, eos)
            if bool(finished.all()):
                return
        if step + 1 == max_new_tokens:
            return
        slot = p + step
        if tokens is not None and slot == again_at:
            cache.reset()
            logits = model(
                torch.cat(tokens, dim=1),
                attention_mask=full_mask[:, : slot + 1] if full_mask is not None else None,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits
            tokens = None
        elif compile:  # the slot as a tensor and the whole mask: the same graph every step
            start = torch.tensor(slot, device=device)
            if backend is None:  # asked once, eagerly: the registry's context is not traced
                backend = model.decode_backend(  # type: ignore[operator]
                    tok[:, None], cache=cache, start=start, attention_mask=full_mask
                )
            logits = step_fn(
                tok[:, None],
                cache=cache,
                start=start,
                position_ids=next_pos,
                attention_mask=full_mask,
                backend=backend,
            )
            cache.set_length(slot + 1)
        elif step_fn is not None:
            logits = step_fn(
                tok[:, None],
                cache=cache,
                start=slot,
                position_ids=next_pos,
                attention_mask=full_mask[:, : slot + 1] if full_mask is not None else None,
            )
        else:
            logits = model(
                tok[:, None],
                attention_mask=full_mask[:, : slot + 1] if full_mask is not None else None,
                position_ids=next_pos,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits
        if next_pos is not None:
            next_pos = next_pos + 1


#: Decode-step graphs one process may compile (one per model, batch size and cache-length
#: bucket). dynamo's own limit (8) counts every graph of ``DecoderLM.decode_step``'s code
#: object, whichever model it belongs to, and ``fullgraph=True`` turns reaching it into a
#: crash on the ninth model or shape.
COMPILED_STEP_GRAPHS = 64


def compiled_decode_step(model: nn.Module) -> Any:
    """``torch.compile`` of ``model.decode_step``, made once per model and kept on it.

    The step has fixed shapes over a static cache and takes its slot as a tensor, so one
    graph serves every step of every generation with the same batch size and cache
    length (``dynamic=False``; ``fullgraph=True`` fails loudly on a graph break
    rather than running part of the step eagerly). Up to :data:`COMPILED_STEP_GRAPHS`
    graphs are kept per process; past that, a clear ``RuntimeError``.
    """
    step = getattr(model, "_compiled_decode_step", None)
    if step is None:
        decode_step: Any = model.decode_step
        compiled = torch.compile(decode_step, fullgraph=True, dynamic=False)

        def step(*args: Any, **kwargs: Any) -> Any:
            with torch._dynamo.config.patch(recompile_limit=COMPILED_STEP_GRAPHS):
                try:
                    return compiled(*args, **kwargs)
                except torch._dynamo.exc.FailOnRecompileLimitHit as err:
                    raise RuntimeError(
                        f"generate(compile=True) has compiled {COMPILED_STEP_GRAPHS} decode-step "
                        "graphs in this process (one per model, batch size and cache length); "
                        "use compile=False, or fewer distinct shapes"
                    ) from err

        model.__dict__["_compiled_decode_step"] = step
    return step


def _static_cache(model: nn.Module, cache: Any, b: int, needed: int) -> Any:
    """The static cache of a compiled generation: a new one, or the user's, checked."""
    config: Any = model.config
    if getattr(model, "is_encoder_decoder", False) or not hasattr(model, "decode_step"):
        raise ValueError(
            f"compile=True compiles a decoder-only model's decode step; {type(model).__name__} "
            "has none: use compile=False"
        )
    rope_type = (getattr(config, "rope_scaling", None) or {}).get("rope_type")
    if rope_type in ("dynamic", "longrope"):
        raise ValueError(
            "compile=True needs fixed RoPE frequencies; "
            + ("dynamic NTK" if rope_type == "dynamic" else "LongRoPE")
            + " scaling changes them with the length: use compile=False"
        )
    if cache is None:
        # Lengths rounded up to a bucket: one compiled graph serves many prompt lengths
        # (the causal pattern hides the slots beyond the current one).
        bucket = -(-needed // STATIC_BUCKET) * STATIC_BUCKET
        return model.new_cache(kind="static", max_length=bucket, batch_size=b)  # type: ignore[operator]
    _check_fresh_cache(cache)
    from attnlab.cache import StaticKVCache

    if not all(isinstance(c, StaticKVCache) for c in getattr(cache, "layers", [])):
        raise ValueError(
            "compile=True needs static caches (model.new_cache(kind='static', ...)), got "
            f"{sorted({type(c).__name__ for c in cache.layers})}"
        )
    _check_cache_room(cache, needed)
    return cache


def _quantized_cache(
    model: nn.Module, kv_dtype: str, cache: Any, compile: bool, needed: int
) -> Any:
    """A fresh model cache whose KV layers hold ``kv_dtype`` (:mod:`attnlab.cache.quantized`)."""
    from attnlab.cache.kv_cache import DynamicKVCache
    from attnlab.cache.quantized import KV_DTYPES, QuantizedKVCache

    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {list(KV_DTYPES)} or None, got {kv_dtype!r}")
    if cache is not None or compile:
        raise ValueError(
            "kv_dtype makes its own cache and runs eagerly: pass neither cache= nor compile=True"
        )
    fresh = model.new_cache(max_length=needed)  # type: ignore[operator]
    if not all(type(c) is DynamicKVCache for c in fresh.layers):
        raise ValueError(
            "kv_dtype quantizes growing KV caches; this model's layers carry "
            f"{sorted({type(c).__name__ for c in fresh.layers})}"
        )
    fresh.layers = [QuantizedKVCache(kv_dtype=kv_dtype, capacity=needed) for _ in fresh.layers]
    return fresh


def _check_token_id(name: str, value: object, vocab_size: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int token id, got {type(value).__name__} {value!r}")
    if not 0 <= value < vocab_size:
        raise ValueError(f"{name} must lie in [0, vocab_size={vocab_size}), got {value}")


def _check_fresh_cache(cache: Any) -> None:
    """Refuse a cache that already holds tokens (e.g. left by a stream stopped early).

    Generation writes the prompt at slot 0; continuing a cache that holds another
    call's tokens would attend to them and silently change the output.
    """
    length = getattr(cache, "length", 0)
    if length:
        raise ValueError(
            f"cache holds {length} token(s) from an earlier call (a stream stopped early "
            "leaves its tokens behind); call cache.reset() or pass a new cache"
        )


def _check_cache_room(cache: Any, needed: int) -> None:
    for layer in getattr(cache, "layers", []):
        room = getattr(layer, "max_length", None)
        if room is not None and room - layer.length < needed:
            raise ValueError(
                f"cache too small: the prompt and max_new_tokens need {needed} slots, the cache "
                f"has {room - layer.length} free (max_length={room}, {layer.length} used)"
            )


def _stream_seq2seq(
    model: Any,
    input_ids: Tensor,
    max_new_tokens: int,
    attention_mask: Tensor | None,
    choose: Any,
    eos: Tensor | None,
    pad_token_id: int,
    cache: Any,
) -> Iterator[Tensor]:
    b = input_ids.shape[0]
    device = input_ids.device
    encoder_out = model.encode(input_ids, attention_mask=attention_mask)  # [B, S_enc, D]
    if cache is None:
        cache = model.new_cache(max_length=max_new_tokens + 1)
    else:
        _check_fresh_cache(cache)
    start_id = model.config.decoder_start_token_id
    tok = torch.full((b,), start_id, dtype=torch.long, device=device)
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        out = model(
            attention_mask=attention_mask,
            decoder_input_ids=tok[:, None],
            encoder_outputs=encoder_out,
            past_key_values=cache,
            use_cache=True,
        )
        tok = choose(out.logits)
        if eos is not None:
            tok = tok.masked_fill(finished, pad_token_id)
        yield tok
        if eos is not None:
            finished |= torch.isin(tok, eos)
            if bool(finished.all()):
                return


def generate(
    model: nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    attention_mask: Tensor | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    *,
    pad_token_id: int | None = None,
    cache: Any = None,
    compile: bool = False,
    speculative: str | nn.Module | None = None,
    num_draft: int = 8,
    kv_dtype: str | None = None,
) -> Tensor:
    """Generate up to ``max_new_tokens`` tokens after each prompt.

    Args:
        model: an attnlab causal LM (:class:`~attnlab.models.decoder.DecoderLM`) or
            encoder-decoder (:class:`~attnlab.models.seq2seq.Seq2SeqLM`).
        input_ids: ``[B, P]`` prompts, left-padded to a common length (the encoder
            input for an encoder-decoder).
        max_new_tokens: the most tokens to add.
        attention_mask: ``[B, P]`` 1 (token) / 0 (padding).
        do_sample: sample (True) or take the most likely token (False, greedy).
        temperature: divides the logits when sampling; must be > 0.
        top_k: sample among the ``k`` most likely tokens.
        top_p: sample from the nucleus of probability ``p`` in ``(0, 1]``.
        eos_token_id: token id(s) that end a row; later tokens of that row are padding.
        generator: ``torch.Generator`` for reproducible sampling.
        pad_token_id: the filler after EOS (default: the config's, else the EOS id, else 0).
        cache: a :class:`~attnlab.cache.ModelCache` to use (default: a fresh one sized
            for the prompt and the new tokens).
        compile: compile the model's decode step with ``torch.compile`` over a static
            cache (the first call compiles, later ones reuse the graph); same tokens
            as the eager loop. Decoder-only models.
        speculative: ``"prompt_lookup"`` or a draft model (same vocabulary): draft
            ``num_draft`` tokens and verify them in one forward
            (:mod:`attnlab.generation.speculative`); greedy output is unchanged and
            sampling keeps its distribution. One unpadded row, a fresh cache, eager.
        num_draft: tokens drafted per verification.
        kv_dtype: ``"int8"``, ``"int4"`` or ``"int2"``: keep the KV cache quantized as
            KIVI does (keys per channel in groups of 32 tokens, values per token), the
            newest 32+ tokens in float (:class:`~attnlab.cache.quantized.QuantizedKVCache`).

    Returns:
        Long ``[B, P + N]`` for a causal LM (the prompts, then ``N <= max_new_tokens``
        new tokens); ``[B, 1 + N]`` for an encoder-decoder (the decoder start token,
        then the new tokens), as transformers returns.

    Raises:
        ValueError: a prompt longer than the model's maximum positions, a cache too
            small, mismatched batch sizes, ``top_p`` outside ``(0, 1]``, ``temperature
            <= 0`` with sampling.
    """
    if speculative is not None:
        if kv_dtype is not None:
            raise ValueError("speculative decoding keeps a float cache: drop kv_dtype")
        return _generate_speculative(
            model, input_ids, max_new_tokens, attention_mask, cache, compile, speculative,
            num_draft=num_draft, do_sample=do_sample, temperature=temperature, top_k=top_k,
            top_p=top_p, eos_token_id=eos_token_id, generator=generator,
        )  # fmt: skip
    tokens = list(
        stream(
            model,
            input_ids,
            max_new_tokens,
            attention_mask,
            do_sample,
            temperature,
            top_k,
            top_p,
            eos_token_id,
            generator,
            pad_token_id=pad_token_id,
            cache=cache,
            compile=compile,
            kv_dtype=kv_dtype,
        )
    )
    if getattr(model, "is_encoder_decoder", False):
        config: Any = model.config
        prefix = torch.full(
            (input_ids.shape[0], 1),
            config.decoder_start_token_id,
            dtype=torch.long,
            device=input_ids.device,
        )
    else:
        prefix = input_ids
    if not tokens:
        return prefix.clone()
    return torch.cat((prefix, torch.stack(tokens, dim=1)), dim=1)


def _generate_speculative(
    model: nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    attention_mask: Tensor | None,
    cache: Any,
    compile: bool,
    speculative: str | nn.Module,
    **kwargs: Any,
) -> Tensor:
    """``generate(speculative=...)``: the combinations it refuses, then the drafted loop."""
    from attnlab.generation.speculative import speculative_stream

    check_sampling(
        do_sample=kwargs["do_sample"],
        temperature=kwargs["temperature"],
        top_k=kwargs["top_k"],
        top_p=kwargs["top_p"],
    )
    _check_inputs(model, input_ids, max_new_tokens, attention_mask)
    if getattr(model, "is_encoder_decoder", False) or not hasattr(model, "new_cache"):
        raise ValueError(
            f"speculative decoding needs a decoder-only model, got {type(model).__name__}"
        )
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("speculative decoding runs one unpadded row: drop the padding")
    if cache is not None or compile:
        raise ValueError("speculative decoding makes its own cache and runs eagerly: "
                         "pass neither cache= nor compile=True")  # fmt: skip
    if getattr(model.config, "sliding_window", None) is not None:
        raise ValueError("speculative decoding cuts the cache back: a sliding-window cache cannot")
    new = list(speculative_stream(model, input_ids, max_new_tokens, draft=speculative, **kwargs))
    tail = torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device)
    return torch.cat([input_ids, tail], dim=1)
