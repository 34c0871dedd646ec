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
  attnlab's modules, counted tensor by tensor (see :func:`layer_saved`), plus the
  transient gradients at the start of the backward pass; with gradient checkpointing
  only each layer's input is kept and one layer is recomputed at a time (Chen et al.,
  2016, "Training deep nets with sublinear memory cost").

Nothing here runs a model: :func:`estimate` is arithmetic on an
:class:`~attnlab.analysis.arch.ArchSpec`, fast enough to sweep thousands of shapes. The
per-layer formulas and the backends' traits live in :mod:`attnlab.analysis.cost_layers`.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from attnlab._validate import check_int, check_positive_int
from attnlab.analysis.arch import ArchSpec, describe
from attnlab.analysis.backend_choice import auto_choice
from attnlab.analysis.cost_kv import check_kv_dtype, quantized_kv_bytes
from attnlab.analysis.cost_layers import (
    BACKEND_TRAITS,
    ELEMENTWISE_FLOPS,
    TILED,
    BackendTraits,
    LayerShape,
    attention_work,
    causal_density,
    dynamic_slots,
    layer_flops,
    layer_saved,
    parameter_count,
    register_backend_traits,
    traits_of,
    window_density,
)
from attnlab.analysis.moe_cost import active_parameter_count, all_to_all_bytes

