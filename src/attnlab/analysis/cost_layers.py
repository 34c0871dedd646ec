"""Per-layer cost formulas of the cost model, and how each attention backend spends work.

Shape notation as in :mod:`attnlab.analysis.cost` (``B`` batch, ``L`` queries, ``S``
keys, ``D`` width, ``H``/``H_kv`` heads, ``E`` head dim, ``F`` feed-forward width,
``T = B * L`` tokens).

* :data:`BACKEND_TRAITS`: the backends' own record (:mod:`attnlab.backend_traits`):
  whether a backend builds the score matrix, which masked work it skips (and at which
  tile size), what it saves for the backward pass;
* :func:`parameter_count` of an :class:`~attnlab.analysis.arch.ArchSpec`;
* the density of causal and windowed masks in closed form, the pairs a tiled kernel
  computes, the slots attnlab's growing KV cache holds;
* :func:`layer_flops` and :func:`layer_saved`: one layer's forward FLOPs and the bytes
  it keeps for the backward pass, tensor by tensor for attnlab's modules.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnlab.analysis.arch import ArchSpec
from attnlab.backend_traits import TRAITS, BackendTraits
from attnlab.counting import FAR, band_pairs, band_tile_pairs

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


#: How each backend spends work and memory: the backends' own torch-free record.
BACKEND_TRAITS = TRAITS

# a tiled kernel that never falls back to the math path (the "tiled" activation variant)
TILED = BackendTraits(skips="pattern", backward_factor=2.5)


def register_backend_traits(name: str, traits: BackendTraits) -> None:
    """Tell the cost model (and the backends' record) how a (new) backend spends work and memory."""
    TRAITS[name] = traits


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
    ``max(0, p - window + 1) .. min(p, kv_len - 1)``: the band
    :func:`~attnlab.counting.band_pairs` counts exactly, O(1) in the lengths.
    """
    pairs = band_pairs(window - 1, 0, q_offset, q_offset + q_len - 1, 0, kv_len - 1)
    return pairs / (q_len * kv_len)


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
    """Fraction of pairs a causal mask keeps (queries at ``q_offset ..``), in closed form."""
    return band_pairs(FAR, 0, q_offset, q_offset + q_len - 1, 0, kv_len - 1) / (q_len * kv_len)


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
    two_sided: bool = False  # the window is bidirectional: window // 2 keys on each side
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

    A tile is computed whole when the mask keeps any pair in it. In closed form for the
    causal band and windows (:func:`~attnlab.counting.band_tile_pairs`):
    O(1) in the length, exact, no tensors.
    """
    if not sh.causal and sh.window is None:
        return float(sh.lq * sh.s)
    # keys are stored at positions 0..S-1 except for a rolling cache, whose S keys end at
    # the last query: shift positions so that the last query sits at S - 1
    shift = min(0, sh.s - (sh.q_offset + sh.lq))
    left = sh.window - 1 if sh.window is not None else FAR
    right = 0
    if sh.two_sided and sh.window is not None:
        left = right = sh.window // 2
    return float(band_tile_pairs(left, right, sh.q_offset + shift, sh.lq, sh.s, block_q, block_k))


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
