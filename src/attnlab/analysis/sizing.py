"""Sizing a decoder from a budget: layers, width, heads, key/value heads and positions.

The tutorial's ``recommend_hyperparameters`` (section 10.2) maps a task to fixed sizes.
Here the sizes follow from what the user has: a parameter or compute budget, a token
budget, a context length and a machine (memory, measured matmul throughput). Each choice
carries its reason and the cost model's numbers for the chosen shape
(:func:`attnlab.analysis.cost.estimate`), so the advice can be checked, not trusted.

Sources of the rules:

* Compute-optimal training (Hoffmann et al., 2022, "Training Compute-Optimal Large
  Language Models", Table 3 and section 3): parameters ``N`` and tokens ``D`` grow in equal
  proportion with compute, about 20 tokens per parameter, with training compute
  ``C ≈ 6·N·D``. So ``N ≈ sqrt(C / 120)`` and ``D ≈ 20·N``.
* Shape (Kaplan et al., 2020, "Scaling Laws for Neural Language Models", Figure 5): at a
  fixed non-embedding parameter count the loss changes by a few percent at most over a wide
  range of aspect ratios ``d_model / n_layers`` (about 20 to 200); we aim for 32-128,
  the range most released models sit in (GPT-2 small: 64; Llama-2 7B: 128), with
  ``head_dim`` 64 (128 from width 2048).
* Key/value heads (Ainslie et al., 2023, GQA): grouped-query attention keeps quality close
  to multi-head attention while dividing the KV cache by the group size; chosen when the
  KV cache of the stated context is a large share of the memory budget.
* Positions (Press et al., 2022, ALiBi; and ``attnlab experiment extrapolation``): when the
  model must read longer inputs than it was trained on, ALiBi extrapolates; RoPE otherwise.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from attnlab._validate import check_int, check_real
from attnlab.analysis.arch import ArchSpec
from attnlab.analysis.cost import estimate, human_bytes, human_flops

__all__ = ["TOKENS_PER_PARAMETER", "SizingAdvice", "size_model"]

#: Hoffmann et al. (2022), Table 3: compute-optimal tokens per parameter (about 20).
TOKENS_PER_PARAMETER = 20.0
#: Training FLOPs per parameter per token (forward + backward), Kaplan et al. (2020), 2.1.
TRAIN_FLOPS_PER_PARAM_TOKEN = 6.0
#: Aspect ratios (d_model / n_layers) considered harmless (Kaplan et al., 2020, Fig. 5).
ASPECT_RANGE = (32.0, 128.0)
#: Matmul throughput measured on the project's 2-core CPU (shared/NOTES.md), GFLOP/s.
CPU_GFLOPS = {"float32": 175.0, "bfloat16": 400.0}
#: Share of the peak a training step reaches in practice (assumed; stated in the reasons).
TRAIN_UTILISATION = 0.5
GIB = 1024**3


@dataclass
class SizingAdvice:
    """A sized architecture and why.

    Attributes:
        arch: the recommended :class:`ArchSpec`.
        parameters: its parameter count (from the cost model).
        tokens: training tokens recommended (or given).
        train_flops: ``6·N·D``.
        train_hours: estimated training time at the stated throughput.
        train_memory_bytes: memory of one training step at ``batch_size`` x ``context``.
        kv_cache_bytes: KV cache of one sequence of ``context`` tokens when decoding.
        checkpointing: whether gradient checkpointing is needed to fit the memory.
        reasons: one line per choice, with its numbers.
        fits: whether training fits the memory budget.
    """

    arch: ArchSpec
    parameters: int
    tokens: float
    train_flops: float
    train_hours: float
    train_memory_bytes: int
    kv_cache_bytes: int
    checkpointing: bool
    reasons: list[str] = field(default_factory=list)
    fits: bool = True

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``json.dumps`` (finite numbers only)."""
        d = asdict(self)
        d["arch"] = asdict(self.arch)
        return d

    def summary(self) -> str:
        a = self.arch
        lines = [
            f"recommended: {a.num_layers} layers, width {a.hidden_size}, {a.num_heads} heads of "
            f"{a.head_dim}, {a.num_kv_heads} key/value heads ({a.attention_kind}), feed-forward "
            f"{a.intermediate_size} (SwiGLU), positions {a.position}"
            + (f", window {a.window}" if a.window else ""),
            f"  parameters {self.parameters / 1e6:.1f} M, training tokens {self.tokens / 1e6:.1f} M, "
            f"compute {human_flops(self.train_flops)} (~{self.train_hours:.2f} h), "
            f"step memory {human_bytes(self.train_memory_bytes)}"
            + (" with checkpointing" if self.checkpointing else "")
            + f", KV cache per sequence {human_bytes(self.kv_cache_bytes)}",
        ]
        lines += [f"  - {r}" for r in self.reasons]
        if not self.fits:
            lines.append("  ! does not fit the memory budget even with checkpointing")
        return "\n".join(lines)


