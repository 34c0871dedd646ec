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

from dataclasses import dataclass
from typing import Any, Literal

from attnlab._validate import check_int, check_positive_int
from attnlab.analysis.arch import ArchSpec, describe
from attnlab.analysis.cost_attention import (
    LayerGroup,
    auto_backend,
    group_label,
    self_attention,
)
from attnlab.analysis.cost_kv import check_kv_dtype, kv_cache_bytes
from attnlab.analysis.cost_layers import (
    BACKEND_TRAITS,
    ELEMENTWISE_FLOPS,
    BackendTraits,
    parameter_count,
    register_backend_traits,
    traits_of,
)
from attnlab.analysis.cost_memory import activation_peaks
from attnlab.analysis.cost_report import (
    ComponentCost,
    CostReport,
    _dtype,
    dtype_bytes,
    human_bytes,
    human_flops,
)
from attnlab.analysis.cost_work import Work, head_work, stack_work
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
    _check_arguments(
        sizes={"batch_size": batch_size, "seq_len": seq_len, "new_tokens": new_tokens}
        | {"expert_parallel": expert_parallel},
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
    cache = _cache_kind(cache, mode=mode, windowed=windowed)
    kv_dtype = check_kv_dtype(kv_dtype, mode, cache)
    request = _Request(
        batch_size=batch_size,
        seq_len=seq_len,
        mode=mode,
        dtype=_dtype(dtype),
        backend=backend,
        new_tokens=new_tokens,
        target_len=target_len,
        checkpointing=checkpointing,
        optimizer=optimizer,
        mask=mask,
        masked=masked,
        cache=cache,
        cache_capacity=cache_capacity,
        kv_dtype=kv_dtype,
        expert_parallel=expert_parallel,
    )
    return _cost(spec, request, windowed=windowed)


@dataclass(frozen=True)
class _Request:
    """The arguments of :func:`estimate`, checked (``dtype``: its name and bytes)."""

    batch_size: int
    seq_len: int
    mode: str
    dtype: tuple[str, int]
    backend: str
    new_tokens: int
    target_len: int | None
    checkpointing: bool
    optimizer: str | None
    mask: Any
    masked: bool | None
    cache: str
    cache_capacity: int | None
    kv_dtype: str | None
    expert_parallel: int

    @property
    def training(self) -> bool:
        return self.mode == "training"

    @property
    def decode(self) -> bool:
        return self.mode == "decode"


def _cost(spec: ArchSpec, req: _Request, *, windowed: bool) -> CostReport:
    """The cost of one request: the layers' groups, their work, then the memory."""
    (dtype_name, bpe), training, decode = req.dtype, req.training, req.decode
    encdec = spec.num_decoder_layers > 0
    # -- the self-attention of the (decoder or encoder) stack, one group per window
    spec, self_len = _self_attention_length(spec, req.seq_len, req.target_len, decode=decode)
    groups = _window_groups(spec, req, self_len)
    main = groups[0]
    masked = req.masked
    if masked is None:
        masked = req.mask is not None or spec.causal or windowed or spec.pattern_density is not None
    notes = _backend_notes(groups, req.backend)
    # -- work
    work = Work(training=training, checkpointing=req.checkpointing, masked=bool(masked))
    n_self, extra = stack_work(
        work, spec, groups, batch_size=req.batch_size, seq_len=req.seq_len, decode=decode
    )
    tokens = req.batch_size * main.shape.lq
    head_work(work, spec, main.traits, tokens=tokens, batch=req.batch_size)
    # -- memory
    n_params = parameter_count(spec)
    param_bytes = n_params * bpe
    grad_bytes = n_params * bpe if training else 0
    opt_bytes = _optimizer_bytes(n_params, bpe, req.optimizer, notes) if training else 0
    kv_bytes = _decode_kv_bytes(spec, groups, req, self_len, notes) if decode else 0
    score_pairs = req.batch_size * spec.num_heads * main.shape.lq * max(g.shape.s for g in groups)
    variants, act, comps = activation_peaks(
        groups,
        bpe,
        req.mode,
        n_self,
        checkpointing=req.checkpointing,
        head_tokens=tokens,
        extra=extra,
        mixed=not encdec,
    )
    chosen = int(act)
    by = work.by_component
    for name, b in comps.items():
        by[name].activation_bytes += b
    total = param_bytes + grad_bytes + opt_bytes + kv_bytes + chosen
    density = _density(spec, groups, req.mask, notes)
    a2a = _moe_traffic(spec, tokens, req.expert_parallel, bpe, training, notes)
    return CostReport(
        arch=spec,
        mode=req.mode,
        batch_size=req.batch_size,
        seq_len=req.seq_len,
        new_tokens=req.new_tokens if decode else 0,
        dtype=dtype_name,
        backend=main.backend
        if len(groups) == 1
        else "+".join(dict.fromkeys(g.backend for g in groups)),
        checkpointing=req.checkpointing and training,
        by_component=by,
        flops=sum(c.flops for c in by.values()),
        matmul_flops=sum(c.matmul_flops for c in by.values()),
        forward_matmul_flops=work.forward_matmul_flops,
        attention_density=density,
        parameter_count=n_params,
        parameter_bytes=param_bytes,
        gradient_bytes=grad_bytes,
        optimizer_bytes=opt_bytes,
        kv_cache_bytes=kv_bytes,
        activation_bytes=chosen,
        activation_variants=variants,
        score_matrix_bytes=int(score_pairs * (4 if bpe < 4 else bpe)),
        total_bytes=int(total),
        notes=notes,
        active_parameter_count=active_parameter_count(spec, n_params),
        all_to_all_bytes=a2a,
        layer_backends={group_label(g): g.backend for g in groups} if len(groups) > 1 else {},
    )


def _decode_kv_bytes(
    spec: ArchSpec, groups: list[LayerGroup], req: _Request, self_len: int, notes: list[str]
) -> int:
    """The KV caches after one decoding step: each window group's self-attention cache
    (an encoder-decoder's decoder: one), and an encoder-decoder's float cross caches."""
    encdec = spec.num_decoder_layers > 0
    if req.kv_dtype is not None:
        notes.append(f"KV cache in {req.kv_dtype} (KIVI: keys per channel, values per token)")
    return kv_cache_bytes(
        spec,
        [(spec.num_decoder_layers, groups[0].cache_slots)]
        if encdec
        else [(g.count, g.cache_slots) for g in groups],
        batch_size=req.batch_size,
        context=self_len + req.new_tokens,
        kv_dtype=req.kv_dtype,
        bytes_per_element=req.dtype[1],
        cross_len=req.seq_len if encdec else 0,
    )


def _cache_kind(cache: str | None, *, mode: str, windowed: bool) -> str:
    """The decoding cache by name: what ``DecoderLM.new_cache()`` builds when None."""
    if cache is None:
        cache = "sliding" if windowed else "dynamic"
    if cache == "contiguous":
        cache = "dynamic"
    if cache not in ("dynamic", "static", "sliding"):
        raise ValueError(f"cache must be 'dynamic', 'static' or 'sliding', got {cache!r}")
    if mode == "decode" and cache == "sliding" and not windowed:
        raise ValueError("cache='sliding' needs a window (config or window=)")
    return cache


def _self_attention_length(
    spec: ArchSpec, seq_len: int, target_len: int | None, *, decode: bool
) -> tuple[ArchSpec, int]:
    """The spec of the self-attention stack and its tokens: an encoder-decoder's decoder
    runs over ``target_len`` tokens (decode: ``target_len`` decoded so far), causally."""
    if spec.num_decoder_layers == 0:
        return spec, seq_len
    self_len = target_len if target_len is not None else (0 if decode else seq_len)
    if self_len < 0 or (self_len == 0 and not decode):
        raise ValueError(f"target_len must be a positive int, got {target_len!r}")
    return spec.with_(causal=True), self_len


def _window_groups(spec: ArchSpec, req: _Request, self_len: int) -> list[LayerGroup]:
    """One group per window of the layout: its shape, cache slots and backend."""
    groups: list[LayerGroup] = []
    for w, count in spec.window_groups:
        g_spec = spec.with_(window=w, layer_windows=None, num_layers=count)
        shape, slots = self_attention(
            g_spec,
            batch_size=req.batch_size,
            self_len=self_len,
            decode=req.decode,
            new_tokens=req.new_tokens,
            cache=req.cache,
            cache_capacity=req.cache_capacity,
            mask=req.mask,
        )
        name = auto_backend(
            req.backend, g_spec, shape, mode=req.mode, dtype=req.dtype[0], mask=req.mask
        )
        groups.append(LayerGroup(g_spec, shape, slots, name, traits_of(name)))
    return groups


def _backend_notes(groups: list[LayerGroup], backend: str) -> list[str]:
    notes = []
    for g in groups:
        if backend == "auto":
            where = "" if len(groups) == 1 else f" on the {group_label(g)}"
            notes.append(f"auto resolves to {g.backend!r}{where} (the registry's choice)")
        if g.backend not in BACKEND_TRAITS:
            notes.append(f"no traits registered for backend {g.backend!r}: costed like 'sdpa'")
    return notes


def _density(spec: ArchSpec, groups: list[LayerGroup], mask: Any, notes: list[str]) -> float:
    """The attention density over all layers (weighted by group), noted when it matters."""
    density = groups[0].shape.density
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
    return density


def _moe_traffic(
    spec: ArchSpec, tokens: int, parallel: int, bpe: int, training: bool, notes: list[str]
) -> float:
    """All-to-all bytes of the MoE layers over ``parallel`` devices (0 for a dense model)."""
    if spec.moe is None:
        return 0.0
    notes.append(
        f"MoE: {spec.moe.num_layers} layers route each token to {spec.moe.top_k} of "
        f"{spec.moe.num_experts} experts (dropless: no capacity padding); activations of "
        "the MoE feed-forward are costed as a dense one"
    )
    return all_to_all_bytes(
        tokens,
        spec.hidden_size,
        spec.moe,
        parallel=parallel,
        bytes_per_element=bpe,
        backward=training,
    )


def sequence_sweep(config_or_model: Any, seq_lens: list[int], **kwargs: Any) -> list[CostReport]:
    """:func:`estimate` at each sequence length (same keyword arguments)."""
    return [estimate(config_or_model, seq_len=n, **kwargs) for n in seq_lens]
