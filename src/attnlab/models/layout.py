"""The decoder's per-layer layout: which mixer and which feed-forward each layer has.

``DecoderConfig(layers=(LayerSpec(...), ...))`` describes dense models (every layer
``LayerSpec()``: attention + dense feed-forward), sparse ones (Mixtral: every layer
``LayerSpec(ffn="moe", moe=MoEConfig(...))``; Qwen2-MoE mixes dense and MoE layers) and,
with state-space mixers registered in :mod:`attnlab.models.mixers`, hybrids (Jamba).
See ``docs/contracts.md`` section 3.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from attnlab.functional._checks import check_int, check_positive_int, check_real
from attnlab.functional.routing import ROUTERS
from attnlab.models.linear_layout import LINEAR_MIXERS, LinearLayerConfig
from attnlab.modules.activations import activation_names

__all__ = ["FFN_KINDS", "LayerSpec", "MambaLayerConfig", "MoEConfig"]

FFN_KINDS = ("dense", "moe", "none", "rwkv")
EXPERT_MLPS = ("gated", "standard")
DISPATCHES = ("dropless", "capacity", "reference")


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts feed-forward (Shazeer et al., 2017; Fedus et al., 2021).

    Attributes:
        num_experts: routed experts ``E``.
        top_k: experts per token ``k`` (expert-choice: the average, the paper's ``c``).
        intermediate_size: each expert's inner width ``F``.
        router: ``"softmax_topk"`` (Mixtral, Qwen2-MoE, OLMoE), ``"topk_softmax"``,
            ``"switch"`` (top-1) or ``"expert_choice"`` (not causal: encoders only).
        norm_topk_prob: renormalise the top-k probabilities (``"softmax_topk"`` only).
        expert_mlp: ``"gated"`` (SwiGLU with ``silu``) or ``"standard"`` (two layers).
        hidden_act: the experts' activation.
        shared_expert_intermediate_size: width of an always-active shared expert (Qwen2-MoE;
            DeepSeekMoE's ``n`` shared experts are one expert of ``n`` times the width),
            0 for none.
        shared_expert_gate: scale the shared expert by ``sigmoid(w . x)`` (Qwen2-MoE).
        dispatch: how the routed experts run in training: ``"dropless"`` (sorted grouped
            matmuls), ``"capacity"`` (Switch dropping) or ``"reference"`` (the loop).
            Evaluation and cached decoding always run dropless.
        capacity_factor: slots per expert relative to an even split (capacity dispatch
            and expert choice): ``C = ceil(factor * k * N / E)``.
        router_jitter: multiplicative ``U(1-eps, 1+eps)`` noise on the router's input in
            training (Switch; Mixtral's ``router_jitter_noise``).
        router_noise_std: additive Gaussian noise on the router logits in training
            (noisy top-k gating, Shazeer et al., 2017).
        router_aux_loss_coef: weight of the load-balancing loss added to a training loss.
        router_z_loss_coef: weight of the router z-loss (ST-MoE) added to a training loss.
    """

    num_experts: int = 8
    top_k: int = 2
    intermediate_size: int = 14336
    router: str = "softmax_topk"
    norm_topk_prob: bool = True
    expert_mlp: str = "gated"
    hidden_act: str = "silu"
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    dispatch: str = "dropless"
    capacity_factor: float = 1.25
    router_jitter: float = 0.0
    router_noise_std: float = 0.0
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        check_positive_int("num_experts", self.num_experts)
        check_positive_int("top_k", self.top_k)
        check_positive_int("intermediate_size", self.intermediate_size)
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        for name, value, allowed in (
            ("router", self.router, ROUTERS),
            ("expert_mlp", self.expert_mlp, EXPERT_MLPS),
            ("dispatch", self.dispatch, DISPATCHES),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
        if self.router == "switch" and self.top_k != 1:
            raise ValueError(
                f"router='switch' routes each token to one expert, got top_k={self.top_k}"
            )
        if self.hidden_act not in activation_names():
            raise ValueError(f"unknown hidden_act {self.hidden_act!r}; known: {activation_names()}")
        check_int(
            "shared_expert_intermediate_size", self.shared_expert_intermediate_size, min_value=0
        )
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ValueError(
                "shared_expert_gate needs a shared expert (shared_expert_intermediate_size > 0)"
            )
        check_real("capacity_factor", self.capacity_factor, gt=0.0)
        for name in (
            "router_jitter",
            "router_noise_std",
            "router_aux_loss_coef",
            "router_z_loss_coef",
        ):
            check_real(name, getattr(self, name), ge=0.0)
        check_real("router_jitter", self.router_jitter, ge=0.0, lt=1.0)


@dataclass(frozen=True)
class MambaLayerConfig:
    """A Mamba (S6) mixer in a decoder layer (Gu & Dao, 2023; Jamba, Lieber et al., 2024).

    Attributes:
        state_size: ``N``.
        conv_kernel: width of the causal depthwise convolution.
        expand: inner width ``E = expand * hidden_size``.
        dt_rank: rank of the step-size projection; None: ``ceil(hidden_size / 16)``.
        conv_bias: a bias in the convolution.
        proj_bias: biases in the input/output projections.
        inner_norms: RMSNorm on the step-size input, ``B`` and ``C`` (Jamba's mixer).
        chunk_size: tokens per chunk of the chunked scan.
    """

    state_size: int = 16
    conv_kernel: int = 4
    expand: int = 2
    dt_rank: int | None = None
    conv_bias: bool = True
    proj_bias: bool = False
    inner_norms: bool = False
    chunk_size: int = 64

    def __post_init__(self) -> None:
        for name in ("state_size", "conv_kernel", "expand", "chunk_size"):
            check_positive_int(name, getattr(self, name))
        if self.dt_rank is not None:
            check_positive_int("dt_rank", self.dt_rank)

    def rank(self, hidden_size: int) -> int:
        """The step-size rank for a model of width ``hidden_size``."""
        return self.dt_rank if self.dt_rank is not None else -(-hidden_size // 16)


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: its sequence mixer and its feed-forward.

    Attributes:
        mixer: a name registered in :mod:`attnlab.models.mixers` (``"attention"``; the
            state-space mixers register theirs).
        ffn: ``"dense"`` (the config's ``mlp``/``intermediate_size``), ``"moe"`` (with
            ``moe``), ``"rwkv"`` (RWKV-4's channel mix, ``intermediate_size`` wide, whose
            token shift lives in the layer's ``RWKVState``) or ``"none"`` (a mixer-only
            layer, as in Mamba).
        moe: the mixture of experts when ``ffn == "moe"``.
        mamba: the Mamba mixer's settings when ``mixer == "mamba"`` (None: the defaults).
        linear: the settings of a linear-attention or gated-recurrence mixer
            (``"delta_net"``, ``"gated_delta_net"``, ``"gla"``, ``"rglru"``, ``"short_conv"``,
            ``"rwkv7"``, ``"mamba2"``, ``"retention"``, ``"rwkv"``; None: the defaults).
        sliding_window: this attention layer's window ``W`` (each token sees ``W`` tokens,
            itself included), or None for the config's ``sliding_window``: local layers
            between global ones (Gemma 2 and 3, Qwen2's ``layer_types``).
        rope: False for a layer without RoPE (a NoPE layer: SmolLM3's every fourth).
        rope_theta: this layer's own RoPE base, unscaled (Gemma 3's local layers), or None
            for the config's base and scaling.
    """

    mixer: str = "attention"
    ffn: str = "dense"
    moe: MoEConfig | None = field(default=None)
    mamba: MambaLayerConfig | None = field(default=None)
    linear: LinearLayerConfig | None = field(default=None)
    sliding_window: int | None = None
    rope: bool = True
    rope_theta: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.linear, dict):
            object.__setattr__(self, "linear", LinearLayerConfig(**self.linear))
        if self.linear is not None:
            if not isinstance(self.linear, LinearLayerConfig):
                raise TypeError(
                    f"linear must be a LinearLayerConfig or None, got {type(self.linear).__name__}"
                )
            if self.mixer not in LINEAR_MIXERS:
                raise ValueError(
                    f"linear=LinearLayerConfig(...) configures a mixer in {list(LINEAR_MIXERS)}, "
                    f"got mixer={self.mixer!r}"
                )
        if isinstance(self.moe, dict):
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        if isinstance(self.mamba, dict):
            object.__setattr__(self, "mamba", MambaLayerConfig(**self.mamba))
        if self.mamba is not None:
            if not isinstance(self.mamba, MambaLayerConfig):
                raise TypeError(
                    f"mamba must be a MambaLayerConfig or None, got {type(self.mamba).__name__}"
                )
            if self.mixer != "mamba":
                raise ValueError(
                    f"mamba=MambaLayerConfig(...) configures a mixer='mamba' layer, got "
                    f"mixer={self.mixer!r}"
                )
        if not isinstance(self.mixer, str):
            raise TypeError(f"mixer must be a mixer name (str), got {type(self.mixer).__name__}")
        if self.ffn not in FFN_KINDS:
            raise ValueError(f"ffn must be one of {list(FFN_KINDS)}, got {self.ffn!r}")
        if (self.ffn == "moe") != (self.moe is not None):
            raise ValueError(
                f"a layer with ffn={self.ffn!r} {'needs' if self.ffn == 'moe' else 'takes no'} "
                f"moe=MoEConfig(...), got moe={self.moe!r}"
            )
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise TypeError(f"moe must be a MoEConfig or None, got {type(self.moe).__name__}")
        if self.sliding_window is not None:
            check_positive_int("sliding_window", self.sliding_window)
        if not isinstance(self.rope, bool):
            raise TypeError(f"rope must be a bool, got {self.rope!r}")
        if self.rope_theta is not None:
            check_real("rope_theta", self.rope_theta, ge=1.0)
        if self.mixer != "attention" and (
            self.sliding_window is not None or not self.rope or self.rope_theta is not None
        ):
            raise ValueError(
                f"sliding_window, rope and rope_theta configure attention layers, got "
                f"mixer={self.mixer!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