def _positive(name: str, value: Any, *, integer: bool = False) -> None:
    if integer:
        check_int(name, value, min_value=1)
    else:
        check_real(name, value, gt=0.0)


def _round_to(x: float, m: int) -> int:
    return max(m, round(x / m) * m)


def _shape(
    n_target: float, vocab: int, tie: bool
) -> tuple[int, int, int, int, int]:  # layers, width, heads, head_dim, ffn
    """Layers and width whose parameter count is closest to ``n_target``, aspect in range."""
    cands: list[tuple[float, float, tuple[int, int, int, int, int]]] = []
    for width in range(128, 16385, 64):
        head_dim = 128 if width >= 2048 else 64
        if width % head_dim:
            continue
        ffn = _round_to(8 * width / 3, 64)
        per_layer = 4 * width * width + 3 * width * ffn + 2 * width  # attn (MHA) + SwiGLU + norms
        emb = vocab * width * (1 if tie else 2)
        layers_f = (n_target - emb) / per_layer
        if layers_f < 1:
            continue
        for layers in {max(1, math.floor(layers_f)), max(1, math.ceil(layers_f))}:
            aspect = width / layers
            if not ASPECT_RANGE[0] <= aspect <= ASPECT_RANGE[1]:
                continue
            n = emb + layers * per_layer
            shape = (layers, width, width // head_dim, head_dim, ffn)
            cands.append((abs(math.log(n / n_target)), abs(math.log(aspect / 64)), shape))
    # within 5% of the target, prefer the aspect ratio nearest 64; otherwise the closest count
    close = [c for c in cands if c[0] <= 0.05]
    best = min(close, key=lambda c: c[1]) if close else min(cands, default=None)
    if best is None:  # the budget is below the smallest shape in range
        width, head_dim = 128, 64
        return 1, width, width // head_dim, head_dim, _round_to(8 * width / 3, 64)
    return best[2]


def size_model(
    *,
    context: int,
    memory_gb: float,
    params: float | None = None,
    compute_flops: float | None = None,
    hours: float | None = None,
    tokens: float | None = None,
    vocab_size: int = 32000,
    batch_size: int = 1,
    extrapolation: float = 1.0,
    dtype: str = "float32",
    throughput_gflops: float | None = None,
    tie_embeddings: bool = True,
) -> SizingAdvice:
    """Recommend a decoder's shape from a budget, with reasons in numbers.

    Exactly one budget: ``params`` (parameters), ``compute_flops`` (training FLOPs) or
    ``hours`` (training time on the stated machine). With ``tokens`` also given, the
    advice says how far it is from compute-optimal instead of choosing the token count.

    Args:
        context: tokens per training sequence (and the decoding context).
        memory_gb: memory available (GiB).
        params, compute_flops, hours: the budget (one of them).
        tokens: training tokens available (default: compute-optimal, 20 per parameter).
        vocab_size: vocabulary.
        batch_size: sequences per training step.
        extrapolation: how many times ``context`` the model must read at inference.
        dtype: ``"float32"`` or ``"bfloat16"`` (training and decoding).
        throughput_gflops: measured matmul throughput (default: this project's 2-core CPU).
        tie_embeddings: share the input and output embedding matrices.

    Returns:
        :class:`SizingAdvice`.

    Raises:
        ValueError: no budget or several, or a number that is not positive and finite.
    """
    _check_request(
        context=context,
        memory_gb=memory_gb,
        budgets={"params": params, "compute_flops": compute_flops, "hours": hours},
        tokens=tokens,
        vocab_size=vocab_size,
        batch_size=batch_size,
        extrapolation=extrapolation,
        dtype=dtype,
        throughput_gflops=throughput_gflops,
    )
    peak = (throughput_gflops or CPU_GFLOPS[dtype]) * 1e9
    flops_per_s = peak * TRAIN_UTILISATION
    reasons: list[str] = []
    n_target = _parameter_target(
        params=params,
        compute_flops=compute_flops,
        hours=hours,
        tokens=tokens,
        peak=peak,
        flops_per_s=flops_per_s,
        reasons=reasons,
    )
    budget = memory_gb * GIB
    shrunk = 0
    while True:
        sized = _size_for(
            n_target,
            context=context,
            budget=budget,
            vocab_size=vocab_size,
            batch_size=batch_size,
            extrapolation=extrapolation,
            dtype=dtype,
            tie_embeddings=tie_embeddings,
        )
        if sized[0] or shrunk >= 40 or (sized[1].num_layers == 1 and sized[1].hidden_size == 128):
            break
        n_target *= 0.85
        shrunk += 1
    fits, spec, train, checkpointing, shape_reasons = sized
    if shrunk:
        reasons.append(
            f"memory-bound: the budget's size does not train in {memory_gb:g} GiB even with "
            f"checkpointing; shrunk to {train.parameter_count / 1e6:.1f} M parameters, the "
            "largest shape that fits"
        )
    reasons += shape_reasons
    n = train.parameter_count
    tokens = _training_tokens(tokens, n, reasons)
    train_flops = TRAIN_FLOPS_PER_PARAM_TOKEN * n * tokens
    decode = estimate(spec, seq_len=int(context * extrapolation), mode="decode", dtype=dtype)
    return SizingAdvice(
        arch=spec,
        parameters=n,
        tokens=float(tokens),
        train_flops=train_flops,
        train_hours=train_flops / flops_per_s / 3600,
        train_memory_bytes=int(train.total_bytes),
        kv_cache_bytes=int(decode.kv_cache_bytes),
        checkpointing=checkpointing,
        reasons=reasons,
        fits=fits,
    )


def _check_request(
    *,
    context: int,
    memory_gb: float,
    budgets: dict[str, float | None],
    tokens: float | None,
    vocab_size: int,
    batch_size: int,
    extrapolation: float,
    dtype: str,
    throughput_gflops: float | None,
) -> None:
    """Refuse a bad request with its value: exactly one budget, every number positive."""
    _positive("context", context, integer=True)
    _positive("memory_gb", memory_gb)
    _positive("vocab_size", vocab_size, integer=True)
    _positive("batch_size", batch_size, integer=True)
    _positive("extrapolation", extrapolation)
    if extrapolation < 1:
        raise ValueError(f"extrapolation must be >= 1 (times the context), got {extrapolation!r}")
    given = [k for k, v in budgets.items() if v is not None]
    if len(given) != 1:
        raise ValueError(f"pass exactly one budget of params, compute_flops, hours; got {given}")
    for k in given:
        _positive(k, budgets[k])
    if tokens is not None:
        _positive("tokens", tokens)
    if dtype not in CPU_GFLOPS:
        raise ValueError(f"dtype must be one of {sorted(CPU_GFLOPS)}, got {dtype!r}")
    if throughput_gflops is not None:
        _positive("throughput_gflops", throughput_gflops)


def _parameter_target(
    *,
    params: float | None,
    compute_flops: float | None,
    hours: float | None,
    tokens: float | None,
    peak: float,
    flops_per_s: float,
    reasons: list[str],
) -> float:
    """The parameter count the budget buys: given, or from the compute (``hours`` at
    ``flops_per_s``, ``peak`` times the utilisation), compute-optimal (Hoffmann et al.)
    unless the tokens are fixed."""
    if hours is not None:
        compute_flops = hours * 3600 * flops_per_s
        reasons.append(
            f"{hours:g} h at {peak / 1e9:.0f} GFLOP/s x {TRAIN_UTILISATION:.0%} utilisation "
            f"(assumed) = {human_flops(compute_flops)} of training compute"
        )
    if compute_flops is None:
        assert params is not None
        return float(params)
    if tokens is not None:
        n_target = compute_flops / (TRAIN_FLOPS_PER_PARAM_TOKEN * tokens)
        reasons.append(
            f"{tokens / 1e6:.1f} M tokens fix N = C / (6 D) = {n_target / 1e6:.1f} M parameters"
        )
        return n_target
    # C = 6 N D, D = 20 N  =>  N = sqrt(C / 120)
    n_target = math.sqrt(compute_flops / (TRAIN_FLOPS_PER_PARAM_TOKEN * TOKENS_PER_PARAMETER))
    reasons.append(
        f"compute-optimal (Hoffmann et al. 2022): N = sqrt(C / (6 x 20)) = "
        f"{n_target / 1e6:.1f} M parameters for {human_flops(compute_flops)}"
    )
    return n_target


def _training_tokens(tokens: float | None, n: int, reasons: list[str]) -> float:
    """Compute-optimal tokens for ``n`` parameters, or a verdict on the tokens given."""
    if tokens is None:
        tokens = TOKENS_PER_PARAMETER * n
        reasons.append(f"tokens: {TOKENS_PER_PARAMETER:.0f} per parameter = {tokens / 1e6:.1f} M")
        return tokens
    ratio = tokens / n
    verdict = (
        "under-trained for its size (a smaller model would reach a lower loss)"
        if ratio < TOKENS_PER_PARAMETER / 2
        else "past compute-optimal (fine when inference cost matters more than training)"
        if ratio > 2 * TOKENS_PER_PARAMETER
        else "close to compute-optimal"
    )
    reasons.append(f"tokens: {ratio:.0f} per parameter: {verdict} (Hoffmann et al.: ~20)")
    return tokens


def _size_for(
    n_target: float,
    *,
    context: int,
    budget: float,
    vocab_size: int,
    batch_size: int,
    extrapolation: float,
    dtype: str,
    tie_embeddings: bool,
) -> tuple[bool, ArchSpec, Any, bool, list[str]]:
    """``(fits, spec, training CostReport, checkpointing, reasons)`` for one parameter target."""
    reasons: list[str] = []
    memory_gb = budget / GIB
    layers, width, heads, head_dim, ffn = _shape(n_target, vocab_size, tie_embeddings)
    reasons.append(
        f"shape: width {width} / {layers} layers = aspect {width / layers:.0f}, inside the "
        f"{ASPECT_RANGE[0]:.0f}-{ASPECT_RANGE[1]:.0f} range where shape barely matters "
        f"(Kaplan et al. 2020, Fig. 5); head_dim {head_dim}"
    )

    position = "alibi" if extrapolation > 1 else "rope"
    if extrapolation > 1:
        reasons.append(
            f"positions: ALiBi, because inputs reach {extrapolation:g}x the training length; "
            "ALiBi's perplexity stays flat past the training length where sinusoidal and RoPE "
            "degrade (Press et al. 2022; `attnlab experiment extrapolation` reruns it)"
        )
    else:
        reasons.append(
            "positions: RoPE (no extrapolation asked; the usual choice of Llama-style models)"
        )

    def spec_with(kv: int, window: int | None = None) -> ArchSpec:
        return ArchSpec(
            name="sized",
            num_layers=layers,
            hidden_size=width,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            ffn="gated",
            intermediate_size=ffn,
            vocab_size=vocab_size,
            activation="silu",
            causal=True,
            position=position,
            max_positions=context,
            learned_positions=False,
            norm="rmsnorm",
            final_norm=True,
            attention_bias=False,
            attention_out_bias=False,
            mlp_bias=False,
            lm_head=True,
            tied_embeddings=tie_embeddings,
            window=window,
        )

    # key/value heads: GQA when one sequence's KV cache at the longest context would take
    # more than a tenth of the memory budget (Ainslie et al. 2023)
    decode_ctx = int(context * extrapolation)
    kv = heads
    mha = estimate(spec_with(heads), seq_len=decode_ctx, mode="decode", dtype=dtype)
    if mha.kv_cache_bytes > 0.1 * budget:
        for kv in sorted((d for d in range(1, heads + 1) if heads % d == 0), reverse=True):
            cand = estimate(spec_with(kv), seq_len=decode_ctx, mode="decode", dtype=dtype)
            if cand.kv_cache_bytes <= 0.1 * budget:
                break
        reasons.append(
            f"key/value heads: {kv} of {heads} ({spec_with(kv).attention_kind}, Ainslie et al. "
            f"2023): the MHA cache of {decode_ctx} tokens is {human_bytes(mha.kv_cache_bytes)}, "
            f"over a tenth of {memory_gb:g} GiB"
        )
    else:
        reasons.append(
            f"key/value heads: {heads} (MHA): its cache of {decode_ctx} tokens is "
            f"{human_bytes(mha.kv_cache_bytes)}, under a tenth of {memory_gb:g} GiB"
        )
    spec = spec_with(kv)

    def train_cost(ckpt: bool) -> Any:
        return estimate(
            spec,
            seq_len=context,
            batch_size=batch_size,
            mode="training",
            dtype=dtype,
            checkpointing=ckpt,
        )

    train = train_cost(False)
    checkpointing = train.total_bytes > budget
    if checkpointing:
        plain = train.total_bytes
        train = train_cost(True)
        reasons.append(
            f"gradient checkpointing: a training step needs {human_bytes(plain)} without it, "
            f"{human_bytes(train.total_bytes)} with it, budget {memory_gb:g} GiB"
        )
    else:
        reasons.append(
            f"no checkpointing needed: a training step of {batch_size} x {context} tokens "
            f"needs {human_bytes(train.total_bytes)} of {memory_gb:g} GiB"
        )
    emb_share = vocab_size * spec.hidden_size / train.parameter_count
    if emb_share > 0.4:
        reasons.append(
            f"embeddings are {emb_share:.0%} of the parameters at vocabulary {vocab_size}: a "
            "smaller vocabulary (or bytes) leaves more of the budget to the layers"
        )
    return train.total_bytes <= budget, spec, train, checkpointing, reasons
