"""The cost model of the state-space and recurrent models: Mamba, Mamba-2, RWKV-4, RetNet.

Where a Transformer's decoding memory is a KV cache growing with the context
(``2 * layers * kv_heads * head_dim`` elements per token), these models carry a state of
fixed size (:mod:`attnlab.cache.recurrent`); a decoding step costs the same at every
context, and a forward over ``L`` tokens is linear in ``L``.

Counting conventions follow :mod:`attnlab.analysis.cost`: ``matmul_flops`` are what
``torch.utils.flop_counter.FlopCounterMode`` counts for attnlab's implementation (linear
layers, the depthwise convolution, and the contractions of the chunked scans:
``C . h`` in Mamba, the SSD's five products in Mamba-2, the chunkwise retention's four;
RWKV's WKV is element-wise); element-wise work is an estimate (per-element counts in the
code below); the backward pass costs twice the forward's matmuls.

Training activations are the bytes autograd saves for the backward pass of attnlab's
modules. They are linear in ``L``; the coefficients (elements per token per layer) were
counted from the saved tensors of this implementation (the tests measure them with
``torch.autograd.graph.saved_tensors_hooks`` and keep the estimate within 10 %):

* Mamba: ``4.19 E N + 14 E`` (the chunked scan keeps its decays, inputs and states, each
  ``E x N`` per token);
* Mamba-2: ``12.9 E + 0.58 H P N + 2.5 H T + 54 H`` (``T`` the chunk size);
* RWKV-4: ``39 C + 2.5 I``;
* RetNet: ``28 D + 4.75 I + H T + 1.5 H K V / T``.

Shape notation: ``B`` batch, ``L`` tokens, ``D`` width, ``E`` inner width, ``N`` state
size, ``H`` heads, ``P``/``K``/``V`` head dims, ``C`` WKV width, ``I`` feed-forward width,
``T`` chunk size, ``V_ocab`` vocabulary, ``n`` layers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from attnlab._validate import check_positive_int
from attnlab.models.recurrent_config import MambaConfig, RetNetConfig, RWKVConfig

__all__ = [
    "RecurrentCost",
    "estimate_recurrent",
    "is_recurrent",
    "recurrent_config",
    "state_bytes",
]

RecurrentConfig = MambaConfig | RWKVConfig | RetNetConfig
Mode = Literal["inference", "training", "decode"]
_DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float64": 8,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
}


def recurrent_config(config_or_model: Any) -> RecurrentConfig | None:
    """The recurrent config of a config or model, or None for anything else."""
    cfg = getattr(config_or_model, "config", config_or_model)
    return cfg if isinstance(cfg, MambaConfig | RWKVConfig | RetNetConfig) else None


def is_recurrent(config_or_model: Any) -> bool:
    """True for Mamba/Mamba-2/RWKV/RetNet configs and models."""
    return recurrent_config(config_or_model) is not None


def _bytes_per(dtype: Any) -> tuple[str, int]:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)}, got {dtype!r}")
    return name, _DTYPE_BYTES[name]


@dataclass
class _Shape:
    """Per-layer counts of one architecture."""

    layer_params: int  # parameters of one layer
    layer_matmul: float  # matmul FLOPs of one layer per token (forward, chunked/parallel form)
    layer_matmul_step: float  # matmul FLOPs of one layer per decoded token (recurrent form)
    layer_elementwise: float  # element-wise FLOPs of one layer per token
    layer_state: int  # state elements of one layer per sequence
    layer_saved: float  # saved activation elements of one layer per token (training)
    extra_params: int  # embeddings, final norm, head


def _shape(c: RecurrentConfig, seq_len: int, batch_size: int = 1) -> _Shape:
    d, v = c.hidden_size, c.vocab_size
    head = 0 if c.tie_word_embeddings else v * d
    if isinstance(c, MambaConfig):
        e, n, k = c.intermediate_size, c.state_size, c.conv_kernel
        blk = max(1, min(64, 2**17 // max(1, batch_size * e * n)))  # as SelectiveScanFn
        conv_b = e if c.use_conv_bias else 0
        bias = (2 * e + d) if c.use_bias else 0
        t = min(c.chunk_size, max(seq_len, 1))
        if c.version == 1:
            r = c.dt_rank or 1
            lin = d * 2 * e + e * (r + 2 * n) + r * e + e * d
            params = (
                lin + e * k + conv_b + r * 0 + e + e * n + e + d + bias
            )  # + dt bias, A, D, norm
            mm = 2 * lin + 2 * e * k
            return _Shape(
                layer_params=params,
                layer_matmul=mm,  # the chunked scan reads C . h element-wise (mul + sum)
                layer_matmul_step=mm + 2 * e * n,  # the one-token step reads it as a product
                # chunked scan: two passes of decay, product, input, (read) per (channel, state)
                layer_elementwise=10 * e * n + 12 * e,
                layer_state=e * (k - 1) + e * n,
                # the reverse-scan backward (functional/ssm_backward.py) keeps delta, delta u,
                # B, C and the state entering each block of blk tokens; the rest is the module's
                layer_saved=14 * e + 2 * n + e * n * -(-seq_len // blk) / max(1, seq_len),
                extra_params=v * d + d + head,
            )
        assert c.num_heads is not None
        h, p, g = c.num_heads, c.head_dim, c.n_groups
        conv_dim = e + 2 * g * n
        proj = d * (e + conv_dim + h) + e * d
        params = proj + conv_dim * k + (conv_dim if c.use_conv_bias else 0) + 3 * h + e + d
        params += (e + conv_dim + h + d) if c.use_bias else 0
        nc = max(1, math.ceil(seq_len / t))
        # SSD products per token: C.B and (.)X inside chunks, chunk states, the chunk
        # recurrence, and reading the carried state
        ssd = (
            2 * h * t * n
            + 2 * h * t * p
            + 2 * h * p * n
            + 2 * h * (nc + 1) ** 2 * p * n / max(seq_len, 1)
        )
        ssd += 2 * h * p * n  # the chunk states' 3-operand einsum runs as two products
        return _Shape(
            layer_params=params,
            layer_matmul=2 * proj + 2 * conv_dim * k + ssd,
            layer_matmul_step=2 * proj + 2 * conv_dim * k + 2 * h * p * n,  # reading the state
            layer_elementwise=3 * h * t + 4 * h * p * n / t + 10 * e,
            layer_state=conv_dim * (k - 1) + h * p * n,
            layer_saved=12.9 * e + 0.58 * h * p * n + 2.5 * h * t + 54 * h,
            extra_params=v * d + d + head,
        )
    if isinstance(c, RWKVConfig):
        a, i = c.attention_hidden_size or d, c.intermediate_size or 4 * d
        lin = 3 * d * a + a * d + d * i + d * d + i * d
        params = lin + 2 * a + 5 * d + 4 * d  # decays/bonuses, mixes, two LayerNorms
        return _Shape(
            layer_params=params,
            layer_matmul=2 * lin,
            layer_matmul_step=2 * lin,
            layer_elementwise=20 * a + 3 * i + 20 * d,
            layer_state=2 * d + 3 * a,
            layer_saved=39 * a + 2.5 * i,
            extra_params=v * d + 4 * d + head,  # embeddings, pre-LN, final LN
        )
    assert c.value_dim is not None and c.intermediate_size is not None
    h, vd, i = c.num_heads, c.value_dim, c.intermediate_size
    kd, vh = d // h, vd // h
    t = min(c.chunk_size, max(seq_len, 1)) if c.form == "chunkwise" else max(seq_len, 1)
    lin = 2 * d * d + 2 * d * vd + vd * d + 3 * d * i
    params = lin + 2 * d
    # chunkwise: QK^T and (.)V in chunks, K^T V per chunk, Q R; parallel: the first two over L
    ret = 2 * h * t * kd + 2 * h * t * vh + (4 * h * kd * vh if c.form == "chunkwise" else 0)
    return _Shape(
        layer_params=params,
        layer_matmul=2 * lin + ret,
        layer_matmul_step=2 * lin + 2 * h * kd * vh,  # q S (the k^T v update is element-wise)
        layer_elementwise=4 * h * t + 6 * vd + 10 * d + 2 * i,
        layer_state=h * kd * vh,
        layer_saved=28 * d + 4.75 * i + h * t + 1.5 * h * kd * vh / t,
        extra_params=v * d + d + head,
    )


def state_bytes(config_or_model: Any, *, batch_size: int = 1, dtype: Any = "float32") -> int:
    """Bytes of the recurrent state of the whole model for ``batch_size`` sequences.

    The same at every context length: what a recurrent model carries instead of a KV cache.
    """
    c = recurrent_config(config_or_model)
    if c is None:
        raise TypeError(f"not a recurrent model or config: {type(config_or_model).__name__}")
    _, nb = _bytes_per(dtype)
    return c.num_hidden_layers * _shape(c, 1).layer_state * batch_size * nb


@dataclass
class RecurrentCost:
    """What :func:`estimate_recurrent` computes (bytes are totals over the batch).

    Attributes:
        model: ``"mamba"``, ``"mamba2"``, ``"rwkv"`` or ``"retnet"``.
        mode: ``"inference"``, ``"training"`` or ``"decode"``.
        batch_size, seq_len, dtype: what was costed (decode: ``seq_len`` tokens seen).
        flops, matmul_flops: for the mode (training: forward + backward; decode: one token).
        forward_matmul_flops: matmul FLOPs of one forward (what FlopCounterMode counts).
        parameter_count, parameter_bytes: parameters.
        state_bytes: the recurrent state (constant in ``seq_len``): in place of a KV cache.
        kv_cache_bytes: 0 (kept for reports that compare with attention models).
        activation_bytes: training: saved for backward; otherwise 0.
        gradient_bytes, optimizer_bytes: training.
        total_bytes: the sum.
        notes: assumptions.
    """

    model: str
    mode: str
    batch_size: int
    seq_len: int
    dtype: str
    flops: float
    matmul_flops: float
    forward_matmul_flops: float
    parameter_count: int
    parameter_bytes: int
    state_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    total_bytes: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        from attnlab.analysis.cost import human_bytes, human_flops

        lines = [
            f"{self.model} (recurrent state, no KV cache), mode={self.mode}, batch={self.batch_size}, "
            f"seq_len={self.seq_len}, dtype={self.dtype}",
            f"  FLOPs {human_flops(self.flops)} (matmul {human_flops(self.matmul_flops)})",
            f"  parameters {self.parameter_count:,} = {human_bytes(self.parameter_bytes)}",
            f"  state {human_bytes(self.state_bytes)} (the same at any context length)",
        ]
        if self.mode == "training":
            lines.append(
                f"  gradients {human_bytes(self.gradient_bytes)}, optimizer state "
                f"{human_bytes(self.optimizer_bytes)}, activations {human_bytes(self.activation_bytes)}"
            )
        lines.append(f"  total {human_bytes(self.total_bytes)}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _model_name(c: RecurrentConfig) -> str:
    if isinstance(c, MambaConfig):
        return "mamba" if c.version == 1 else "mamba2"
    return "rwkv" if isinstance(c, RWKVConfig) else "retnet"


def estimate_recurrent(
    config_or_model: Any,
    *,
    batch_size: int = 1,
    seq_len: int,
    mode: Mode = "inference",
    dtype: Any = "float32",
    optimizer: str | None = "adamw",
) -> RecurrentCost:
    """FLOPs and memory of a recurrent model without running it.

    Args:
        config_or_model: a :class:`MambaConfig`, :class:`RWKVConfig`, :class:`RetNetConfig`
            or a model built from one.
        batch_size: sequences ``B``.
        seq_len: tokens per sequence (decode: tokens already seen; the cost does not depend
            on it, which is the point).
        mode: ``"inference"``, ``"training"`` or ``"decode"`` (one token).
        dtype: parameter/activation dtype.
        optimizer: ``"adamw"``/``"adam"`` (two float32 states), ``"momentum"``, ``"sgd"`` or None.

    Raises:
        TypeError: not a recurrent config or model.
        ValueError: non-positive sizes, an unknown mode, dtype or optimizer.
    """
    c = recurrent_config(config_or_model)
    if c is None:
        raise TypeError(
            f"estimate_recurrent takes a MambaConfig, RWKVConfig or RetNetConfig (or a model), "
            f"got {type(config_or_model).__name__}"
        )
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        check_positive_int(name, value)
    if mode not in ("inference", "training", "decode"):
        raise ValueError(f"mode must be 'inference', 'training' or 'decode', got {mode!r}")
    states = {"adamw": 2, "adam": 2, "momentum": 1, "sgd": 0, None: 0}
    if optimizer not in states:
        raise ValueError(
            f"optimizer must be one of adamw, adam, momentum, sgd or None, got {optimizer!r}"
        )
    dname, nb = _bytes_per(dtype)
    n = c.num_hidden_layers
    sh = _shape(c, seq_len, batch_size)
    params = n * sh.layer_params + sh.extra_params
    head = 2 * c.hidden_size * c.vocab_size
    tokens = batch_size * (1 if mode == "decode" else seq_len)
    per_token_mm = n * (sh.layer_matmul_step if mode == "decode" else sh.layer_matmul) + head
    fwd_mm = tokens * per_token_mm
    ew = tokens * n * sh.layer_elementwise
    mm, flops = fwd_mm, fwd_mm + ew
    notes = [
        "element-wise FLOPs are estimates; matmul FLOPs are what FlopCounterMode counts",
    ]
    act = grads = opt = 0
    if mode == "training":
        mm, flops = 3 * fwd_mm, 3 * fwd_mm + 2 * ew
        act = int(tokens * (n * sh.layer_saved + c.hidden_size + 2 * c.vocab_size) * nb)
        grads = params * nb
        opt = params * 4 * (states[optimizer] + (1 if nb < 4 and states[optimizer] else 0))
        notes.append(
            "backward = 2x the forward's matmuls; activations counted for attnlab's modules"
        )
    st = n * sh.layer_state * batch_size * nb
    total = params * nb + grads + opt + act + (st if mode != "training" else 0)
    return RecurrentCost(
        model=_model_name(c),
        mode=mode,
        batch_size=batch_size,
        seq_len=seq_len,
        dtype=dname,
        flops=float(flops),
        matmul_flops=float(mm),
        forward_matmul_flops=float(fwd_mm),
        parameter_count=int(params),
        parameter_bytes=int(params * nb),
        state_bytes=int(st),
        kv_cache_bytes=0,
        activation_bytes=act,
        gradient_bytes=int(grads),
        optimizer_bytes=int(opt),
        total_bytes=int(total),
        notes=notes,
    )
