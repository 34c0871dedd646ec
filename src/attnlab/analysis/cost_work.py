"""The work term of the cost model: FLOPs per component, forward and backward.

Shape notation and counting conventions as in :mod:`attnlab.analysis.cost`. A
:class:`Work` sums what the layers and the head add, scaled for training by the backward
pass (2x the forward's matmuls, the backend's own factor for attention, one more forward
per layer with checkpointing); :func:`stack_work` adds the layers of a decoder, encoder
or encoder-decoder stack, :func:`head_work` the embeddings, final norm, LM head and pooler.
"""

from __future__ import annotations

from attnlab.analysis.arch import ArchSpec
from attnlab.analysis.cost_attention import LayerGroup
from attnlab.analysis.cost_layers import (
    ELEMENTWISE_FLOPS,
    BackendTraits,
    LayerShape,
    layer_flops,
)
from attnlab.analysis.cost_report import ComponentCost

__all__ = ["COMPONENTS", "Work", "backward_factor", "head_work", "stack_work"]

COMPONENTS = (
    "embeddings",
    "projections",
    "attention_scores",
    "softmax",
    "attention_v",
    "feed_forward",
    "norms",
    "lm_head",
    "pooler",
)

#: ``(layers, spec, shape, is the encoder)`` of an encoder-decoder's stacks beside the
#: decoder's self-attention, for the activation peak.
Extra = tuple[tuple[int, ArchSpec, LayerShape, bool], ...]


def backward_factor(component: str, traits: BackendTraits, checkpointing: bool) -> float:
    """The backward pass's FLOPs over the forward's, for one component."""
    attn = component in ("attention_scores", "attention_v")
    factor = traits.backward_factor if attn else 2.0
    if checkpointing and component not in ("lm_head", "pooler", "embeddings"):
        factor += 1.0  # the forward of each layer runs again during backward
    return factor


class Work:
    """FLOPs per component for one mode, summed as parts are added.

    Args:
        training: scale each part by its backward pass.
        checkpointing: the backward recomputes each layer's forward.
        masked: a mask is applied (its FLOPs are counted, except on cross-attention).
    """

    def __init__(self, *, training: bool, checkpointing: bool, masked: bool) -> None:
        self.training = training
        self.checkpointing = checkpointing
        self.masked = masked
        self.by_component: dict[str, ComponentCost] = {c: ComponentCost() for c in COMPONENTS}
        self.forward_matmul_flops = 0.0

    def add(self, component: str, mm: float, ew: float, traits: BackendTraits) -> None:
        """``mm`` matmul and ``ew`` element-wise FLOPs of one forward of ``component``."""
        self.forward_matmul_flops += mm
        scale = (
            1.0 + backward_factor(component, traits, self.checkpointing) if self.training else 1.0
        )
        self.by_component[component].add(mm=mm * scale, ew=ew * scale)

    def add_layers(self, n: int, spec: ArchSpec, shape: LayerShape, traits: BackendTraits) -> None:
        """``n`` layers of one shape (a cross-attention layer has no feed-forward)."""
        per = layer_flops(spec, shape, traits, masked=self.masked and not shape.cross)
        if shape.cross:
            per.pop("feed_forward")
        for comp, (mm, ew) in per.items():
            self.add(comp, n * mm, n * ew, traits)


def stack_work(
    work: Work,
    spec: ArchSpec,
    groups: list[LayerGroup],
    *,
    batch_size: int,
    seq_len: int,
    decode: bool,
) -> tuple[int, Extra]:
    """Add the layers' work; returns the self-attention layers and the other stacks.

    A decoder (or encoder) adds each window group's layers. An encoder-decoder adds its
    bidirectional encoder (not while decoding: its output is cached), and the decoder's
    self-attention and cross-attention layers (the encoder output projected once per
    sequence, cached while decoding).
    """
    main = groups[0]
    if spec.num_decoder_layers == 0:
        for g in groups:
            work.add_layers(g.count, g.spec, g.shape, g.traits)
        return spec.num_layers, ()
    enc_shape = LayerShape(b=batch_size, lq=seq_len, s=seq_len, density=1.0)
    if not decode:
        work.add_layers(spec.num_layers, spec.with_(causal=False), enc_shape, main.traits)
    cross = LayerShape(
        b=batch_size,
        lq=main.shape.lq,
        s=seq_len,
        density=1.0,
        cross=True,
        kv_new=0 if decode else seq_len,
    )
    work.add_layers(spec.num_decoder_layers, spec, main.shape, main.traits)
    work.add_layers(spec.num_decoder_layers, spec, cross, main.traits)
    extra = (
        (spec.num_layers, spec.with_(causal=False), enc_shape, True),
        (spec.num_decoder_layers, spec, cross, False),
    )
    return spec.num_decoder_layers, extra


def head_work(
    work: Work, spec: ArchSpec, traits: BackendTraits, *, tokens: int, batch: int
) -> None:
    """Add the embeddings' element-wise work, the final norm, the LM head and the pooler."""
    d, v = spec.hidden_size, spec.vocab_size
    ew = ELEMENTWISE_FLOPS
    emb_ew = (
        tokens
        * d
        * (
            ew["embedding_add"] * (int(spec.learned_positions) + int(spec.type_vocab_size > 0))
            + (ew[spec.norm] if spec.embedding_norm else 0)
        )
    )
    work.add("embeddings", 0.0, emb_ew, traits)
    if spec.final_norm:
        work.add("norms", 0.0, tokens * d * ew[spec.norm], traits)
    if spec.lm_head:
        work.add("lm_head", 2.0 * tokens * d * v, 0.0, traits)
    if spec.pooler:
        work.add("pooler", 2.0 * batch * d * d, batch * d * 8, traits)
