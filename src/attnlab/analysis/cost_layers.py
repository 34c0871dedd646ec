"""Per-layer cost formulas of the cost model, and how each attention backend spends work.

Shape notation as in :mod:`attnlab.analysis.cost` (``B`` batch, ``L`` queries, ``S``
keys, ``D`` width, ``H``/``H_kv`` heads, ``E`` head dim, ``F`` feed-forward width,
``T = B * L`` tokens).

* :data:`BACKEND_TRAITS`: whether a backend builds the score matrix, which masked work
  it skips (and at which tile size), what it saves for the backward pass;
* :func:`parameter_count` of an :class:`~attnlab.analysis.arch.ArchSpec`;
* the density of causal and windowed masks in closed form, the pairs a tiled kernel
  computes, the slots attnlab's growing KV cache holds;
* :func:`layer_flops` and :func:`layer_saved`: one layer's forward FLOPs and the bytes
  it keeps for the backward pass, tensor by tensor for attnlab's modules.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

from attnlab.analysis.arch import ArchSpec

__all__ = [
    "BACKEND_TRAITS",
    "ELEMENTWISE_FLOPS",
    "TILED",
    "BackendTraits",
    "LayerShape",
    "activation_flops",
    "attention_work",
    "causal_density",
    "dynamic_slots",
    "layer_flops",
    "layer_saved",
    "parameter_count",
    "register_backend_traits",
    "tile_pairs",
    "traits_of",
    "window_density",
]


#: Element-wise FLOPs per element, the estimates used for ``flops - matmul_flops``.
ELEMENTWISE_FLOPS: dict[str, int] = {
    "softmax": 5,  # max, subtract, exp, sum, divide
    "scale": 1,  # scores * 1/sqrt(E)
    "mask": 1,  # add or select
    "layernorm": 7,  # mean, subtract, square, mean, rsqrt-multiply, affine (2)
    "rmsnorm": 4,  # square, mean, rsqrt-multiply, weight
    "residual": 1,
    "gelu": 8,
    "gelu_new": 8,
    "gelu_tanh": 8,
    "gelu_pytorch_tanh": 8,
    "relu": 1,
    "silu": 4,
    "swish": 4,
    "gate": 1,  # the elementwise product of a gated feed-forward
    "rope": 3,  # rotate-half: two multiplies and an add per element of q and k
    "embedding_add": 1,
}


@dataclass(frozen=True)
class BackendTraits:
    """How an attention backend spends work and memory, for the cost model.

    Attributes:
        materialises_scores: builds the ``L x S`` score matrix (and saves it for backward).
        skips: which masked work it skips: ``"none"`` (computes every pair),
            ``"causal"`` (only a causal mask, passed as ``is_causal``), ``"pattern"``
            (any structured mask, at tile granularity).
        score_tensors_saved: score-sized tensors saved for the backward pass (training).
        score_tensors_live: score-sized tensors alive at once in an inference forward.
        backward_factor: backward attention matmuls as a multiple of the forward's.
        dropout_score_tensors: score-sized tensors saved when attention dropout is on in
            training (None: as without dropout). torch's fused CPU kernels fall back to
            the math path with dropout, which saves the weights, the dropout mask (float
            on CPU) and the dropped weights.
        transient_score_tensors: score-sized gradients alive at once at the peak of the
            backward of a materialised attention (the reference's composite softmax makes
            about 3; torch's math path about 1).
        block: ``(block_q, block_k)`` tile of a tile-skipping kernel: masked work is
            skipped per tile, so the pairs computed are counted per tile (None: exactly
            the pattern's density).
        linear: kernelised linear attention (no score matrix at all; Katharopoulos et al., 2020).
        description: one line for reports.
    """

    materialises_scores: bool
    skips: Literal["none", "causal", "pattern"]
    score_tensors_saved: float = 0.0
    score_tensors_live: float = 0.0
    backward_factor: float = 2.0
    linear: bool = False
    dropout_score_tensors: float | None = None
    transient_score_tensors: float = 3.0
    block: tuple[int, int] | None = None
    description: str = ""


#: Traits of the backends the library registers; others fall back to "sdpa"'s.
BACKEND_TRAITS: dict[str, BackendTraits] = {
    # sdpa_reference saves, per layer: the scaled scores (amax's input), exp(scores)
    # and the normalised weights (matmul's input); all three are alive in a forward too.
    "reference": BackendTraits(
        materialises_scores=True,
        skips="none",
        score_tensors_saved=3.0,
        score_tensors_live=3.0,
        dropout_score_tensors=4.0,
        description="full score matrix (float32), every pair computed",
    ),
    # torch's CPU flash kernel: saves q, k, v, out and the logsumexp; skips causal tiles.
    "sdpa": BackendTraits(
        materialises_scores=False,
        skips="causal",
        backward_factor=2.5,
        dropout_score_tensors=3.0,
        transient_score_tensors=1.0,
        description="torch's fused kernel: tiles, skips causal blocks, recomputes in backward",
    ),
    # issue 4's backends: tiles in PyTorch (FlashAttention-2), gathered key blocks,
    # compiled FlexAttention: none builds L x S, all skip the tiles a pattern masks out
    "tiled": BackendTraits(
        materialises_scores=False,
        skips="pattern",
        backward_factor=2.5,
        block=(256, 256),
        description="FlashAttention-2 tiles: skips masked tiles, saves a logsumexp per row",
    ),
    "sparse": BackendTraits(
        materialises_scores=False,
        skips="pattern",
        backward_factor=2.5,
        block=(64, 64),
        description="gathered key blocks per query block: about L x window pairs",
    ),
    "flex": BackendTraits(
        materialises_scores=False,
        skips="pattern",
        backward_factor=2.5,
        block=(128, 128),
        description="compiled FlexAttention with a block mask",
    ),
    "linear": BackendTraits(
        materialises_scores=False,
        skips="none",
        linear=True,
        description="kernelised linear attention: O(L E^2), no score matrix (approximate)",
    ),
}


# a tiled kernel that never falls back to the math path (the "tiled" activation variant)
TILED = BackendTraits(materialises_scores=False, skips="pattern", backward_factor=2.5)


def register_backend_traits(name: str, traits: BackendTraits) -> None:
    """Tell the cost model how a (new) backend spends work and memory."""
    BACKEND_TRAITS[name] = traits


def parameter_count(spec: ArchSpec) -> int:
    """Parameters of the model ``spec`` describes (weights and biases, not buffers)."""
    d, f, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    norm = 2 * d if spec.norm == "layernorm" else d
    attn = d * spec.q_dim + 2 * d * spec.kv_dim + spec.q_dim * d
    if spec.attention_bias:
        attn += spec.q_dim + 2 * spec.kv_dim
    if spec.attention_out_bias:
        attn += d
    n_mats = 3 if spec.ffn == "gated" else 2
    ffn = n_mats * d * f + ((n_mats - 1) * f + d if spec.mlp_bias else 0)
    layer = attn + ffn + 2 * norm
    # an encoder-decoder's decoder layer adds cross-attention and its norm
    dec_layer = layer + attn + norm
    total = spec.num_layers * layer + spec.num_decoder_layers * dec_layer
    if spec.moe is not None:
        from attnlab.analysis.moe_cost import moe_layer_parameters  # imports this module

        total += spec.moe.num_layers * (moe_layer_parameters(d, spec.moe) - ffn)
    total += v * d
    if spec.learned_positions and spec.max_positions:
        total += spec.max_positions * d
    total += spec.type_vocab_size * d
    total += norm * (int(spec.embedding_norm) + int(spec.final_norm))
    if spec.num_decoder_layers and spec.final_norm:
        total += norm  # the decoder stack's final norm (the encoder's is counted above)
    total += spec.extra_parameters
    if spec.lm_head and not spec.tied_embeddings:
        total += v * d
    if spec.pooler:
        total += d * d + d
    return total


def window_density(window: int, q_len: int, kv_len: int, q_offset: int) -> float:
    """Fraction of (query, key) pairs a causal window of ``window`` keys keeps, in closed form.

    Query ``i`` sits at position ``p = q_offset + i`` and sees keys
    ``max(0, p - window + 1) .. min(p, kv_len - 1)``. The count is piecewise linear in
    ``p`` with breaks at ``window - 1``, ``kv_len - 1`` and ``kv_len + window - 1``, so each
    piece sums as an arithmetic series: O(1), whatever the lengths.
    """

    def seen(p: int) -> int:
        return max(0, min(p, kv_len - 1) - max(0, p - window + 1) + 1)

    lo, hi = q_offset, q_offset + q_len - 1
    cuts = sorted({lo, hi + 1, *(c for c in (window, kv_len, kv_len + window) if lo < c <= hi)})
    total = 0
    for a, b1 in itertools.pairwise(cuts):
        b = b1 - 1  # the piece is p in [a, b], linear there
        total += (seen(a) + seen(b)) * (b - a + 1) // 2
    return total / (q_len * kv_len)


def dynamic_slots(prefill: int, new: int, capacity: int) -> int:
    """Slots a growing cache holds after a prefill of ``prefill`` tokens and ``new`` more.

    Mirrors ``DynamicKVCache._grow``: a write that does not fit reallocates to
    ``max(needed, capacity, 2 * current)``.
    """
    size = max(prefill, capacity)
    if size < prefill + new:
        size = max(prefill + new, capacity, 2 * size)
    return size


def causal_density(q_len: int, kv_len: int, q_offset: int) -> float:
    return window_density(q_len + kv_len + q_offset + 1, q_len, kv_len, q_offset)


def traits_of(backend: str) -> BackendTraits:
    return BACKEND_TRAITS.get(backend, BACKEND_TRAITS["sdpa"])


def activation_flops(activation: str) -> int:
    return ELEMENTWISE_FLOPS.get(activation, 8)


@dataclass
class LayerShape:
    b: int  # batch
    lq: int  # queries per sequence
    s: int  # keys per query (stored)
    density: float  # fraction of the L x S pairs attended
    cross: bool = False  # cross-attention: keys come from another sequence
    kv_new: int | None = None  # tokens per sequence whose keys/values are projected (default lq)
    # the structure, for tile counts: causal, a causal window of W keys, first query's position
    causal: bool = False
    window: int | None = None
    q_offset: int = 0
    structured: bool = True  # False when an arbitrary pattern (known by its density) is used


def attention_work(
    spec: ArchSpec, sh: LayerShape, traits: BackendTraits, causal_flag: bool
) -> tuple[float, float, float]:
    """(score-matmul FLOPs, weights·V FLOPs, score elements) executed by the backend."""
    b, h, e = sh.b, spec.num_heads, spec.head_dim
    if traits.linear:
        # phi(K)^T V: 2 S E E per head; phi(Q) (KV): 2 L E E; normaliser 2 L E
        kv = 2.0 * b * h * sh.s * e * e
        q = 2.0 * b * h * sh.lq * e * e + 2.0 * b * h * sh.lq * e
        return kv, q, 0.0
    pairs = float(b * h * sh.lq * sh.s)
    if traits.skips == "pattern":
        if traits.block is not None and sh.structured:
            pairs = float(b * h) * tile_pairs(sh, *traits.block)
        else:
            pairs *= sh.density
    elif traits.skips == "causal" and causal_flag and sh.window is None and sh.structured:
        # a fused kernel given is_causal alone skips the upper triangle; any other mask
        # arrives dense and every pair is computed
        pairs *= sh.density
    return 2.0 * pairs * e, 2.0 * pairs * e, pairs


def tile_pairs(sh: LayerShape, block_q: int, block_k: int) -> float:
    """(query, key) pairs per head a kernel with ``block_q x block_k`` tiles computes.

    A tile is computed whole when the mask keeps any pair in it: for each query block,
    the key blocks between its first row's lowest key and its last row's highest key.
    O(L / block_q) steps, no tensors.
    """
    if not sh.causal and sh.window is None:
        return float(sh.lq * sh.s)
    # keys are stored at positions 0..S-1 except for a rolling cache, whose S keys end at
    # the last query: shift positions so that the last query sits at S - 1
    shift = min(0, sh.s - (sh.q_offset + sh.lq))
    total = 0.0
    for q0 in range(0, sh.lq, block_q):
        q1 = min(sh.lq, q0 + block_q)
        first, last = sh.q_offset + q0 + shift, sh.q_offset + q1 - 1 + shift
        lo = max(0, first - sh.window + 1) if sh.window is not None else 0
        hi = min(last, sh.s - 1)
        if lo > hi:
            continue
        k0 = (lo // block_k) * block_k
        k1 = min(sh.s, (hi // block_k + 1) * block_k)
        total += (q1 - q0) * (k1 - k0)
    return total


def layer_saved(
    spec: ArchSpec, sh: LayerShape, traits: BackendTraits, bpe: int, training: bool
) -> dict[str, float]:
    """Bytes one layer's sublayers keep for the backward pass, by component.

    Counted for attnlab's modules (MultiHeadAttention, FeedForward, norms): a Linear saves
    its input; the reference attention saves q, kᵀ and v as contiguous copies (batched
    matmul of transposed views), the score-sized tensors of ``traits`` and the
    concatenated heads before ``out_proj``; a tiled backend saves q, k, v, out and a
    logsumexp per row; GELU saves its input, the next Linear the activation's output;
    a norm saves its input.
    """
    t = sh.b * sh.lq  # query tokens
    tk = sh.b * sh.s  # key tokens (cross-attention: from the other sequence)
    d, f = spec.hidden_size, spec.intermediate_size
    rep = spec.num_heads // spec.num_kv_heads
    out: dict[str, float] = {}
    n_scores = traits.score_tensors_saved
    if training and spec.attention_dropout > 0 and traits.dropout_score_tensors is not None:
        n_scores = traits.dropout_score_tensors
    # the layer's input, saved once for the q, k and v projections that all read it
    proj = float(t * d)
    if n_scores:
        # contiguous copies of q, kᵀ and v (k and v repeated to H heads for GQA), the
        # score-sized tensors in float32, the concatenated heads before out_proj
        score_bpe = 4 if bpe < 4 else bpe
        proj += t * spec.q_dim + 2 * tk * spec.kv_dim * rep + t * spec.q_dim
        _, _, pairs = attention_work(spec, sh, BACKEND_TRAITS["reference"], False)
        out["attention_scores"] = pairs * score_bpe * (n_scores - 1)
        out["softmax"] = pairs * score_bpe * 1.0
    else:
        # q, k, v (views of the projections' outputs), out, logsumexp (float32)
        proj += t * spec.q_dim + 2 * tk * spec.kv_dim + t * spec.q_dim
        out["attention_v"] = sh.b * spec.num_heads * sh.lq * 4.0
    out["projections"] = proj * bpe
    n_mats = 3 if spec.ffn == "gated" else 2
    # input of fc_in (shared with the norm's output), fc_in output(s), activation output
    ffn = t * d + (n_mats - 1) * t * f + t * f
    if spec.ffn == "gated":
        ffn += t * f  # the gate's activation output and the product
    out["feed_forward"] = ffn * bpe
    norms = 2 * t * d  # each sublayer's norm input
    if training and spec.hidden_dropout > 0:
        norms += 2 * t * d  # the two sublayer dropouts' masks (float on CPU)
    out["norms"] = norms * bpe
    return out


def layer_flops(
    spec: ArchSpec, sh: LayerShape, traits: BackendTraits, *, masked: bool
) -> dict[str, tuple[float, float]]:
    """Forward (matmul, element-wise) FLOPs of one layer's self- or cross-attention + FFN."""
    t = sh.b * sh.lq
    # keys/values are projected for the new tokens only; a cache holds the others
    tk = sh.b * (sh.lq if sh.kv_new is None else sh.kv_new)
    d, f = spec.hidden_size, spec.intermediate_size
    q_proj = 2.0 * t * d * spec.q_dim
    kv_proj = 2.0 * tk * d * 2 * spec.kv_dim
    o_proj = 2.0 * t * spec.q_dim * d
    qk, av, pairs = attention_work(spec, sh, traits, spec.causal and not sh.cross)
    ew = ELEMENTWISE_FLOPS
    soft = pairs * (ew["softmax"] + ew["scale"] + (ew["mask"] if masked else 0))
    if spec.position == "rope" and not sh.cross:
        soft += ew["rope"] * (t * spec.q_dim + tk * spec.kv_dim)
    n_mats = 3 if spec.ffn == "gated" else 2
    ffn_mm = 2.0 * t * d * f * n_mats
    ffn_ew: float = (
        t * f * (activation_flops(spec.activation) + (ew["gate"] if spec.ffn == "gated" else 0))
    )
    if spec.moe is not None and not sh.cross:
        from attnlab.analysis.moe_cost import moe_layer_flops  # imports this module

        # the per-layer average over dense and MoE layers (the caller multiplies by layers)
        share = spec.moe.num_layers / spec.num_layers
        moe_mm, moe_ew = moe_layer_flops(t, d, spec.moe)
        ffn_mm = (1 - share) * ffn_mm + share * moe_mm
        ffn_ew = (1 - share) * ffn_ew + share * moe_ew
    norm_ew = 2 * t * d * (ew[spec.norm] + ew["residual"])
    return {
        "projections": (q_proj + kv_proj + o_proj, 0.0),
        "attention_scores": (qk, 0.0),
        "softmax": (0.0, soft),
        "attention_v": (av, 0.0),
        "feed_forward": (ffn_mm, ffn_ew),
        "norms": (0.0, norm_ew),
    }
