"""The model runner: one scheduled step -> one flat forward -> each sequence's logits.

Shape notation: ``N`` tokens of the step, ``n_s`` sequences, ``T`` the longest sequence
(cached + new tokens), ``V`` vocabulary.

The scheduler decides which tokens of which sequences run (``(seq_id, num_new)`` rows,
their blocks reserved in the :class:`~attnlab.cache.paged.manager.KVManager`); the
runner lays them out as one ``[1, N]`` row (:mod:`attnlab.models.flat`): each token's
position in its own sequence, each sequence's block table, the pool slot each new key
goes to, each sequence's recurrent-state slot, and calls the model's ``forward_flat``
once. No token of padding is computed.

Per-layer cache specs: an attention layer reads and writes the paged pool
(:class:`~attnlab.cache.paged.storage.KVStorage`, one pool per attention layer); a
recurrent layer (Mamba, Mamba-2, RWKV, RetNet, the linear mixers) holds one state slot
per sequence (:class:`~attnlab.cache.state_slots.StateSlots`). A hybrid holds both.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from attnlab.backends.plan import BlockTable, SequenceLayout
from attnlab.cache.base import LayerCache, ModelCache
from attnlab.cache.paged.block_rows import BlockRows
from attnlab.cache.paged.manager import KVManager, SeqId
from attnlab.cache.paged.pool import PagedKVPool
from attnlab.cache.recurrent import RecurrentState
from attnlab.cache.state_slots import SlotTable, StateSlots
from attnlab.models.flat import FlatBatch
from attnlab.serving.decode_buckets import DEFAULT_SIZES, DecodeBuckets
from attnlab.serving.step_buckets import PromptSteps

__all__ = ["FlatRow", "ModelRunner", "flat_inputs", "layer_specs", "pool_for"]

#: The ranges of decode rows beside prompts that :meth:`ModelRunner.step_kind` names.
_ROW_RANGES = ((1, 8), (9, 16), (17, 32))

#: One row of a flat step: ``(start, tokens, blocks)``: ``tokens`` run from position
#: ``start`` of a sequence whose KV lives in ``blocks`` (its block ids, in order).
FlatRow = tuple[int, Sequence[int], Sequence[int]]


def flat_inputs(
    rows: Sequence[FlatRow],
    *,
    block_size: int,
    blocks: BlockTable | None,
    keep: Sequence[int] | None = None,
    state_slots: Tensor | None = None,
    device: torch.device,
) -> tuple[Tensor, FlatBatch]:
    """``(input_ids [1, N], FlatBatch)`` of explicit rows, one forward's flat batch.

    Args:
        rows: each row's ``(start, tokens, blocks)``.
        block_size: tokens per KV block.
        blocks: the step's block tables (None for a model without attention layers: no
            KV is written).
        keep: how many of row ``i``'s last tokens give logits (default 1).
        state_slots: long ``[n_s]``, each row's recurrent state slot (or None).
        device: where the tensors go.
    """
    bs = block_size
    ids: list[int] = []
    pos: list[int] = []
    write: list[int] = []
    last: list[int] = []
    for r, (start, toks, seq_blocks) in enumerate(rows):
        n = len(toks)
        ids += toks
        pos += range(start, start + n)
        if blocks is not None:
            write += [seq_blocks[p // bs] * bs + p % bs for p in range(start, start + n)]
        k = 1 if keep is None else keep[r]
        last += range(len(ids) - k, len(ids))
    layout = SequenceLayout.from_lengths(
        [len(toks) for _, toks, _ in rows],
        blocks=blocks,
        fresh=[start == 0 for start, _, _ in rows],
        device=device,
    )

    def t(x: list[int]) -> Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    flat = FlatBatch(
        positions=t(pos)[None],
        layout=layout,
        last=t(last),
        blocks=blocks,
        write_slots=t(write) if blocks is not None else None,
        state_slots=state_slots,
    )
    return t(ids)[None], flat


def layer_specs(model: nn.Module) -> list[str]:
    """Each layer's cache spec: ``"kv"`` (attention: KV blocks) or ``"state"`` (one
    recurrent state slot per sequence).

    Raises:
        TypeError: a model the runner cannot serve (no ``forward_flat``).
    """
    if not hasattr(model, "forward_flat"):
        raise TypeError(
            f"the engine serves attnlab decoders and recurrent LMs, got {type(model).__name__}"
        )
    cache = model.new_cache()  # type: ignore[operator]
    return ["state" if isinstance(c, RecurrentState) else "kv" for c in cache.layers]


def pool_for(
    model: nn.Module,
    specs: list[str],
    *,
    num_blocks: int,
    block_size: int,
    prefix_caching: bool,
    kv_dtype: str | None = None,
) -> PagedKVPool:
    """The paged pool of ``model``'s attention layers (none for a recurrent LM: the
    blocks then only count tokens for the scheduler).

    A sliding window frees blocks behind it only when every attention layer has it.
    """
    config = model.config
    n_kv = specs.count("kv")
    p = next(model.parameters())
    windows = {w for w, spec in zip(getattr(model, "layer_windows", ()), specs) if spec == "kv"}
    return PagedKVPool(
        num_layers=n_kv,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or 1 if n_kv else 1,
        head_dim=getattr(config, "head_dim", None) or 1 if n_kv else 1,
        num_blocks=num_blocks,
        block_size=block_size,
        dtype=p.dtype,
        device=p.device,
        prefix_caching=prefix_caching,
        sliding_window=windows.pop() if len(windows) == 1 else None,
        kv_dtype=kv_dtype,
        spare_blocks=1,  # the scratch block of compiled decode buckets' padding rows
    )


def _state_maker(model: nn.Module, index: int) -> object:
    def make() -> RecurrentState:
        state = model.new_cache().layers[index]  # type: ignore[operator]
        assert isinstance(state, RecurrentState)
        return state

    return make


class ModelRunner:
    """Turns a scheduled step into one flat forward.

    Args:
        model: an attnlab decoder or recurrent LM with ``forward_flat``.
        pool: the paged pool (its manager and storage) of the attention layers.
        max_num_seqs: state slots of each recurrent layer.
    """

    def __init__(self, model: nn.Module, pool: PagedKVPool, *, max_num_seqs: int) -> None:
        self.model = model
        self.pool = pool
        self.manager: KVManager = pool.manager
        self.specs = layer_specs(model)
        self.slots = SlotTable(max_num_seqs)
        layers: list[LayerCache] = []
        attn = 0
        for i, spec in enumerate(self.specs):
            if spec == "kv":
                layers.append(pool.layers[attn])
                attn += 1
            else:
                make = _state_maker(model, i)
                layers.append(StateSlots(make=make, num_slots=max_num_seqs))  # type: ignore[arg-type]
        self.cache = ModelCache(layers=layers)
        self.has_state = "state" in self.specs
        self.has_kv = attn > 0
        self.block_rows = BlockRows(self.manager)
        #: compiled decode steps (:meth:`compile_buckets`), or None: every step eager
        self.buckets: DecodeBuckets | None = None
        #: compiled steps with prompt chunks (:meth:`compile_prefill`), or None
        self.prefill: PromptSteps | None = None
        #: steps run so far per kind (:func:`step_kind`), e.g. ``"prompts beside 9-32
        #: decode rows, compiled"``: which steps the compiled graphs take
        self.step_kinds: Counter[str] = Counter()

    def compile_buckets(
        self,
        sizes: Sequence[int] = DEFAULT_SIZES,
        *,
        max_model_len: int,
        warm: bool = True,
        pack: bool = True,
    ) -> DecodeBuckets:
        """Run decode-only steps through forwards compiled once per bucket size
        (:mod:`attnlab.serving.decode_buckets`); ``warm``: compile them all now; ``pack``:
        lay out the float linears for those sizes first (``DecodeBuckets``'s ``pack``).

        Raises:
            ValueError: a model the buckets cannot run (the reason), or bad sizes.
        """
        self.buckets = DecodeBuckets(self, sizes, max_model_len=max_model_len, pack=pack)
        if warm:
            self.buckets.warm()
        return self.buckets

    def compile_prefill(self, *, max_model_len: int, warm: bool = True) -> PromptSteps:
        """Run steps with prompt chunks (fresh or continuing, beside any number of decode
        rows) through one compiled forward (:mod:`attnlab.serving.step_buckets`);
        ``warm``: compile it now.

        Raises:
            ValueError: a model the graph cannot run (the reason).
        """
        self.prefill = PromptSteps(self, max_model_len=max_model_len)
        if warm:
            self.prefill.warm()
        return self.prefill

    # ------------------------------------------------------------------ state slots

    def fork(self, parent: SeqId, child: SeqId) -> None:
        """Give ``child`` a copy of ``parent``'s recurrent states (its KV blocks are
        shared by the manager)."""
        if not self.has_state:
            return
        src, dst = self.slots.slot(parent), self.slots.slot(child)
        for c in self.cache.layers:
            if isinstance(c, StateSlots):
                c.copy(src, dst)

    def release(self, seq_id: SeqId) -> None:
        """``seq_id`` left the pool (finished or preempted): its state slot and its
        block-table row are free."""
        self.slots.release(seq_id)
        self.block_rows.release(seq_id)

    # ------------------------------------------------------------------ the step

    def batch(
        self, rows: Sequence[tuple[SeqId, int]], keep: Sequence[int] | None = None
    ) -> tuple[Tensor, FlatBatch]:
        """``(input_ids [1, N], FlatBatch)`` of a step's rows (reserved in the manager);
        ``keep[i]``: how many of row ``i``'s last tokens give logits (default 1)."""
        m, dev = self.manager, self.pool.storage.device
        spans: list[FlatRow] = []
        totals: list[int] = []
        first: list[int] = []
        for sid, n in rows:
            s = m._seq(sid)
            spans.append((s.computed, s.tokens[s.computed : s.computed + n], s.blocks))
            totals.append(s.computed + n)
            first.append(s.first_live)
        blocks = self._blocks(rows, totals, first, dev) if self.has_kv else None
        state = (
            torch.tensor([self.slots.slot(sid) for sid, _ in rows], dtype=torch.long, device=dev)
            if self.has_state
            else None
        )
        return flat_inputs(
            spans, block_size=m.block_size, blocks=blocks, keep=keep, state_slots=state, device=dev
        )

    def _blocks(
        self,
        rows: Sequence[tuple[SeqId, int]],
        totals: list[int],
        first: list[int],
        dev: torch.device,
    ) -> BlockTable:
        """The step's block tables ``[n_s, nb]``: the rows :class:`BlockRows` keeps per
        sequence (synced in the blocks that changed), cut to the step's longest row."""
        bs = self.manager.block_size
        nb = -(-max(totals) // bs)
        idx = torch.tensor(self.block_rows.rows([sid for sid, _ in rows]), dtype=torch.long)
        table = self.block_rows.table[:, :nb].index_select(0, idx)
        # (a backend that reads gathered keys gets their slots from ``gather_index()``)
        return BlockTable(
            table=table.to(dev),
            block_size=bs,
            lengths=tuple(totals),
            offsets=(0,) * len(totals),
            first_block=tuple(first),
        )

    def step_kind(
        self, rows: Sequence[tuple[SeqId, int]], keep: Sequence[int] | None = None
    ) -> str:
        """What a step carries: ``"decode"`` (one token per row), ``"drafts"`` (a row
        verifies speculative tokens), else ``"fresh prompts"`` (every chunk starts its
        sequence) or ``"continuing prompts"`` (a chunk after computed tokens: a prefix
        hit or a second chunk), with ``"beside D decode rows"`` in ranges 0, 1-8, 9-16,
        17-32, 33+."""
        if keep is not None and any(k != 1 for k in keep):
            return "drafts"
        m = self.manager
        computed = [m.num_computed(sid) for sid, _ in rows]
        decode = sum(1 for (_, n), c in zip(rows, computed) if n == 1 and c > 0)
        if decode == len(rows):
            return "decode"
        fresh = all(c == 0 for (_, n), c in zip(rows, computed) if n > 1 or c == 0)
        what = "fresh prompts" if fresh else "continuing prompts"
        near = next((f"{lo}-{hi}" for lo, hi in _ROW_RANGES if decode <= hi), "33+")
        near = "0" if decode == 0 else near
        return f"{what} beside {near} decode rows"

    def run(self, rows: Sequence[tuple[SeqId, int]], keep: Sequence[int] | None = None) -> Tensor:
        """One forward over the step's rows: logits ``[n_s, V]`` of each row's last token
        (``[sum(keep), V]``: of each row's last ``keep[i]`` tokens, the drafts a
        speculative row verifies).

        The caller commits the rows' tokens in the manager after (``KVManager.commit``).
        """
        kind = self.step_kind(rows, keep)
        if keep is None or all(k == 1 for k in keep):
            for compiled in (self.buckets, self.prefill):
                out = compiled.run(rows) if compiled is not None else None
                if out is not None:
                    self.step_kinds[f"{kind}, compiled"] += 1
                    return out
        self.step_kinds[f"{kind}, eager"] += 1
        ids, flat = self.batch(rows, keep)
        logits: Tensor = self.model.forward_flat(ids, flat, self.cache)  # type: ignore[operator]
        return logits
