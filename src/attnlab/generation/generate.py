"""Autoregressive generation with a KV cache: greedy or sampled, batched with left padding.

Shape notation: ``B`` batch, ``P`` prompt length (padding included), ``N`` new tokens.

The loop runs the prompt once through the model's forward, then one token per step
through the model's own :meth:`~attnlab.models.decoder.DecoderLM.decode_step`: eagerly
over a growing cache, or compiled by ``torch.compile`` over a
:class:`~attnlab.cache.StaticKVCache` (:mod:`attnlab.generation.compiled`: by default
when it is possible and the run is long enough to pay for the compile; ``compile=False``
opts out). It follows transformers' ``generate``: positions of a left-padded row start
at its first real token, a finished row (one that produced an EOS token) continues with
the pad token, and generation stops when every row has finished or after
``max_new_tokens``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.functional.positions import positions_from_mask
from attnlab.functional.sampling import check_sampling, next_token
from attnlab.generation.compiled import (
    compile_decision,
    compiled_decode_step,
    keep_static_cache,
    lay_out_linears,
    static_cache,
    warm_stance,
)
from attnlab.generation.inputs import (
    check_cache_room,
    check_fresh_cache,
    check_inputs,
    check_token_id,
    eos_tensor,
    quantized_cache,
)
from attnlab.generation.streaming import is_sink_cache, prefill_sink_cache

__all__ = ["generate", "stream"]

logger = logging.getLogger("attnlab.generation")


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
    compile: bool | None = None,
    kv_dtype: str | None = None,
) -> Iterator[Tensor]:
    """Yield the next token of every row, ``[B]`` long, as soon as it is chosen.

    Arguments as :func:`generate`. Rows that have finished yield the pad token.
    """

    check_sampling(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
    check_inputs(model, input_ids, max_new_tokens, attention_mask)
    if compile is not None and not isinstance(compile, bool):
        raise TypeError(f"compile must be True, False or None (auto), got {compile!r}")
    if max_new_tokens == 0:
        return
    config: Any = model.config
    eos = eos_tensor(eos_token_id, input_ids.device)
    if pad_token_id is None:
        pad_token_id = getattr(config, "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = int(eos[0]) if eos is not None else 0
    check_token_id("pad_token_id", pad_token_id, config.vocab_size)
    steps = itertools.count()

    def choose(logits: Tensor) -> Tensor:
        tok = next_token(
            logits[:, -1],
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            generator=generator,
            step=next(steps),
        )
        return tok if eos is None else tok.masked_fill(finished, pad_token_id)

    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    steps_of: _DecoderSteps | None = None
    if getattr(model, "is_encoder_decoder", False):
        from attnlab.generation.seq2seq import stream_seq2seq

        tokens = stream_seq2seq(model, input_ids, max_new_tokens, attention_mask, choose, cache)
    else:
        decision = compile_decision(
            model, max_new_tokens, compile=compile, cache=cache, kv_dtype=kv_dtype,
            eos_token_id=eos_token_id, batch_size=input_ids.shape[0],
            prompt_length=input_ids.shape[1],
        )  # fmt: skip
        steps_of = _DecoderSteps(
            model, input_ids, max_new_tokens, attention_mask, cache,
            compiled=decision.compile, auto=compile is None, kv_dtype=kv_dtype,
        )  # fmt: skip
        tokens = steps_of.run(choose)
    for tok in tokens:
        yield tok
        if eos is not None:
            finished |= torch.isin(tok, eos)
            if bool(finished.all()):
                break
    if steps_of is not None and steps_of.owned:  # ended normally: the next call reuses it
        keep_static_cache(model, steps_of.cache)


class _DecoderSteps:
    """One decoder-only generation: its cache, padding, and the step that runs each token."""

    def __init__(
        self,
        model: nn.Module,
        input_ids: Tensor,
        max_new_tokens: int,
        attention_mask: Tensor | None,
        cache: Any,
        *,
        compiled: bool,
        auto: bool,
        kv_dtype: str | None,
    ) -> None:
        b, p = input_ids.shape
        self.model, self.input_ids, self.new = model, input_ids, max_new_tokens
        self.compiled, self.auto = compiled, auto
        needed = p + max_new_tokens
        # a static cache this generation made (or took back): kept for the next call
        self.owned = compiled and cache is None and kv_dtype is None
        if kv_dtype is not None:
            cache = quantized_cache(model, kv_dtype, cache, compiled, needed)
        elif compiled:
            cache = static_cache(model, cache, b, needed)
        elif cache is None:
            cache = model.new_cache(max_length=needed)  # type: ignore[operator]
        else:
            check_fresh_cache(cache)
            check_cache_room(cache, needed)
        self.cache = cache
        self.full_mask: Tensor | None = None
        self.next_pos: Tensor | None = None
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            # Over every slot of a static cache when compiling: one shape for every step.
            slots = cache.layers[0].max_length if compiled else needed
            self.full_mask = torch.ones(b, slots, dtype=torch.long, device=input_ids.device)
            self.full_mask[:, :p] = attention_mask
            self.next_pos = positions_from_mask(attention_mask)[:, -1:] + 1  # [B, 1]
        if is_sink_cache(cache) and (compiled or self.full_mask is not None):
            raise ValueError(
                "a sink cache decodes eagerly and unpadded (its rows share one layout): "
                "pass compile=False and no padded attention_mask"
            )
        if compiled:  # quantized layers measure their decode kernels now, not in the graph
            from attnlab.backends.decode_attention import decode_status
            from attnlab.models.quantize import measure_kernels

            decode_status()  # the decode-attention kernel built (or refused) before tracing

            floats = [t.dtype for t in model.parameters() if t.is_floating_point()]
            measure_kernels(model, b, floats[0] if floats else torch.float32)
            lay_out_linears(model, b)  # the float ones: laid out and measured per shape
        # models without a trusted decode step (recurrent) run their forward
        self.step_fn: Any = (
            compiled_decode_step(model) if compiled else getattr(model, "decode_step", None)
        )
        self.backend: str | None = None
        self.warm = False  # a compiled step of this run has passed every guard
        # LongRoPE switches its frequencies once the sequence passes its original length:
        # at that slot the whole sequence is encoded again (as transformers' Phi-3 does)
        self.again_at = getattr(model, "prefill_again_at", None)
        self.tokens = (
            [input_ids] if self.again_at is not None and p <= self.again_at < needed else None
        )

    def _mask_to(self, length: int) -> Tensor | None:
        return self.full_mask[:, :length] if self.full_mask is not None else None

    def _forward(self, ids: Tensor, length: int, position_ids: Tensor | None = None) -> Tensor:
        return self.model(
            ids,
            attention_mask=self._mask_to(length),
            position_ids=position_ids,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits

    def run(self, choose: Any) -> Iterator[Tensor]:
        p = self.input_ids.shape[1]
        if is_sink_cache(self.cache):  # past the context: fixed-size cache, prompt in chunks
            logits = prefill_sink_cache(self.model, self.input_ids, self.cache)
        else:
            logits = self._forward(self.input_ids, p)
        for step in range(self.new):
            tok = choose(logits)
            if self.tokens is not None:
                self.tokens.append(tok[:, None])
            yield tok
            if step + 1 == self.new:
                return
            logits = self.step(tok, p + step)
            if self.next_pos is not None:
                self.next_pos = self.next_pos + 1

    def step(self, tok: Tensor, slot: int) -> Tensor:
        """The logits after ``tok [B]`` written at ``slot``."""
        if self.tokens is not None and slot == self.again_at:
            self.cache.reset()
            logits = self._forward(torch.cat(self.tokens, dim=1), slot + 1)
            self.tokens = None
            return logits
        if self.compiled:
            return self._compiled_step(tok, slot)
        if self.step_fn is not None:
            return self.step_fn(
                tok[:, None], cache=self.cache, start=slot, position_ids=self.next_pos,
                attention_mask=self._mask_to(slot + 1),
            )  # fmt: skip
        return self._forward(tok[:, None], slot + 1, self.next_pos)

    def _compiled_step(self, tok: Tensor, slot: int) -> Tensor:
        """The slot as a tensor, the whole mask, and the slots written so far as a size
        the graph takes as dynamic: the same graph every step, reading only the prefix."""
        start = torch.tensor(slot, device=tok.device)
        key_slots = torch.arange(slot + 1, device=tok.device)[None]  # [1, S]
        # S <= max_length - 1: the last new token is never written (a full-length view
        # would be a guard of its own)
        torch._dynamo.mark_dynamic(key_slots, 1, min=2, max=self.cache.layers[0].max_length - 1)
        if self.backend is None:  # asked once, eagerly: the registry's context is not traced
            self.backend = self.model.decode_backend(  # type: ignore[operator]
                tok[:, None], cache=self.cache, start=start, attention_mask=self.full_mask,
                key_slots=key_slots,
            )  # fmt: skip
        kwargs = dict(cache=self.cache, start=start, position_ids=self.next_pos,
                      attention_mask=self.full_mask, backend=self.backend,
                      key_slots=key_slots)  # fmt: skip
        try:
            with warm_stance(self.warm):
                logits = self.step_fn(tok[:, None], **kwargs)
            self.warm = True
        except (torch._dynamo.exc.TorchDynamoException, RuntimeError) as err:
            if not self.auto:
                raise
            # compile was our choice, not the user's: say so, and run the same step eagerly
            logger.warning(
                "the compiled decode step failed (%s: %s); generate continues eagerly "
                "(pass compile=False to skip the attempt)", type(err).__name__, err,
            )  # fmt: skip
            self.step_fn = self.model.decode_step  # type: ignore[assignment]
            self.auto = False
            logits = self.step_fn(tok[:, None], **kwargs)
        self.cache.set_length(slot + 1)
        return logits


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
    compile: bool | None = None,
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
        compile: ``None`` (default): the fastest exact path, the decode step compiled
            with ``torch.compile`` over a static cache when
            :func:`~attnlab.generation.compiled.compile_decision` finds it possible and
            worth it (decoder-only, eval mode, a C++ compiler, and a graph of this shape
            already compiled or a run of known length: no ``eos_token_id`` and at least
            128 new tokens), eager otherwise; ``True``: compile (or raise where it cannot); ``False``:
            eager. The first call of a shape compiles (10-20 s cold), logged and kept in
            :func:`~attnlab.generation.compiled.compile_report`; same tokens either way.
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
        from attnlab.generation.speculative import generate_speculative

        return generate_speculative(
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
