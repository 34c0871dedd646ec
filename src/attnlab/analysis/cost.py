"""A cost model of Transformer attention models: FLOPs and bytes per component, by arithmetic.

Shape notation: ``B`` batch, ``L`` query tokens per sequence, ``S`` keys per query,
``D`` width, ``H``/``H_kv`` query/key-value heads, ``E`` head dim, ``F`` feed-forward
width, ``V`` vocabulary, ``N`` layers; ``T = B * L`` tokens.

Counting conventions (Kaplan et al., 2020, "Scaling laws", table 1; Korthikanti et al.,
2022, "Reducing activation recomputation in large transformer models", sec. 4):

* a ``[m, k] @ [k, n]`` matmul is ``2 m k n`` FLOPs; these are ``matmul_flops``, the part
  that ``torch.utils.flop_counter.FlopCounterMode`` counts;
* element-wise work (softmax, norms, activations, residual adds, scaling) is counted
  separately in ``flops - matmul_flops`` with per-element costs named in
  :data:`ELEMENTWISE_FLOPS` (estimates: a counter would see 0 of them);
* attention's quadratic term is ``4 B H L S E`` per layer executed (QKᵀ and weights·V);
  a backend that skips masked tiles (causal, windows, sparse patterns) executes only the
  pattern's density of it, one that builds the whole score matrix executes all of it;
* the backward pass costs 2x the forward's matmuls (gradients of inputs and weights);
  a tiled (FlashAttention) backward recomputes QKᵀ: 2.5x for the attention matmuls
  (Dao, 2023, "FlashAttention-2", sec. 3.1);
* activation bytes in training are the tensors autograd saves for the backward pass of
  attnlab's modules, counted tensor by tensor (see :func:`_layer_saved`), plus the
  transient gradients at the start of the backward pass; with gradient checkpointing
  only each layer's input is kept and one layer is recomputed at a time (Chen et al.,
  2016, "Training deep nets with sublinear memory cost").

Nothing here runs a model: :func:`estimate` is arithmetic on an
:class:`~attnlab.analysis.arch.ArchSpec`, fast enough to sweep thousands of shapes.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from attnlab.analysis.arch import ArchSpec, describe

__all__ = [
    "BACKEND_TRAITS",
    "ELEMENTWISE_FLOPS",
    "BackendTraits",
    "ComponentCost",
    "CostReport",
    "dtype_bytes",
    "estimate",
    "register_backend_traits",
]

Mode = Literal["inference", "training", "decode"]

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
        description="torch's fused kernel: tiles, skips causal blocks, recomputes in backward",
    ),
    # issue 4's backends: tiles in PyTorch (FlashAttention-2), gathered key blocks,
    # compiled FlexAttention: none builds L x S, all skip the tiles a pattern masks out
    "tiled": BackendTraits(
        materialises_scores=False,
        skips="pattern",
        backward_factor=2.5,
        description="FlashAttention-2 tiles: skips masked tiles, saves a logsumexp per row",
    ),
    "sparse": BackendTraits(
        materialises_scores=False,
        skips="pattern",
        backward_factor=2.5,
        description="gathered key blocks per query block: about L x window pairs",
    ),
    "flex": BackendTraits(
        materialises_scores=False,
        skips="pattern",
        backward_factor=2.5,
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
_TILED = BackendTraits(materialises_scores=False, skips="pattern", backward_factor=2.5)


def register_backend_traits(name: str, traits: BackendTraits) -> None:
    """Tell the cost model how a (new) backend spends work and memory."""
    BACKEND_TRAITS[name] = traits


_DTYPE_NAMES: dict[str, tuple[str, int]] = {
    "fp32": ("float32", 4),
    "float32": ("float32", 4),
    "float": ("float32", 4),
    "fp16": ("float16", 2),
    "float16": ("float16", 2),
    "half": ("float16", 2),
    "bf16": ("bfloat16", 2),
    "bfloat16": ("bfloat16", 2),
    "fp64": ("float64", 8),
    "float64": ("float64", 8),
}


def _dtype(dtype: Any) -> tuple[str, int]:
    """``(name, bytes per element)`` of a floating ``torch.dtype`` or its name.

    Works without importing torch (the CLI's ``estimate`` never does).
    """
    if isinstance(dtype, str):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(_DTYPE_NAMES)}")
        return _DTYPE_NAMES[dtype]
    if type(dtype).__name__ != "dtype" or not getattr(dtype, "is_floating_point", False):
        raise ValueError(f"dtype must be a floating torch.dtype or its name, got {dtype!r}")
    return str(dtype).removeprefix("torch."), int(dtype.itemsize)


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a floating dtype, given as ``torch.float16`` or ``"bf16"``/``"float16"``.

    Raises:
        ValueError: an unknown name or a non-floating dtype.
    """
    return _dtype(dtype)[1]


@dataclass
class ComponentCost:
    """Work and memory of one component, summed over layers.

    Attributes:
        flops: all FLOPs for the mode (matmul + element-wise).
        matmul_flops: the matmul part.
        activation_bytes: activations this component holds at the peak (saved for backward
            in training; live tensors in inference).
    """

    flops: float = 0.0
    matmul_flops: float = 0.0
    activation_bytes: float = 0.0

    def add(self, *, mm: float = 0.0, ew: float = 0.0, act: float = 0.0) -> None:
        self.matmul_flops += mm
        self.flops += mm + ew
        self.activation_bytes += act


@dataclass
class CostReport:
    """What :func:`estimate` computes. FLOPs are for the whole mode (training: forward +
    backward; decode: one step); bytes are totals over the batch.

    Attributes:
        arch: the architecture described.
        mode: ``"inference"``, ``"training"`` or ``"decode"``.
        batch_size: sequences.
        seq_len: tokens per sequence (decode: tokens already in the cache).
        new_tokens: decode only: tokens produced in the step.
        dtype: the compute/parameter dtype's name.
        backend: the attention backend costed (``auto`` resolved).
        checkpointing: gradient checkpointing per layer (training).
        by_component: :class:`ComponentCost` per component name.
        flops: total FLOPs.
        matmul_flops: the matmul part of ``flops``.
        forward_matmul_flops: matmul FLOPs of one forward pass.
        attention_density: fraction of (query, key) pairs the mask keeps.
        parameter_count: parameters.
        parameter_bytes: parameter memory.
        gradient_bytes: gradient memory (training).
        optimizer_bytes: optimizer state (training).
        kv_cache_bytes: KV-cache memory (decode).
        activation_bytes: peak activation memory for ``backend`` and ``checkpointing``.
        activation_variants: activation bytes for materialised/tiled attention with and
            without checkpointing (training) or materialised/tiled (inference).
        score_matrix_bytes: one layer's ``B x H x L x S`` score matrix.
        total_bytes: parameters + gradients + optimizer + KV cache + activations.
        notes: assumptions that shaped the numbers.
    """

    arch: ArchSpec
    mode: str
    batch_size: int
    seq_len: int
    new_tokens: int
    dtype: str
    backend: str
    checkpointing: bool
    by_component: dict[str, ComponentCost]
    flops: float
    matmul_flops: float
    forward_matmul_flops: float
    attention_density: float
    parameter_count: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    activation_variants: dict[str, int]
    score_matrix_bytes: int
    total_bytes: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``json.dumps``."""
        d = asdict(self)
        d["arch"] = asdict(self.arch)
        return d

    def summary(self) -> str:
        """A few lines a person reads."""
        lines = [
            f"{self.arch.name} ({self.arch.attention_kind}), mode={self.mode}, batch={self.batch_size}, "
            f"seq_len={self.seq_len}, dtype={self.dtype}, backend={self.backend}"
            + (", checkpointing" if self.checkpointing else ""),
            f"  FLOPs {human_flops(self.flops)} (matmul {human_flops(self.matmul_flops)})",
            f"  parameters {self.parameter_count:,} = {human_bytes(self.parameter_bytes)}",
        ]
        if self.mode == "training":
            lines.append(
                f"  gradients {human_bytes(self.gradient_bytes)}, optimizer state "
                f"{human_bytes(self.optimizer_bytes)}"
            )
        if self.kv_cache_bytes:
            lines.append(f"  KV cache {human_bytes(self.kv_cache_bytes)}")
        lines.append(f"  activations {human_bytes(self.activation_bytes)}")
        lines.append(f"  total {human_bytes(self.total_bytes)}")
        lines.append("  by component:")
        for name, c in self.by_component.items():
            if c.flops or c.activation_bytes:
                lines.append(
                    f"    {name:<17} {human_flops(c.flops):>10}  {human_bytes(c.activation_bytes):>10}"
                )
        return "\n".join(lines)


def human_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_flops(n: float) -> str:
    """``2.5e9 -> '2.50 GFLOP'``."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"


# --------------------------------------------------------------------------- parameters


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
    total += v * d
    if spec.learned_positions and spec.max_positions:
        total += spec.max_positions * d
    total += spec.type_vocab_size * d
    total += norm * (int(spec.embedding_norm) + int(spec.final_norm))
    if spec.num_decoder_layers:
        total += norm  # the decoder stack's final norm
    if spec.lm_head and not spec.tied_embeddings:
        total += v * d
    if spec.pooler:
        total += d * d + d
    return total


# --------------------------------------------------------------------------- helpers


def _window_density(window: int, q_len: int, kv_len: int, q_offset: int) -> float:
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


def _causal_density(q_len: int, kv_len: int, q_offset: int) -> float:
    return _window_density(q_len + kv_len + q_offset + 1, q_len, kv_len, q_offset)


def _resolve_backend(backend: str, mode: str) -> str:
    if backend == "auto":
        return "sdpa"
    return backend


def _traits(backend: str) -> BackendTraits:
    return BACKEND_TRAITS.get(backend, BACKEND_TRAITS["sdpa"])


def _act_flops(activation: str) -> int:
    return ELEMENTWISE_FLOPS.get(activation, 8)


# --------------------------------------------------------------------------- one layer


@dataclass
class _Shape:
    b: int  # batch
    lq: int  # queries per sequence
    s: int  # keys per query (stored)
    density: float  # fraction of the L x S pairs attended
    cross: bool = False  # cross-attention: keys come from another sequence
    kv_new: int | None = None  # tokens per sequence whose keys/values are projected (default lq)


def _attention_work(
    spec: ArchSpec, sh: _Shape, traits: BackendTraits, causal_flag: bool
) -> tuple[float, float, float]:
    """(score-matmul FLOPs, weights·V FLOPs, score elements) executed by the backend."""
    b, h, e = sh.b, spec.num_heads, spec.head_dim
    if traits.linear:
        # phi(K)^T V: 2 S E E per head; phi(Q) (KV): 2 L E E; normaliser 2 L E
        kv = 2.0 * b * h * sh.s * e * e
        q = 2.0 * b * h * sh.lq * e * e + 2.0 * b * h * sh.lq * e
        return kv, q, 0.0
    pairs = float(b * h * sh.lq * sh.s)
    if traits.skips == "pattern" or (traits.skips == "causal" and causal_flag):
        pairs *= sh.density
    return 2.0 * pairs * e, 2.0 * pairs * e, pairs


def _layer_saved(
    spec: ArchSpec, sh: _Shape, traits: BackendTraits, bpe: int, training: bool
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
    # the layer's input (the projections' input) and the concatenated q/k/v weight that the
    # fused projection builds on each call
    proj = t * d + d * (spec.q_dim + 2 * spec.kv_dim)
    if n_scores:
        # contiguous copies of q, kᵀ and v (k and v repeated to H heads for GQA), the
        # score-sized tensors in float32, the concatenated heads before out_proj
        score_bpe = 4 if bpe < 4 else bpe
        proj += t * spec.q_dim + 2 * tk * spec.kv_dim * rep + t * spec.q_dim
        _, _, pairs = _attention_work(spec, sh, BACKEND_TRAITS["reference"], False)
        out["attention_scores"] = pairs * score_bpe * (n_scores - 1)
        out["softmax"] = pairs * score_bpe * 1.0
    else:
        # q, k, v views of the fused projection (kept alive whole), out, logsumexp (float32)
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


def _layer_flops(
    spec: ArchSpec, sh: _Shape, traits: BackendTraits, *, masked: bool
) -> dict[str, tuple[float, float]]:
    """Forward (matmul, element-wise) FLOPs of one layer's self- or cross-attention + FFN."""
    t = sh.b * sh.lq
    # keys/values are projected for the new tokens only; a cache holds the others
    tk = sh.b * (sh.lq if sh.kv_new is None else sh.kv_new)
    d, f = spec.hidden_size, spec.intermediate_size
    q_proj = 2.0 * t * d * spec.q_dim
    kv_proj = 2.0 * tk * d * 2 * spec.kv_dim
    o_proj = 2.0 * t * spec.q_dim * d
    qk, av, pairs = _attention_work(spec, sh, traits, spec.causal and not sh.cross)
    ew = ELEMENTWISE_FLOPS
    soft = pairs * (ew["softmax"] + ew["scale"] + (ew["mask"] if masked else 0))
    if spec.position == "rope" and not sh.cross:
        soft += ew["rope"] * (t * spec.q_dim + tk * spec.kv_dim)
    n_mats = 3 if spec.ffn == "gated" else 2
    ffn_mm = 2.0 * t * d * f * n_mats
    ffn_ew = t * f * (_act_flops(spec.activation) + (ew["gate"] if spec.ffn == "gated" else 0))
    norm_ew = 2 * t * d * (ew[spec.norm] + ew["residual"])
    return {
        "projections": (q_proj + kv_proj + o_proj, 0.0),
        "attention_scores": (qk, 0.0),
        "softmax": (0.0, soft),
        "attention_v": (av, 0.0),
        "feed_forward": (ffn_mm, ffn_ew),
        "norms": (0.0, norm_ew),
    }


# --------------------------------------------------------------------------- estimate


def estimate(
    config_or_model: Any,
    *,
    batch_size: int = 1,
    seq_len: int,
    mode: Mode = "inference",
    dtype: Any = "float32",
    backend: str = "auto",
    new_tokens: int = 1,
    target_len: int | None = None,
    checkpointing: bool = False,
    optimizer: str | None = "adamw",
    mask: Any = None,
    window: int | None = None,
    masked: bool | None = None,
    cache: str = "contiguous",
    cache_capacity: int | None = None,
) -> CostReport:
    """Estimate FLOPs and memory of a model without running it.

    Args:
        config_or_model: a config the library builds (``EncoderConfig``...), a model with
            a ``.config``, or an :class:`~attnlab.analysis.arch.ArchSpec`.
        batch_size: sequences ``B``.
        seq_len: tokens per sequence ``L`` (decode: tokens already in the cache;
            encoder-decoder: source length).
        mode: ``"inference"`` (one forward), ``"training"`` (forward + backward +
            optimizer state) or ``"decode"`` (one cached step of ``new_tokens``).
        dtype: parameter/activation dtype (``torch.bfloat16`` or ``"bf16"``...).
        backend: attention backend name or ``"auto"``; decides whether the score matrix
            is built and which masked work is skipped (:data:`BACKEND_TRAITS`).
        new_tokens: decode: tokens produced per step.
        target_len: encoder-decoder: decoder length (default ``seq_len``).
        checkpointing: per-layer gradient checkpointing (training).
        optimizer: ``"adamw"``/``"adam"`` (two float32 states per parameter, plus a float32
            master copy for 16-bit parameters), ``"sgd"`` (none), ``"momentum"`` (one), or None.
        mask: a :class:`~attnlab.functional.masks.MaskPattern` over the self-attention; its
            density scales the attention work of backends that skip masked tiles.
        window: a causal sliding window of ``window`` keys (overrides the config's).
        masked: whether a mask is applied (adds the masking FLOPs); default: when there is
            a causal mask, a window or a pattern.
        cache: decode: ``"contiguous"`` (one slot per token), ``"static"`` (``cache_capacity``
            slots preallocated) or ``"sliding"`` (at most ``window`` slots).
        cache_capacity: slots a static (or preallocated contiguous) cache holds.

    Returns:
        A :class:`CostReport`.

    Raises:
        ValueError: sizes that are not positive, an unknown mode, dtype, optimizer or cache.
        TypeError: an object no adapter describes.
    """
    spec = describe(config_or_model)
    for name, value in (
        ("batch_size", batch_size),
        ("seq_len", seq_len),
        ("new_tokens", new_tokens),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if mode not in ("inference", "training", "decode"):
        raise ValueError(f"mode must be 'inference', 'training' or 'decode', got {mode!r}")
    if optimizer not in (None, "adamw", "adam", "sgd", "momentum"):
        raise ValueError(
            f"optimizer must be 'adamw', 'adam', 'sgd', 'momentum' or None, got {optimizer!r}"
        )
    if cache not in ("contiguous", "static", "sliding"):
        raise ValueError(f"cache must be 'contiguous', 'static' or 'sliding', got {cache!r}")
    dtype_name, bpe = _dtype(dtype)
    backend = _resolve_backend(backend, mode)
    traits = _traits(backend)
    if window is not None:
        spec = spec.with_(window=window, causal=True)
    training = mode == "training"
    notes: list[str] = []
    if backend not in BACKEND_TRAITS:
        notes.append(f"no traits registered for backend {backend!r}: costed like 'sdpa'")

    # -- the self-attention shape of the (decoder or encoder) stack
    decode = mode == "decode"
    lq = new_tokens if decode else seq_len
    context = seq_len + new_tokens if decode else seq_len
    q_offset = context - lq
    if decode:
        if cache == "static":
            cap = cache_capacity if cache_capacity is not None else context
            if cap < context:
                raise ValueError(
                    f"cache_capacity ({cap}) is smaller than the context ({context} tokens)"
                )
            stored = cap
        elif cache == "sliding":
            if spec.window is None:
                raise ValueError("cache='sliding' needs a window (config or window=)")
            stored = min(context, spec.window + lq - 1)
        else:
            stored = context
    else:
        stored = context
    if mask is not None:
        density = float(mask.density(lq, context, q_offset=q_offset))
        masked = True if masked is None else masked
    elif spec.window is not None:
        density = _window_density(spec.window, lq, context, q_offset)
    elif spec.causal:
        density = _causal_density(lq, context, q_offset)
    else:
        density = 1.0
    if spec.pattern_density is not None and mask is None:
        density = min(density, spec.pattern_density)
    if masked is None:
        masked = spec.causal or spec.window is not None or spec.pattern_density is not None
    if decode and cache != "contiguous":
        density *= context / stored if stored else 1.0  # keys stored but masked
    self_shape = _Shape(b=batch_size, lq=lq, s=stored, density=density)
    # backends that skip work skip it on the executed keys of a sliding cache too
    by: dict[str, ComponentCost] = {name: ComponentCost() for name in COMPONENTS}
    fwd_mm = 0.0

    def add_layers(n: int, sh: _Shape, cross: _Shape | None) -> None:
        nonlocal fwd_mm
        for shape in [sh] + ([cross] if cross is not None else []):
            per = _layer_flops(spec, shape, traits, masked=bool(masked) and not shape.cross)
            if shape.cross:
                per.pop("feed_forward")
            for comp, (mm, ew) in per.items():
                by[comp].add(mm=n * mm, ew=n * ew)
                fwd_mm += n * mm

    n_self = spec.num_layers
    if spec.num_decoder_layers:
        tgt = target_len or seq_len
        enc_shape = _Shape(b=batch_size, lq=seq_len, s=seq_len, density=1.0)
        if not decode:
            add_layers(spec.num_layers, enc_shape, None)
            dec_self = _Shape(b=batch_size, lq=tgt, s=tgt, density=_causal_density(tgt, tgt, 0))
        else:
            dec_self = self_shape
        # the encoder output is projected once per sequence (cached while decoding)
        cross = _Shape(
            b=batch_size,
            lq=dec_self.lq,
            s=seq_len,
            density=1.0,
            cross=True,
            kv_new=0 if decode else seq_len,
        )
        add_layers(spec.num_decoder_layers, dec_self, cross)
        n_self = spec.num_decoder_layers
        head_tokens = batch_size * dec_self.lq
    else:
        add_layers(spec.num_layers, self_shape, None)
        head_tokens = batch_size * lq
    tokens = batch_size * lq
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
    by["embeddings"].add(ew=emb_ew)
    if spec.final_norm:
        by["norms"].add(ew=head_tokens * d * ew[spec.norm])
    if spec.lm_head:
        mm = 2.0 * head_tokens * d * v
        by["lm_head"].add(mm=mm)
        fwd_mm += mm
    if spec.pooler:
        mm = 2.0 * batch_size * d * d
        by["pooler"].add(mm=mm, ew=batch_size * d * 8)
        fwd_mm += mm

    # -- training: backward FLOPs
    if training:
        for name, c in by.items():
            attn = name in ("attention_scores", "attention_v")
            factor = traits.backward_factor if attn else 2.0
            if checkpointing and name not in ("lm_head", "pooler", "embeddings"):
                factor += 1.0  # the forward of each layer runs again during backward
            c.flops += factor * c.flops
            c.matmul_flops += factor * c.matmul_flops

    # -- memory
    n_params = parameter_count(spec)
    param_bytes = n_params * bpe
    grad_bytes = n_params * bpe if training else 0
    opt_bytes = 0
    if training and optimizer is not None:
        states = {"adamw": 2, "adam": 2, "sgd": 0, "momentum": 1}[optimizer]
        opt_bytes = n_params * 4 * states
        if bpe < 4 and states:
            opt_bytes += n_params * 4  # float32 master weights (mixed precision)
            notes.append("16-bit parameters: optimizer keeps float32 master weights")
    kv_layers = spec.num_decoder_layers or spec.num_layers
    kv_bytes = 0
    if decode:
        kv_bytes = 2 * kv_layers * batch_size * spec.kv_dim * stored * bpe
        if spec.num_decoder_layers:
            kv_bytes += 2 * spec.num_decoder_layers * batch_size * spec.kv_dim * seq_len * bpe

    score_pairs = batch_size * spec.num_heads * lq * stored
    score_bytes = score_pairs * (4 if bpe < 4 else bpe)
    variants: dict[str, int] = {}
    chosen = 0
    for label, tr in (("materialised", BACKEND_TRAITS["reference"]), ("tiled", _TILED)):
        for ckpt in (False, True) if training else (False,):
            val, comps = _activations(
                spec, self_shape, tr, bpe, mode, n_self, checkpointing=ckpt, head_tokens=head_tokens
            )
            key = label + ("+checkpointing" if ckpt else "")
            variants[key] = int(val)
    act, comps = _activations(
        spec,
        self_shape,
        traits,
        bpe,
        mode,
        n_self,
        checkpointing=checkpointing and training,
        head_tokens=head_tokens,
    )
    chosen = int(act)
    for name, b in comps.items():
        by[name].activation_bytes += b
    total_flops = sum(c.flops for c in by.values())
    total_mm = sum(c.matmul_flops for c in by.values())
    total = param_bytes + grad_bytes + opt_bytes + kv_bytes + chosen
    if spec.pattern_density is not None or mask is not None:
        notes.append(f"mask density {density:.3f} scales the work of tile-skipping backends")
    return CostReport(
        arch=spec,
        mode=mode,
        batch_size=batch_size,
        seq_len=seq_len,
        new_tokens=new_tokens if decode else 0,
        dtype=dtype_name,
        backend=backend,
        checkpointing=checkpointing and training,
        by_component=by,
        flops=total_flops,
        matmul_flops=total_mm,
        forward_matmul_flops=fwd_mm,
        attention_density=density,
        parameter_count=n_params,
        parameter_bytes=param_bytes,
        gradient_bytes=grad_bytes,
        optimizer_bytes=opt_bytes,
        kv_cache_bytes=kv_bytes,
        activation_bytes=chosen,
        activation_variants=variants,
        score_matrix_bytes=int(score_bytes),
        total_bytes=int(total),
        notes=notes,
    )


#: Score-sized gradients alive at once at the peak of a materialised attention's backward.
TRANSIENT_SCORES = 3.0


def _activations(
    spec: ArchSpec,
    sh: _Shape,
    traits: BackendTraits,
    bpe: int,
    mode: str,
    n_layers: int,
    *,
    checkpointing: bool,
    head_tokens: int,
) -> tuple[float, dict[str, float]]:
    """Peak activation bytes and their split by component."""
    t = sh.b * sh.lq
    d, f, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    _, _, pairs = _attention_work(spec, sh, traits, spec.causal)
    score_bpe = 4 if bpe < 4 and traits.materialises_scores else bpe
    comps: dict[str, float] = {}
    if mode != "training":
        # Inference: the largest set of tensors alive at once inside one layer.
        hidden = 2 * t * d * bpe  # residual stream + sublayer output
        attn = traits.score_tensors_live * pairs * score_bpe
        attn += t * (spec.q_dim + 2 * spec.kv_dim) * bpe * (2 if traits.materialises_scores else 1)
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
    per_layer = _layer_saved(spec, sh, traits, bpe, training=True)
    layer_total = sum(per_layer.values())
    # embeddings: the norm's input and the output (the first layer's input)
    emb = float(2 * t * d * bpe if spec.embedding_norm else t * d * bpe)
    if spec.hidden_dropout > 0:
        emb += t * d * bpe  # the embedding dropout's mask
    logits = 0.0
    if spec.lm_head:
        logits = head_tokens * v * bpe * 2.0  # logits and their gradient
    # transient at the start of the backward pass: the gradient of the scores and of the
    # weights of one layer (materialised) or a few hidden-sized gradients (tiled)
    full_pairs = sh.b * spec.num_heads * sh.lq * sh.s
    if "softmax" in per_layer:
        transient = TRANSIENT_SCORES * full_pairs * (4 if bpe < 4 else bpe) + 4 * t * d * bpe
    else:
        transient = 4 * t * d * bpe + t * f * bpe
    if checkpointing:
        kept = n_layers * t * d * bpe
        saved = kept + layer_total
        comps = {"norms": kept}
        for name, b in per_layer.items():
            comps[name] = comps.get(name, 0.0) + b
    else:
        saved = n_layers * layer_total
        comps = {name: n_layers * b for name, b in per_layer.items()}
    comps["embeddings"] = emb
    if logits:
        comps["lm_head"] = logits
    peak = saved + emb + logits + transient
    comps["attention_scores"] = comps.get("attention_scores", 0.0) + transient
    return peak, comps


def sequence_sweep(config_or_model: Any, seq_lens: list[int], **kwargs: Any) -> list[CostReport]:
    """:func:`estimate` at each sequence length (same keyword arguments)."""
    return [estimate(config_or_model, seq_len=n, **kwargs) for n in seq_lens]
