"""Peak activation memory of the cost model, split by component.

Shape notation as in :mod:`attnlab.analysis.cost`. In training the bytes are the tensors
autograd keeps for the backward pass (:func:`~attnlab.analysis.cost_layers.layer_saved`,
tensor by tensor), plus the transient gradients at the start of the backward pass; with
gradient checkpointing only each layer's input is kept and one layer is recomputed at a
time (Chen et al., 2016). In inference: the largest set of tensors alive at once inside
one layer.
"""

from __future__ import annotations

from attnlab.analysis.arch import ArchSpec
from attnlab.analysis.cost_attention import LayerGroup
from attnlab.analysis.cost_layers import (
    BACKEND_TRAITS,
    TILED,
    BackendTraits,
    LayerShape,
    attention_work,
    layer_saved,
)

__all__ = ["activation_peaks", "activations"]


Group = tuple[int, ArchSpec, LayerShape, BackendTraits]


def _attention_live(spec: ArchSpec, sh: LayerShape, traits: BackendTraits, bpe: int) -> float:
    """Inference: bytes alive in one layer's attention (scores and projections)."""
    t = sh.b * sh.lq
    _, _, pairs = attention_work(spec, sh, traits, spec.causal)
    score_bpe = 4 if bpe < 4 and traits.materialises_scores else bpe
    attn = traits.score_tensors_live * pairs * score_bpe
    return attn + t * (spec.q_dim + 2 * spec.kv_dim) * bpe * (
        2 if traits.materialises_scores else 1
    )


def _transient(
    spec: ArchSpec,
    sh: LayerShape,
    traits: BackendTraits,
    saved: dict[str, float],
    bpe: int,
    checkpointing: bool,
) -> float:
    """Bytes alive at the start of one layer's backward pass beyond what it saved: the
    gradient of the scores and weights (materialised) or a few hidden-sized gradients."""
    t = sh.b * sh.lq
    d, f = spec.hidden_size, spec.intermediate_size
    if "softmax" in saved:
        full_pairs = sh.b * spec.num_heads * sh.lq * sh.s
        return (
            traits.transient_score_tensors * full_pairs * (4 if bpe < 4 else bpe) + 4 * t * d * bpe
        )
    # with checkpointing, also the recomputed layer's feed-forward intermediate
    return 4 * t * d * bpe + (t * f * bpe if checkpointing else 0)


