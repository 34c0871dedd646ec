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
per-layer formulas and the backends' traits live in :mod:`attnlab.analysis.cost_layers`,
the activation peak in :mod:`attnlab.analysis.cost_memory`, the report in
:mod:`attnlab.analysis.cost_report`. A layout that mixes windows across its layers
(Gemma 2's alternate local and global layers, Gemma 3's five to one, ModernBERT's every
third global) is costed group by group: each window's layers get their own shape, backend
(``auto`` chooses per group, as the model's per-layer calls do) and KV cache (a rolling
one on local layers, a growing one on global layers, as ``DecoderLM.new_cache`` builds).
"""

from __future__ import annotations

from typing import Any, Literal

from attnlab._validate import check_int, check_positive_int
from attnlab.analysis.arch import ArchSpec, describe
from attnlab.analysis.cost_attention import (
    LayerGroup,
    auto_backend,
    group_label,
    self_attention,
)
from attnlab.analysis.cost_kv import check_kv_dtype, quantized_kv_bytes
from attnlab.analysis.cost_layers import (
    BACKEND_TRAITS,
    ELEMENTWISE_FLOPS,
    TILED,
    BackendTraits,
    LayerShape,
    layer_flops,
    parameter_count,
    register_backend_traits,
    traits_of,
)
from attnlab.analysis.cost_memory import activations
from attnlab.analysis.cost_report import (
    ComponentCost,
    CostReport,
    _dtype,
    dtype_bytes,
    human_bytes,
    human_flops,
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


def _check_arguments(
    *,
    sizes: dict[str, int],
    window: int | None,
    cache_capacity: int | None,
    target_len: int | None,
    backend: str,
    mode: str,
    optimizer: str | None,
) -> None:
    for name, value in sizes.items():
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


def _backward_factor(component: str, traits: BackendTraits, checkpointing: bool) -> float:
    """The backward pass's FLOPs over the forward's, for one component."""
    attn = component in ("attention_scores", "attention_v")
    factor = traits.backward_factor if attn else 2.0
    if checkpointing and component not in ("lm_head", "pooler", "embeddings"):
        factor += 1.0  # the forward of each layer runs again during backward
    return factor


def _optimizer_bytes(n_params: int, bpe: int, optimizer: str | None, notes: list[str]) -> int:
    if optimizer is None:
        return 0
    states = {"adamw": 2, "adam": 2, "sgd": 0, "momentum": 1}[optimizer]
    opt_bytes = n_params * 4 * states
    if bpe < 4 and states:
        opt_bytes += n_params * 4  # float32 master weights (mixed precision)
        notes.append("16-bit parameters: optimizer keeps float32 master weights")
    return opt_bytes


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
        A :class:`CostReport`; for a layout that mixes windows, ``backend`` joins the
        groups' backends with ``+`` and ``layer_backends`` names each group's.

    Raises:
        ValueError: sizes that are not positive, an unknown mode, dtype, optimizer or cache.
        TypeError: an object no adapter describes.
    """
    spec = describe(config_or_model)
    sizes = {"batch_size": batch_size, "seq_len": seq_len, "new_tokens": new_tokens}
    _check_arguments(
        sizes=sizes | {"expert_parallel": expert_parallel},
        window=window,
        cache_capacity=cache_capacity,
        target_len=target_len,
        backend=backend,
        mode=mode,
        optimizer=optimizer,
    )
    if window is not None:
        spec = spec.with_(window=window, causal=True, layer_windows=None)
    windowed = spec.window is not None or spec.layer_windows is not None
    if cache is None:  # what DecoderLM.new_cache() builds (per layer)
        cache = "sliding" if windowed else "dynamic"
    if cache == "contiguous":
        cache = "dynamic"
    if cache not in ("dynamic", "static", "sliding"):
        raise ValueError(f"cache must be 'dynamic', 'static' or 'sliding', got {cache!r}")
    if mode == "decode" and cache == "sliding" and not windowed:
        raise ValueError("cache='sliding' needs a window (config or window=)")
    kv_dtype = check_kv_dtype(kv_dtype, mode, cache)
    dtype_name, bpe = _dtype(dtype)
    training = mode == "training"
    notes: list[str] = []

    # -- the self-attention shape of the (decoder or encoder) stack, one per window group;
    # an encoder-decoder's decoder runs over target_len tokens (decode: target_len decoded)
    decode = mode == "decode"
    encdec = spec.num_decoder_layers > 0
    self_len = seq_len
    if encdec:
        self_len = target_len if target_len is not None else (0 if decode else seq_len)
        if self_len < 0 or (self_len == 0 and not decode):
            raise ValueError(f"target_len must be a positive int, got {target_len!r}")
        spec = spec.with_(causal=True)  # the decoder's self-attention
    groups: list[LayerGroup] = []
    for w, count in spec.window_groups:
        g_spec = spec.with_(window=w, layer_windows=None, num_layers=count)
        shape, slots = self_attention(
            g_spec,
            batch_size=batch_size,
            self_len=self_len,
            decode=decode,
            new_tokens=new_tokens,
            cache=cache,
            cache_capacity=cache_capacity,
            mask=mask,
        )
        name = auto_backend(backend, g_spec, shape, mode=mode, dtype=dtype_name, mask=mask)
        groups.append(LayerGroup(g_spec, shape, slots, name, traits_of(name)))
    main = groups[0]
    if masked is None:
        masked = mask is not None or spec.causal or windowed or spec.pattern_density is not None
    for g in groups:
        if backend == "auto":
            where = "" if len(groups) == 1 else f" on the {group_label(g)}"
            notes.append(f"auto resolves to {g.backend!r}{where} (the registry's choice)")
        if g.backend not in BACKEND_TRAITS:
            notes.append(f"no traits registered for backend {g.backend!r}: costed like 'sdpa'")
    by: dict[str, ComponentCost] = {name: ComponentCost() for name in COMPONENTS}
    fwd_mm = 0.0

    def add(comp: str, mm: float, ew: float, traits: BackendTraits) -> None:
        nonlocal fwd_mm
        fwd_mm += mm
        scale = 1.0 + _backward_factor(comp, traits, checkpointing) if training else 1.0
        by[comp].add(mm=mm * scale, ew=ew * scale)

    def add_layers(n: int, g_spec: ArchSpec, shape: LayerShape, traits: BackendTraits) -> None:
        per = layer_flops(g_spec, shape, traits, masked=bool(masked) and not shape.cross)
        if shape.cross:
            per.pop("feed_forward")
        for comp, (mm, ew_) in per.items():
            add(comp, n * mm, n * ew_, traits)

    n_self = spec.num_layers
    extra: tuple[tuple[int, ArchSpec, LayerShape, bool], ...] = ()
    if encdec:
        enc_shape = LayerShape(b=batch_size, lq=seq_len, s=seq_len, density=1.0)
        if not decode:  # the encoder is bidirectional
            add_layers(spec.num_layers, spec.with_(causal=False), enc_shape, main.traits)
        # the encoder output is projected once per sequence (cached while decoding)
        cross = LayerShape(
            b=batch_size,
            lq=main.shape.lq,
            s=seq_len,
            density=1.0,
            cross=True,
            kv_new=0 if decode else seq_len,
        )
        add_layers(spec.num_decoder_layers, spec, main.shape, main.traits)
        add_layers(spec.num_decoder_layers, spec, cross, main.traits)
        n_self = spec.num_decoder_layers
        extra = (
            (spec.num_layers, spec.with_(causal=False), enc_shape, True),
            (spec.num_decoder_layers, spec, cross, False),
        )
    else:
        for g in groups:
            add_layers(g.count, g.spec, g.shape, g.traits)
    head_tokens = batch_size * main.shape.lq
    tokens = batch_size * main.shape.lq
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
    add("embeddings", 0.0, emb_ew, main.traits)
    if spec.final_norm:
        add("norms", 0.0, head_tokens * d * ew[spec.norm], main.traits)
    if spec.lm_head:
        add("lm_head", 2.0 * head_tokens * d * v, 0.0, main.traits)
    if spec.pooler:
        add("pooler", 2.0 * batch_size * d * d, batch_size * d * 8, main.traits)

    # -- memory
    n_params = parameter_count(spec)
    param_bytes = n_params * bpe
    grad_bytes = n_params * bpe if training else 0
    opt_bytes = _optimizer_bytes(n_params, bpe, optimizer, notes) if training else 0
    kv_bytes = 0
    if decode:
        context = self_len + new_tokens
        kv_groups = (
            [(spec.num_decoder_layers, main.cache_slots)]
            if encdec
            else [(g.count, g.cache_slots) for g in groups]
        )
        for n, slots in kv_groups:
            if kv_dtype is not None:
                kv_bytes += quantized_kv_bytes(spec, n, batch_size, slots, context, kv_dtype, bpe)
            else:
                kv_bytes += 2 * n * batch_size * spec.kv_dim * slots * bpe
        if kv_dtype is not None:
            notes.append(f"KV cache in {kv_dtype} (KIVI: keys per channel, values per token)")
        if encdec:  # the cross-attention caches stay float
            kv_bytes += 2 * spec.num_decoder_layers * batch_size * spec.kv_dim * seq_len * bpe
    stored = max(g.shape.s for g in groups)
    score_pairs = batch_size * spec.num_heads * main.shape.lq * stored
    score_bytes = score_pairs * (4 if bpe < 4 else bpe)

    def peak(traits: BackendTraits | None, ckpt: bool) -> tuple[float, dict[str, float]]:
        others = tuple(
            (g.count, g.spec, g.shape, traits or g.traits) for g in groups[1:] if not encdec
        )
        return activations(
            main.spec,
            main.shape,
            traits or main.traits,
            bpe,
            mode,
            n_self,
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
    chosen = int(act)
    for name, b in comps.items():
        by[name].activation_bytes += b
    total = param_bytes + grad_bytes + opt_bytes + kv_bytes + chosen
    density = main.shape.density
    if len(groups) > 1:
        density = sum(g.count * g.shape.density for g in groups) / spec.num_layers
        notes.append(
            "layers by window: "
            + "; ".join(
                f"{g.count} {group_label(g)} (density {g.shape.density:.3f})" for g in groups
            )
        )
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
        backend=main.backend
        if len(groups) == 1
        else "+".join(dict.fromkeys(g.backend for g in groups)),
        checkpointing=checkpointing and training,
        by_component=by,
        flops=sum(c.flops for c in by.values()),
        matmul_flops=sum(c.matmul_flops for c in by.values()),
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
        layer_backends={group_label(g): g.backend for g in groups} if len(groups) > 1 else {},
    )


def sequence_sweep(config_or_model: Any, seq_lens: list[int], **kwargs: Any) -> list[CostReport]:
    """:func:`estimate` at each sequence length (same keyword arguments)."""
    return [estimate(config_or_model, seq_len=n, **kwargs) for n in seq_lens]