__all__ = [
    "BACKEND_TRAITS",
    "ELEMENTWISE_FLOPS",
    "BackendTraits",
    "ComponentCost",
    "CostReport",
    "dtype_bytes",
    "estimate",
    "human_bytes",
    "human_flops",
    "parameter_count",
    "register_backend_traits",
    "sequence_sweep",
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
        active_parameter_count: parameters one token uses (MoE: ``k`` of ``E`` experts;
            dense: all).
        all_to_all_bytes: on-paper bytes expert parallelism moves for this pass
            (``expert_parallel`` devices; 0 without MoE or with one device).
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
    active_parameter_count: int = 0
    all_to_all_bytes: float = 0.0

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
        if self.arch.moe is not None:
            lines.append(
                f"  active parameters per token {self.active_parameter_count:,} "
                f"({self.active_parameter_count / self.parameter_count:.1%})"
            )
            if self.all_to_all_bytes:
                lines.append(f"  expert-parallel all-to-all {human_bytes(self.all_to_all_bytes)}")
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


def _auto_backend(
    requested: str,
    spec: ArchSpec,
    shape: LayerShape,
    *,
    mode: str,
    dtype: str,
    mask: Any,
) -> str:
    """The backend ``auto`` would choose for this model's self-attention calls.

    A backend named, or set with ``attnlab.backends.use``, wins (costed as asked).
    Otherwise the registry decides (:func:`attnlab.analysis.backend_choice.auto_choice`):
    its checks and its calibrated cost model, the same that run a real call.
    """
    if requested != "auto":
        return requested
    registry = sys.modules.get("attnlab.backends.registry")
    if registry is not None and registry.current() != "auto":
        return str(registry.current())
    why = auto_choice(
        batch_size=shape.b,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        q_len=shape.lq,
        kv_len=shape.s,
        dtype=dtype,
        training=mode == "training",
        causal=shape.causal,
        window=shape.window,
        mask=mask,
        dense_mask=not shape.structured and mask is None,
        positions=mode == "decode",
    )
    return why.chosen


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
    cache: str | None = None,
    cache_capacity: int | None = None,
    expert_parallel: int = 1,
    kv_dtype: str | None = None,
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
        backend: attention backend name or ``"auto"`` (resolved as the registry's
            calibrated ``auto`` would, or to the backend set with ``attnlab.backends.use``);
            decides whether the score matrix is built and which masked work is skipped
            (:data:`BACKEND_TRAITS`).
        new_tokens: decode: tokens produced per step.
        target_len: encoder-decoder: decoder tokens (default ``seq_len``; decode: tokens
            decoded so far, default 0).
        checkpointing: per-layer gradient checkpointing (training).
        optimizer: ``"adamw"``/``"adam"`` (two float32 states per parameter, plus a float32
            master copy for 16-bit parameters), ``"sgd"`` (none), ``"momentum"`` (one), or None.
        mask: a :class:`~attnlab.functional.masks.MaskPattern` over the self-attention; its
            density scales the attention work of backends that skip masked tiles.
        window: a causal sliding window of ``window`` keys (overrides the config's).
        masked: whether a mask is applied (adds the masking FLOPs); default: when there is
            a causal mask, a window or a pattern.
        cache: decode: the KV cache, as attnlab's caches allocate it (default: what
            ``DecoderLM.new_cache()`` builds, sliding for a windowed model): ``"dynamic"``
            (``DynamicKVCache``: ``cache_capacity`` slots preallocated, doubling when
            exceeded, after a prefill of ``seq_len`` tokens; ``"contiguous"`` is an alias),
            ``"static"`` (``StaticKVCache``: ``cache_capacity`` slots, all attended) or
            ``"sliding"`` (``SlidingWindowKVCache``: the last ``window`` slots plus the new
            ones).
        cache_capacity: slots preallocated by a dynamic or static cache (default: the
            context, as ``generate`` does).
        expert_parallel: devices the experts of MoE layers are spread over; sets
            :attr:`CostReport.all_to_all_bytes` (on paper, balanced routing).
        kv_dtype: decode, dynamic cache: the KV cache in ``"int8"``/``"int4"``/``"int2"``
            as :class:`~attnlab.cache.quantized.QuantizedKVCache` stores it by default
            (:mod:`attnlab.analysis.cost_kv`); None or ``"float"``: the model dtype.

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
        ("expert_parallel", expert_parallel),
    ):
        check_positive_int(name, value)
    if window is not None:
        check_positive_int("window", window)
    if cache_capacity is not None:
        check_int("cache_capacity", cache_capacity, min_value=0)
    if target_len is not None:
        check_int("target_len", target_len, min_value=0)
    if not isinstance(backend, str) or (backend != "auto" and backend not in BACKEND_TRAITS):
        raise ValueError(
            f"backend must be 'auto' or a backend the cost model knows, {sorted(BACKEND_TRAITS)}, "
            f"got {backend!r} (a backend you registered needs register_backend_traits)"
        )
    if mode not in ("inference", "training", "decode"):
        raise ValueError(f"mode must be 'inference', 'training' or 'decode', got {mode!r}")
    if optimizer not in (None, "adamw", "adam", "sgd", "momentum"):
        raise ValueError(
            f"optimizer must be 'adamw', 'adam', 'sgd', 'momentum' or None, got {optimizer!r}"
        )
    if cache is None:  # what DecoderLM.new_cache() builds
        cache = "sliding" if spec.window is not None or window is not None else "dynamic"
    if cache == "contiguous":
        cache = "dynamic"
    if cache not in ("dynamic", "static", "sliding"):
        raise ValueError(f"cache must be 'dynamic', 'static' or 'sliding', got {cache!r}")
    kv_dtype = check_kv_dtype(kv_dtype, mode, cache)
    dtype_name, bpe = _dtype(dtype)
    requested = backend
    if window is not None:
        spec = spec.with_(window=window, causal=True)
    training = mode == "training"
    notes: list[str] = []

    # -- the self-attention shape of the (decoder or encoder) stack; an encoder-decoder's
    # decoder runs over target_len tokens (decode: target_len already decoded)
    decode = mode == "decode"
    encdec = spec.num_decoder_layers > 0
    self_len = seq_len
    if encdec:
        self_len = target_len if target_len is not None else (0 if decode else seq_len)
        if self_len < 0 or (self_len == 0 and not decode):
            raise ValueError(f"target_len must be a positive int, got {target_len!r}")
        spec = spec.with_(causal=True)  # the decoder's self-attention
    lq = new_tokens if decode else self_len
    context = self_len + new_tokens if decode else self_len
    q_offset = context - lq
    # keys the attention runs over (stored) and slots the cache allocates (cache_slots)
    stored = cache_slots = context
    if decode:
        if cache == "static":
            cap = cache_capacity if cache_capacity is not None else context
            if cap < context:
                raise ValueError(
                    f"cache_capacity ({cap}) is smaller than the context ({context} tokens)"
                )
            stored = cache_slots = cap  # StaticKVCache returns its whole buffer
        elif cache == "sliding":
            if spec.window is None:
                raise ValueError("cache='sliding' needs a window (config or window=)")
            # SlidingWindowKVCache keeps the last W slots and appends the new ones to them
            stored = cache_slots = min(self_len, spec.window) + lq
        else:
            capacity = context if cache_capacity is None else cache_capacity
            cache_slots = dynamic_slots(self_len, lq, capacity)
    if mask is not None:
        density = float(mask.density(lq, context, q_offset=q_offset))
        masked = True if masked is None else masked
    elif spec.window is not None:
        density = window_density(spec.window, lq, context, q_offset)
    elif spec.causal:
        density = causal_density(lq, context, q_offset)
    else:
        density = 1.0
    if spec.pattern_density is not None and mask is None:
        density = min(density, spec.pattern_density)
    if masked is None:
        masked = spec.causal or spec.window is not None or spec.pattern_density is not None
    if stored != context:
        density *= context / stored  # the same attended pairs, over the keys returned
    self_shape = LayerShape(
        b=batch_size,
        lq=lq,
        s=stored,
        density=density,
        causal=spec.causal or spec.window is not None,
        window=spec.window,
        q_offset=q_offset,
        structured=mask is None and spec.pattern_density is None,
    )
    backend = _auto_backend(requested, spec, self_shape, mode=mode, dtype=dtype_name, mask=mask)
    traits = traits_of(backend)
    if requested == "auto":
        notes.append(f"auto resolves to {backend!r} for this shape (the registry's choice)")
    if backend not in BACKEND_TRAITS:
        notes.append(f"no traits registered for backend {backend!r}: costed like 'sdpa'")
    by: dict[str, ComponentCost] = {name: ComponentCost() for name in COMPONENTS}
    fwd_mm = 0.0

    def add_layers(n: int, sh: LayerShape, cross: LayerShape | None) -> None:
        nonlocal fwd_mm
        for shape in [sh] + ([cross] if cross is not None else []):
            per = layer_flops(spec, shape, traits, masked=bool(masked) and not shape.cross)
            if shape.cross:
                per.pop("feed_forward")
            for comp, (mm, ew) in per.items():
                by[comp].add(mm=n * mm, ew=n * ew)
                fwd_mm += n * mm

    n_self = spec.num_layers
    extra: tuple[tuple[int, ArchSpec, LayerShape, bool], ...] = ()
    if encdec:
        enc_shape = LayerShape(b=batch_size, lq=seq_len, s=seq_len, density=1.0)
        if not decode:
            # the encoder is bidirectional
            enc_spec = spec.with_(causal=False)
            for comp, (mm, ew_) in layer_flops(enc_spec, enc_shape, traits, masked=False).items():
                by[comp].add(mm=spec.num_layers * mm, ew=spec.num_layers * ew_)
                fwd_mm += spec.num_layers * mm
        dec_self = self_shape
        # the encoder output is projected once per sequence (cached while decoding)
        cross = LayerShape(
            b=batch_size,
            lq=dec_self.lq,
            s=seq_len,
            density=1.0,
            cross=True,
            kv_new=0 if decode else seq_len,
        )
        add_layers(spec.num_decoder_layers, dec_self, cross)
        n_self = spec.num_decoder_layers
        extra = (
            (spec.num_layers, spec.with_(causal=False), enc_shape, True),
            (spec.num_decoder_layers, spec, cross, False),
        )
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
    if decode and kv_dtype is not None:
        kv_bytes = quantized_kv_bytes(
            spec, kv_layers, batch_size, cache_slots, context, kv_dtype, bpe
        )
        notes.append(f"KV cache in {kv_dtype} (KIVI: keys per channel, values per token)")
    elif decode:
        kv_bytes = 2 * kv_layers * batch_size * spec.kv_dim * cache_slots * bpe
    if decode and spec.num_decoder_layers:  # the cross-attention caches stay float
        kv_bytes += 2 * spec.num_decoder_layers * batch_size * spec.kv_dim * seq_len * bpe

    score_pairs = batch_size * spec.num_heads * lq * stored
    score_bytes = score_pairs * (4 if bpe < 4 else bpe)
    variants: dict[str, int] = {}
    chosen = 0
    for label, tr in (("materialised", BACKEND_TRAITS["reference"]), ("tiled", TILED)):
        for ckpt in (False, True) if training else (False,):
            val, comps = _activations(
                spec,
                self_shape,
                tr,
                bpe,
                mode,
                n_self,
                checkpointing=ckpt,
                head_tokens=head_tokens,
                extra=extra,
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
        extra=extra,
    )
    chosen = int(act)
    for name, b in comps.items():
        by[name].activation_bytes += b
    total_flops = sum(c.flops for c in by.values())
    total_mm = sum(c.matmul_flops for c in by.values())
    total = param_bytes + grad_bytes + opt_bytes + kv_bytes + chosen
    if spec.pattern_density is not None or mask is not None:
        notes.append(f"mask density {density:.3f} scales the work of tile-skipping backends")
    a2a = 0.0
    if spec.moe is not None:
        a2a = all_to_all_bytes(
            tokens,
            spec.hidden_size,
            spec.moe,
            parallel=expert_parallel,
            bytes_per_element=bpe,
            backward=training,
        )
        notes.append(
            f"MoE: {spec.moe.num_layers} layers route each token to {spec.moe.top_k} of "
            f"{spec.moe.num_experts} experts (dropless: no capacity padding); activations of "
            "the MoE feed-forward are costed as a dense one"
        )
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
        active_parameter_count=active_parameter_count(spec, n_params),
        all_to_all_bytes=a2a,
    )