def activations(
    spec: ArchSpec,
    sh: LayerShape,
    traits: BackendTraits,
    bpe: int,
    mode: str,
    n_layers: int,
    *,
    checkpointing: bool,
    head_tokens: int,
    extra: tuple[tuple[int, ArchSpec, LayerShape, bool], ...] = (),
    others: tuple[Group, ...] = (),
) -> tuple[float, dict[str, float]]:
    """Peak activation bytes and their split by component.

    ``spec``, ``sh`` and ``traits`` describe the layers; ``n_layers`` counts them all.
    ``others`` are the other groups of a mixed layout (``(count, spec, shape, traits)``:
    Gemma's global layers beside its local ones), ``spec``'s group holding the rest.
    ``extra`` adds other layer kinds kept for the backward pass: ``(count, spec, shape,
    with_ffn)`` (an encoder-decoder's encoder layers and cross-attention sublayers).
    """
    groups: list[Group] = [(n_layers - sum(o[0] for o in others), spec, sh, traits), *others]
    t = sh.b * sh.lq
    d, f, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    comps: dict[str, float] = {}
    if mode != "training":
        # Inference: the largest set of tensors alive at once inside one layer.
        hidden = 2 * t * d * bpe  # residual stream + sublayer output
        attn = max(_attention_live(g_spec, g_sh, g_tr, bpe) for _, g_spec, g_sh, g_tr in groups)
        n_mats = 3 if spec.ffn == "gated" else 2
        ffn = t * f * bpe * (n_mats)
        logits = float(head_tokens * v * bpe) if spec.lm_head else 0.0
        peak = hidden + max(attn, ffn, logits)
        comps = {"attention_scores": hidden + attn if attn >= ffn else hidden, "feed_forward": 0.0}
        if ffn > attn:
            comps = {"feed_forward": hidden + ffn}
        if logits > max(attn, ffn):
            comps = {"lm_head": hidden + logits}
        return peak, comps
    per_group: list[tuple[int, dict[str, float], float]] = []  # (count, saved, transient)
    for count, g_spec, g_sh, g_tr in groups:
        per_layer = layer_saved(g_spec, g_sh, g_tr, bpe, training=True)
        for x_count, x_spec, x_shape, with_ffn in extra:
            x_saved = layer_saved(x_spec, x_shape, g_tr, bpe, training=True)
            if not with_ffn:
                x_saved.pop("feed_forward")
            for name, b in x_saved.items():
                per_layer[name] = per_layer.get(name, 0.0) + b * x_count / n_layers
        transient = _transient(g_spec, g_sh, g_tr, per_layer, bpe, checkpointing)
        per_group.append((count, per_layer, transient))
    # embeddings: the norm's input and the output (the first layer's input)
    emb = float(2 * t * d * bpe if spec.embedding_norm else t * d * bpe)
    if spec.hidden_dropout > 0:
        emb += t * d * bpe  # the embedding dropout's mask
    # a cross-entropy loss over every position keeps the logits and the log-probabilities,
    # and the backward starts with two gradients of that size
    logits = logits_grad = 0.0
    if spec.lm_head:
        logits = logits_grad = head_tokens * v * bpe * 2.0
    transient = max(tr for _, _, tr in per_group)
    if checkpointing:
        # every layer's input is kept; one layer (the largest) is recomputed at a time
        kept = n_layers * t * d * bpe
        _, largest, _ = max(per_group, key=lambda g: sum(g[1].values()))
        saved = kept + sum(largest.values())
        comps = {"norms": kept}
        for name, b in largest.items():
            comps[name] = comps.get(name, 0.0) + b
    else:
        saved = 0.0
        for count, per_layer, _ in per_group:
            saved += count * sum(per_layer.values())
            for name, b in per_layer.items():
                comps[name] = comps.get(name, 0.0) + count * b
    comps["embeddings"] = emb
    if logits:
        comps["lm_head"] = logits
    # the LM head's gradients come first and are freed before the layers' backward begins
    peak = saved + emb + logits + max(transient, logits_grad)
    if transient >= logits_grad:
        comps["attention_scores"] = comps.get("attention_scores", 0.0) + transient
    else:
        comps["lm_head"] = comps.get("lm_head", 0.0) + logits_grad
    return peak, comps


def activation_peaks(
    groups: list[LayerGroup],
    bpe: int,
    mode: str,
    n_layers: int,
    *,
    checkpointing: bool,
    head_tokens: int,
    extra: tuple[tuple[int, ArchSpec, LayerShape, bool], ...] = (),
    mixed: bool = True,
) -> tuple[dict[str, int], float, dict[str, float]]:
    """The peak for the chosen backends, and for a materialising and a tiled one.

    Args:
        groups: the window groups of self-attention layers, the first the main one.
        bpe, mode, n_layers, checkpointing, head_tokens, extra: as :func:`activations`
            (``checkpointing`` as chosen: it applies in training only).
        mixed: cost the other groups as their own (False: an encoder-decoder, whose
            decoder is costed as its first group).

    Returns:
        ``(variants, peak, by component)``: ``variants`` maps ``materialised``/``tiled``
        (training: also with ``+checkpointing``) to their peaks, for comparison.
    """
    main = groups[0]
    training = mode == "training"

    def peak(traits: BackendTraits | None, ckpt: bool) -> tuple[float, dict[str, float]]:
        others = tuple((g.count, g.spec, g.shape, traits or g.traits) for g in groups[1:] if mixed)
        return activations(
            main.spec,
            main.shape,
            traits or main.traits,
            bpe,
            mode,
            n_layers,
            checkpointing=ckpt,
            head_tokens=head_tokens,
            extra=extra,
            others=others,
        )

    variants: dict[str, int] = {}
    for label, tr in (("materialised", BACKEND_TRAITS["reference"]), ("tiled", TILED)):
        for ckpt in (False, True) if training else (False,):
            variants[label + ("+checkpointing" if ckpt else "")] = int(peak(tr, ckpt)[0])
    act, comps = peak(None, checkpointing and training)
    return variants, act, comps
