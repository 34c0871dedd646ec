"""Speculative decoding with a draft model in the serving engine.

Shape notation: ``N`` tokens of a draft forward, ``n_s`` sequences, ``k`` drafts of a
sequence, ``V`` vocabulary.

A draft model (any smaller attnlab decoder with the model's vocabulary; Leviathan et
al., 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et al.,
2023, "Accelerating Large Language Model Decoding with Speculative Sampling") proposes
``k`` tokens for each decoding sequence; the model verifies them in the step's one flat
forward, as it verifies prompt-lookup drafts (:mod:`attnlab.serving.speculative`).

The :class:`DraftRunner` keeps the draft's keys and values in a paged pool of its own,
addressed through the *model's* block tables: the engine's one
:class:`~attnlab.cache.paged.manager.KVManager` reserves a slot per token, and the draft
writes its keys for token ``p`` of a sequence into the same slot of its own storage as
the model does in its (vLLM's draft runners share the block tables the same way). So
preemption, copy-on-write and the drafts' reservations need nothing of the draft's
own. The runner knows, per sequence, how many leading tokens its pool holds (a
sequence entering the pool starts from none, so a prefix-cache hit or a recomputed
preempted sequence gets its draft keys written again by the first draft forward); each
step it drafts with ``k`` small flat forwards of the draft model, all the drafting
sequences batched in each: the first runs every token the draft has not seen yet (at
least the last one) and gives the first drafts, each further forward runs the draft
just made. The keys of rejected drafts stay in slots the next forwards overwrite.

Verification. A greedy row keeps the drafts equal to the model's argmax: plain greedy
output. A sampled row drew its drafts from the draft's distribution ``q`` (after the
row's own settings: temperature, top-k/top-p/min-p, penalties, bans), and
:func:`verify_sampled` applies the rejection rule of speculative sampling with the
model's ``p`` after the same settings: draft ``d_i`` is kept with probability
``min(1, p_i(d_i) / q_i(d_i))``, the first rejected one is replaced by a draw from
``max(p_i - q_i, 0)`` renormalised, and after ``k`` kept drafts one more token is drawn
from ``p_k`` (:func:`~attnlab.generation.sampler.speculative_verify`), so the output is
distributed as plain sampling. A seeded request draws its drafts and its verification
from its own generator: reproducible, but not the tokens a run without speculation draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.backends.plan import BlockTable
from attnlab.cache.paged.manager import SeqId
from attnlab.cache.paged.pool import PagedKVPool
from attnlab.generation.sampler import sampling_probs, speculative_verify, token_logprobs
from attnlab.serving.runner import FlatRow, flat_inputs, layer_specs, pool_for
from attnlab.serving.step_sampling import RowResult, row_sampling

__all__ = ["DraftRunner", "load_draft_model", "verify_sampled"]


def load_draft_model(draft: nn.Module | str | Path, model: nn.Module) -> nn.Module:
    """The draft model, loaded from its folder or file if a path, checked against ``model``.

    Raises:
        TypeError: a draft that is not an attnlab decoder.
        ValueError: a vocabulary other than the model's (both sizes named), recurrent
            layers, no attention layer, or another device than the model's.
        ModelFileError: a path that is not a model folder or file.
    """
    if isinstance(draft, (str, Path)):
        from attnlab.interop.causal_lm import load_causal_lm

        draft = load_causal_lm(draft).model
    config = getattr(draft, "config", None)
    if (
        not isinstance(draft, nn.Module)
        or config is None
        or getattr(draft, "is_encoder_decoder", False)
        or not hasattr(draft, "forward_flat")
    ):
        raise TypeError(
            f"draft_model must be an attnlab decoder (or its folder), got {type(draft).__name__}"
        )
    mine = int(model.config.vocab_size)  # type: ignore[union-attr,arg-type]
    theirs = int(config.vocab_size)
    if mine != theirs:
        raise ValueError(
            f"draft_model has a vocabulary of {theirs} tokens, the model {mine}: a draft "
            "model must share the model's tokenizer"
        )
    specs = layer_specs(draft)
    if "state" in specs or "kv" not in specs:
        raise ValueError(
            "draft_model must be an attention decoder: recurrent layers advance their "
            "state over every draft and cannot be cut back to the kept tokens"
        )
    dev, draft_dev = next(model.parameters()).device, next(draft.parameters()).device
    if dev != draft_dev:
        raise ValueError(f"draft_model is on {draft_dev}, the model on {dev}: move it")
    return draft.eval()


class DraftRunner:
    """The draft model's forwards over the model's block tables.

    Args:
        model: the draft (checked by :func:`load_draft_model`).
        pool: the model's paged pool: its manager's block tables address the draft's
            pool too (as many blocks, of as many tokens).

    Raises:
        ValueError: a model whose pool frees blocks behind a sliding window (the draft
            may still need them for a token it has not seen).
    """

    def __init__(self, model: nn.Module, pool: PagedKVPool) -> None:
        if pool.sliding_window is not None:
            raise ValueError(
                f"a draft model with a sliding-window model (window {pool.sliding_window}): "
                "the blocks behind the window are freed, the draft may still need them; "
                "use speculative='prompt_lookup'"
            )
        self.model = model
        self.manager = pool.manager
        self.pool = pool_for(
            model,
            layer_specs(model),
            num_blocks=pool.num_blocks,
            block_size=pool.block_size,
            prefix_caching=False,
        )
        self.cache = self.pool.model_cache()
        #: per sequence, its leading tokens whose draft keys the pool holds
        self.computed: dict[SeqId, int] = {}
        self._written: dict[SeqId, int] = {}  # written this step, valid once verified

    # ------------------------------------------------------------------ book-keeping

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Make the step's copy-on-write block copies in the draft's pool too."""
        self.pool.storage.copy_blocks(copies)

    def fork(self, parent: SeqId, child: SeqId) -> None:
        """``child`` shares ``parent``'s blocks, so its draft keys too."""
        self.computed[child] = self.computed.get(parent, 0)

    def release(self, seq_id: SeqId) -> None:
        """``seq_id`` left the pool (finished or preempted)."""
        self.computed.pop(seq_id, None)
        self._written.pop(seq_id, None)

    def settle(self) -> None:
        """After verification: the draft keys written this step for tokens the model
        kept (computed) count; those of rejected drafts are overwritten later."""
        for seq_id, written in self._written.items():
            if seq_id in self.manager:
                self.computed[seq_id] = min(written, self.manager.num_computed(seq_id))
        self._written.clear()

    # ------------------------------------------------------------------ drafting

    def propose(
        self,
        entries: Sequence[tuple[Any, int]],
        *,
        eos_ids: set[int],
        generator: torch.Generator,
    ) -> dict[SeqId, tuple[list[int], Tensor | None]]:
        """Draft up to ``k`` tokens for each ``(sequence, k)``: ``k`` forwards at most.

        Each decoding sequence's slots for its drafts are reserved (its last token's
        too). Greedy rows take the draft's argmax; sampled rows draw from the draft's
        distribution after their settings (their own generator if seeded, else
        ``generator``).

        Returns:
            ``seq_id -> (drafts, q [len(drafts), V] or None for a greedy row)``; fewer
            drafts than asked where the draft's logits cannot give a token.
        """
        m = self.manager
        drafts: dict[SeqId, list[int]] = {seq.seq_id: [] for seq, _ in entries}
        probs: dict[SeqId, list[Tensor]] = {seq.seq_id: [] for seq, _ in entries}
        rows: list[tuple[SeqId, int, list[int]]] = []
        for seq, _ in entries:  # every token the draft has not seen, up to the last one
            s = m._seq(seq.seq_id)
            start = min(self.computed.get(seq.seq_id, 0), s.computed)
            rows.append((seq.seq_id, start, s.tokens[start : s.computed + 1]))
            self._written[seq.seq_id] = s.computed + 1
        live = list(entries)
        while live:
            logits = self._forward(rows).float()  # [n_s, V]
            samp = [row_sampling(seq, eos_ids, drafts[seq.seq_id]) for seq, _ in live]
            q, failed = sampling_probs(logits, samp)
            nxt: list[tuple[Any, int]] = []
            rows = []
            for i, (seq, k) in enumerate(live):
                if i in failed:
                    continue  # the drafts so far stand
                sid, greedy = seq.seq_id, seq.request.params.greedy
                gen = seq.generator if seq.generator is not None else generator
                tok = (
                    int(q[i].argmax()) if greedy else int(torch.multinomial(q[i], 1, generator=gen))
                )
                drafts[sid].append(tok)
                if not greedy:
                    probs[sid].append(q[i])
                if len(drafts[sid]) < k:
                    pos = m.num_computed(sid) + len(drafts[sid])
                    rows.append((sid, pos, [tok]))
                    self._written[sid] = pos + 1
                    nxt.append((seq, k))
            live = nxt
        return {
            sid: (d, torch.stack(probs[sid]) if probs[sid] else None) for sid, d in drafts.items()
        }

    def _forward(self, rows: Sequence[tuple[SeqId, int, list[int]]]) -> Tensor:
        """One flat forward of the draft: row ``(seq_id, start, tokens)`` runs ``tokens``
        from position ``start``; logits ``[n_s, V]`` of each row's last token."""
        m, bs = self.manager, self.manager.block_size
        dev = self.pool.storage.device
        spans: list[FlatRow] = [(start, toks, m._seq(sid).blocks) for sid, start, toks in rows]
        nb = max(len(b) for _, _, b in spans)
        table = torch.tensor([[*b] + [0] * (nb - len(b)) for _, _, b in spans], dtype=torch.long)
        blocks = BlockTable(
            table=table.to(dev),
            block_size=bs,
            lengths=tuple(start + len(toks) for start, toks, _ in spans),
            offsets=(0,) * len(rows),
            first_block=(0,) * len(rows),
        )
        ids, flat = flat_inputs(spans, block_size=bs, blocks=blocks, device=dev)
        out: Tensor = self.model.forward_flat(ids, flat, self.cache)  # type: ignore[operator]
        return out