def _activations(
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
) -> tuple[float, dict[str, float]]:
    """Peak activation bytes and their split by component.

    ``extra`` adds other layer kinds kept for the backward pass: ``(count, spec, shape,
    with_ffn)`` (an encoder-decoder's encoder layers and cross-attention sublayers).
    """
    t = sh.b * sh.lq
    d, f, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    _, _, pairs = attention_work(spec, sh, traits, spec.causal)
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
    per_layer = layer_saved(spec, sh, traits, bpe, training=True)
    for count, x_spec, x_shape, with_ffn in extra:
        x_saved = layer_saved(x_spec, x_shape, traits, bpe, training=True)
        if not with_ffn:
            x_saved.pop("feed_forward")
        for name, b in x_saved.items():
            per_layer[name] = per_layer.get(name, 0.0) + b * count / n_layers
    layer_total = sum(per_layer.values())
    # embeddings: the norm's input and the output (the first layer's input)
    emb = float(2 * t * d * bpe if spec.embedding_norm else t * d * bpe)
    if spec.hidden_dropout > 0:
        emb += t * d * bpe  # the embedding dropout's mask
    # a cross-entropy loss over every position keeps the logits and the log-probabilities,
    # and the backward starts with two gradients of that size
    logits = logits_grad = 0.0
    if spec.lm_head:
        logits = logits_grad = head_tokens * v * bpe * 2.0
    # transient at the start of the backward pass: the gradient of the scores and of the
    # weights of one layer (materialised) or a few hidden-sized gradients (tiled)
    full_pairs = sh.b * spec.num_heads * sh.lq * sh.s
    if "softmax" in per_layer:
        n_tr = traits.transient_score_tensors
        transient = n_tr * full_pairs * (4 if bpe < 4 else bpe) + 4 * t * d * bpe
    else:
        # a few hidden-sized gradients; with checkpointing, also the recomputed layer's
        # feed-forward intermediate alive next to them
        transient = 4 * t * d * bpe + (t * f * bpe if checkpointing else 0)
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
    # the LM head's gradients come first and are freed before the layers' backward begins
    peak = saved + emb + logits + max(transient, logits_grad)
    if transient >= logits_grad:
        comps["attention_scores"] = comps.get("attention_scores", 0.0) + transient
    else:
        comps["lm_head"] = comps.get("lm_head", 0.0) + logits_grad
    return peak, comps


def sequence_sweep(config_or_model: Any, seq_lens: list[int], **kwargs: Any) -> list[CostReport]:
    """:func:`estimate` at each sequence length (same keyword arguments)."""
    return [estimate(config_or_model, seq_len=n, **kwargs) for n in seq_lens]