def verify_sampled(
    logits: Tensor,
    seq: Any,
    drafts: Sequence[int],
    draft_probs: Tensor,
    *,
    eos_ids: set[int],
    generator: torch.Generator,
) -> tuple[int, list[RowResult]]:
    """The rejection rule for a sampled row's model-drafted tokens.

    Args:
        logits: ``[k + 1, V]`` the model's logits after the last token and each draft.
        seq: the engine sequence (its settings, outputs and generator).
        drafts: the ``k`` drafts.
        draft_probs: ``[k, V]`` the draft's distributions they were drawn from.
        eos_ids: banned before ``min_tokens``.
        generator: the randomness of an unseeded row.

    Returns:
        ``(kept drafts a, results)``: ``a + 1`` results, the kept drafts and the token
        after them (an error where the model's logits at that position give no token).
    """
    k = len(drafts)
    rows = [row_sampling(seq, eos_ids, drafts[:j]) for j in range(k + 1)]
    p, failed = sampling_probs(logits, rows)  # [k + 1, V]
    stop = min(failed) if failed else k  # drafts past a failed position cannot be judged
    target = p[: stop + 1].clone()
    if failed:  # a placeholder: a token drawn there is replaced by the error below
        target[stop] = 1.0 / target.shape[-1]
    gen = seq.generator if seq.generator is not None else generator
    d = torch.tensor(list(drafts[:stop]), dtype=torch.long)
    a, tok = speculative_verify(target, d, draft_probs[:stop], generator=gen)
    tokens = [*drafts[:a], tok]
    lps = token_logprobs(logits[: a + 1], rows[: a + 1], tokens, {})
    results = [RowResult(t, lp) for t, lp in zip(tokens, lps, strict=True)]
    if a in failed:
        results[a] = RowResult(error=failed[a])
    return a, results
