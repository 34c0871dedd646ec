"""Config of decoder-only language models: GPT-2, Llama, Mistral and BLOOM shapes from one dataclass.

Field names follow transformers' ``LlamaConfig`` where one exists. The variant is
chosen by values naming components (``position_embedding="rope"``, ``norm="rmsnorm"``,
``mlp="gated"``), which :mod:`attnlab.models.decoder` turns into modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from attnlab.functional._checks import check_positive_int, check_probability, check_real
from attnlab.functional.positions import check_rope_parameters
from attnlab.models._base import ConfigBase, check_kv_heads, check_model_type
from attnlab.models.layout import LayerSpec, MoEConfig
from attnlab.modules.activations import activation_names

__all__ = ["DecoderConfig"]

POSITION_EMBEDDINGS = ("rope", "learned", "sinusoidal", "alibi", "none")
NORMS = ("rmsnorm", "gemma_rmsnorm", "layernorm")
NORM_PLACEMENTS = ("pre", "sandwich")
QK_NORM_SCOPES = ("projection", "head")
MLPS = ("gated", "standard")


@dataclass
class DecoderConfig(ConfigBase):
    """A decoder-only Transformer language model.

    Attributes:
        vocab_size: number of token ids.
        hidden_size: model width ``D``.
        num_hidden_layers: number of decoder layers.
        num_attention_heads: query heads ``H``.
        num_key_value_heads: key/value heads (GQA, Ainslie et al., 2023); default ``H``.
        head_dim: per-head width; default ``hidden_size // num_attention_heads``.
        intermediate_size: feed-forward inner width.
        hidden_act: feed-forward activation name.
        mlp: ``"gated"`` (SwiGLU, Llama) or ``"standard"`` (two layers, GPT-2/BLOOM).
        norm: ``"rmsnorm"`` (Llama), ``"gemma_rmsnorm"`` (Gemma's ``x * (1 + w)`` with
            the weight stored as an offset from 1) or ``"layernorm"`` (GPT-2, BLOOM).
        norm_eps: epsilon of the norms.
        norm_placement: ``"pre"`` (one norm before each sublayer) or ``"sandwich"`` (also
            one on each sublayer's output before the residual: Gemma 2 and 3's four
            norms per layer).
        position_embedding: ``"rope"``, ``"learned"`` (GPT-2), ``"sinusoidal"``,
            ``"alibi"`` (BLOOM) or ``"none"``.
        max_position_embeddings: maximum positions (learned/sinusoidal tables; RoPE
            scaling's reference length).
        rope_theta: RoPE base.
        rope_scaling: transformers-style ``rope_parameters`` without ``rope_theta``
            (``{"rope_type": "linear", "factor": 2.0}``...), or None.
        rope_convention: ``"half"`` (Llama) or ``"interleaved"`` (GPT-J).
        sliding_window: Mistral's window ``W`` (each token sees ``W`` tokens, itself
            included), or None.
        attention_bias: biases on q/k/v projections.
        attention_out_bias: bias on the output projection (default ``attention_bias``).
        mlp_bias: biases in the feed-forward.
        embedding_norm: a LayerNorm after the token embeddings (BLOOM).
        tie_word_embeddings: the LM head reuses the token embedding matrix.
        attention_dropout: dropout on attention weights.
        hidden_dropout: dropout on embeddings and sublayer outputs.
        pad_token_id, bos_token_id, eos_token_id: special token ids (or None).
        qk_norm: a norm (the kind ``norm`` names) on queries and keys before RoPE.
        qk_norm_scope: ``"projection"`` (over the whole query/key projection: OLMoE,
            OLMo 2) or ``"head"`` (per head, over ``head_dim``: Qwen3, Gemma 3).
        query_pre_attn_scalar: scores are scaled by ``query_pre_attn_scalar ** -0.5``
            instead of ``head_dim ** -0.5`` (Gemma 2 and 3), or None.
        attn_logit_softcapping: soft-cap ``c * tanh(s / c)`` on the attention scores (a
            score modifier; Gemma 2), or None.
        final_logit_softcapping: the same on the output logits (Gemma 2), or None.
        embedding_scale: the token embeddings are multiplied by this (Gemma:
            ``sqrt(hidden_size)``, rounded to the weights' dtype), or None.
        partial_rotary_factor: the share of each head's features RoPE rotates (Phi-3.5,
            Phi-4-mini: 0.75); the rest pass through.
        model_type: the transformers ``model_type`` this config describes (``"qwen3"``,
            ``"gemma2"``, ...), which ``to_hf`` converts to when several share the same
            computation (Llama and Phi-3); None: inferred from the components.
        layers: the per-layer layout, one :class:`LayerSpec` per layer (mixer and
            feed-forward: dense, mixture of experts or none); None means every layer is
            attention + dense feed-forward. Dicts (from JSON) are accepted.
        gradient_checkpointing: recompute each layer in the backward instead of keeping
            its activations (training only; see :mod:`attnlab.models._checkpoint`).
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int = 11008
    hidden_act: str = "silu"
    mlp: str = "gated"
    norm: str = "rmsnorm"
    norm_eps: float = 1e-6
    position_embedding: str = "rope"
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_convention: str = "half"
    sliding_window: int | None = None
    attention_bias: bool = False
    attention_out_bias: bool | None = None
    mlp_bias: bool = False
    embedding_norm: bool = False
    tie_word_embeddings: bool = False
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    qk_norm: bool = False
    qk_norm_scope: str = "projection"
    norm_placement: str = "pre"
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    embedding_scale: float | None = None
    partial_rotary_factor: float = 1.0
    model_type: str | None = None
    layers: tuple[LayerSpec, ...] | None = None
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        self._check_positive_ints(
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
        )
        check_kv_heads(self)
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads}), or set head_dim"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        check_positive_int("head_dim", self.head_dim)
        for name, value, allowed in (
            ("mlp", self.mlp, MLPS),
            ("norm", self.norm, NORMS),
            ("position_embedding", self.position_embedding, POSITION_EMBEDDINGS),
            ("rope_convention", self.rope_convention, ("half", "interleaved")),
            ("norm_placement", self.norm_placement, NORM_PLACEMENTS),
            ("qk_norm_scope", self.qk_norm_scope, QK_NORM_SCOPES),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
        if self.hidden_act not in activation_names():
            raise ValueError(f"unknown hidden_act {self.hidden_act!r}; known: {activation_names()}")
        check_real("partial_rotary_factor", self.partial_rotary_factor, gt=0.0, le=1.0)
        if self.position_embedding == "rope" and self.rotary_dim % 2:
            raise ValueError(
                f"RoPE needs an even number of rotated features, got {self.rotary_dim} "
                f"(head_dim {self.head_dim} x partial_rotary_factor {self.partial_rotary_factor})"
            )
        for name in (
            "query_pre_attn_scalar",
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "embedding_scale",
        ):
            if getattr(self, name) is not None:
                check_real(name, getattr(self, name), gt=0.0)
        check_model_type(self)
        check_rope_parameters(self.rope_theta, self.rope_scaling)
        if self.sliding_window is not None:
            check_positive_int("sliding_window", self.sliding_window)
        check_real("norm_eps", self.norm_eps, gt=0.0)
        check_probability("attention_dropout", self.attention_dropout)
        check_probability("hidden_dropout", self.hidden_dropout)
        self._check_token_ids("pad_token_id", "bos_token_id", "eos_token_id")
        self._check_layers()

    def _check_layers(self) -> None:
        if self.layers is None:
            return
        if not isinstance(self.layers, list | tuple):
            raise TypeError(
                f"layers must be a tuple of LayerSpec (or None), got {type(self.layers).__name__}"
            )
        self.layers = tuple(
            LayerSpec(**spec) if isinstance(spec, dict) else spec for spec in self.layers
        )
        if len(self.layers) != self.num_hidden_layers:
            raise ValueError(
                f"layers has {len(self.layers)} entries, num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        from attnlab.models.mixers import mixer_names  # registered mixers; avoids a cycle

        for i, spec in enumerate(self.layers):
            if not isinstance(spec, LayerSpec):
                raise TypeError(f"layers[{i}] must be a LayerSpec, got {type(spec).__name__}")
            if spec.mixer not in mixer_names():
                raise ValueError(
                    f"layers[{i}].mixer {spec.mixer!r} is not a registered mixer: {mixer_names()}"
                )
            if spec.moe is not None and spec.moe.router == "expert_choice":
                raise ValueError(
                    f"layers[{i}]: expert-choice routing compares tokens across the batch and "
                    "the sequence, so a causal decoder cannot use it (a token would see later "
                    "tokens); use a token-choice router (softmax_topk, topk_softmax, switch)"
                )

    @property
    def rotary_dim(self) -> int:
        """Features of each head RoPE rotates: ``head_dim * partial_rotary_factor``."""
        assert self.head_dim is not None
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, layer_index: int) -> int | None:
        """The sliding window of layer ``layer_index`` (its own, else the config's)."""
        own = self.layer_specs[layer_index].sliding_window
        return own if own is not None else self.sliding_window

    @property
    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """The layout with defaults filled in: one :class:`LayerSpec` per layer."""
        return self.layers if self.layers is not None else (LayerSpec(),) * self.num_hidden_layers

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the layers whose feed-forward is a mixture of experts."""
        return [i for i, spec in enumerate(self.layer_specs) if spec.ffn == "moe"]

    # ------------------------------------------------------------------ presets

    @classmethod
    def mixtral(cls, *, moe: MoEConfig | None = None, **overrides: Any) -> DecoderConfig:
        """Mixtral (Jiang et al., 2024): Mistral's components with an MoE feed-forward in
        every layer (default: 8 experts, top-2, renormalised)."""
        moe = moe or MoEConfig()
        n = overrides.get("num_hidden_layers", cls.num_hidden_layers)
        return cls(layers=(LayerSpec(ffn="moe", moe=moe),) * n, **overrides)

    @classmethod
    def llama(cls, **overrides: Any) -> DecoderConfig:
        """Llama's components (RoPE, RMSNorm, SwiGLU, GQA-capable); sizes from ``overrides``."""
        return cls(**overrides)

    @classmethod
    def mistral(cls, *, sliding_window: int = 4096, **overrides: Any) -> DecoderConfig:
        """Llama's components with sliding-window attention (Jiang et al., 2023)."""
        return cls(sliding_window=sliding_window, **overrides)

    @classmethod
    def gpt2(cls, **overrides: Any) -> DecoderConfig:
        """GPT-2's components: learned positions, LayerNorm, GELU (tanh), tied embeddings."""
        base: dict[str, Any] = dict(
            position_embedding="learned",
            norm="layernorm",
            norm_eps=1e-5,
            mlp="standard",
            hidden_act="gelu_new",
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
        )
        return cls(**(base | overrides))

    @classmethod
    def bloom(cls, **overrides: Any) -> DecoderConfig:
        """BLOOM's components: ALiBi, LayerNorm (also after the embeddings), GELU, tied."""
        base: dict[str, Any] = dict(
            position_embedding="alibi",
            norm="layernorm",
            norm_eps=1e-5,
            mlp="standard",
            hidden_act="gelu_new",
            attention_bias=True,
            mlp_bias=True,
            embedding_norm=True,
            tie_word_embeddings=True,
        )
        return cls(**(base | overrides))

    @classmethod
    def qwen2(cls, **overrides: Any) -> DecoderConfig:
        """Qwen2 / Qwen2.5 (Qwen team, 2024): Llama's components with biases on the query,
        key and value projections (none on the output); windowed layers, when wanted, by
        ``layers=(LayerSpec(sliding_window=W), ...)``."""
        base: dict[str, Any] = dict(
            attention_bias=True, attention_out_bias=False, rope_theta=1e6, model_type="qwen2"
        )
        return cls(**(base | overrides))

    @classmethod
    def qwen3(cls, **overrides: Any) -> DecoderConfig:
        """Qwen3 (Qwen team, 2025): Llama's components with an RMSNorm on each head's
        queries and keys before RoPE (QK-norm, Dehghani et al., 2023)."""
        base: dict[str, Any] = dict(
            qk_norm=True, qk_norm_scope="head", rope_theta=1e6, model_type="qwen3"
        )
        return cls(**(base | overrides))

    @classmethod
    def qwen3_moe(cls, *, moe: MoEConfig | None = None, **overrides: Any) -> DecoderConfig:
        """Qwen3-MoE: Qwen3's attention with a routed MoE in every layer (default 128
        experts, top-8 renormalised, experts of width 768, no shared expert)."""
        moe = moe or MoEConfig(num_experts=128, top_k=8, intermediate_size=768)
        n = overrides.get("num_hidden_layers", cls.num_hidden_layers)
        base: dict[str, Any] = dict(
            qk_norm=True,
            qk_norm_scope="head",
            rope_theta=1e6,
            model_type="qwen3_moe",
            layers=(LayerSpec(ffn="moe", moe=moe),) * n,
        )
        return cls(**(base | overrides))

    @classmethod
    def gemma2(cls, *, window: int = 4096, **overrides: Any) -> DecoderConfig:
        """Gemma 2 (Gemma Team, 2024): local (``window``) and global layers alternating
        (the first local), soft-capped scores (50) and logits (30), scores scaled by
        ``query_pre_attn_scalar ** -0.5``, four norms per layer of ``x * (1 + w)``,
        GeGLU (tanh GELU), tied embeddings scaled by ``sqrt(hidden_size)``."""
        n = overrides.get("num_hidden_layers", cls.num_hidden_layers)
        return cls(**(_gemma_base(overrides, n, window, period=2) | overrides))

    @classmethod
    def gemma3(cls, *, window: int = 4096, **overrides: Any) -> DecoderConfig:
        """Gemma 3's text decoder (Gemma Team, 2025): five local layers (``window``, RoPE
        base 10000) to one global (RoPE base 1e6), per-head QK-norm, Gemma 2's norms,
        GeGLU and scaled embeddings, no soft-capping."""
        n = overrides.get("num_hidden_layers", cls.num_hidden_layers)
        base = _gemma_base(overrides, n, window, period=6, local_theta=10000.0)
        base |= dict(
            qk_norm=True,
            qk_norm_scope="head",
            rope_theta=1e6,
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
            model_type="gemma3_text",
        )
        return cls(**(base | overrides))

    @classmethod
    def phi3(cls, **overrides: Any) -> DecoderConfig:
        """Phi-3 (Abdin et al., 2024): Llama's computation (its fused ``qkv_proj`` and
        ``gate_up_proj`` are a checkpoint layout, split on load); LongRoPE by
        ``rope_scaling={"rope_type": "longrope", ...}``, partial rotary by
        ``partial_rotary_factor``."""
        return cls(**(dict(model_type="phi3") | overrides))

    @classmethod
    def smollm3(cls, *, no_rope_every: int = 4, **overrides: Any) -> DecoderConfig:
        """SmolLM3 (Hugging Face, 2025): Llama's components, GQA, tied embeddings, and no
        RoPE in every ``no_rope_every``-th layer (NoPE layers, Kazemnejad et al., 2023)."""
        n = overrides.get("num_hidden_layers", cls.num_hidden_layers)
        base: dict[str, Any] = dict(
            tie_word_embeddings=True,
            rope_theta=5e6,
            model_type="smollm3",
            layers=tuple(LayerSpec(rope=(i + 1) % no_rope_every != 0) for i in range(n)),
        )
        return cls(**(base | overrides))


def _gemma_base(
    overrides: dict[str, Any],
    n: int,
    window: int,
    *,
    period: int,
    local_theta: float | None = None,
) -> dict[str, Any]:
    """Gemma's shared components; every ``period``-th layer global, the others local."""
    hidden = overrides.get("hidden_size", DecoderConfig.hidden_size)
    heads = overrides.get("num_attention_heads", DecoderConfig.num_attention_heads)
    head_dim = overrides.get("head_dim") or hidden // heads
    local = LayerSpec(sliding_window=window, rope_theta=local_theta)
    return dict(
        norm="gemma_rmsnorm",
        norm_placement="sandwich",
        hidden_act="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        embedding_scale=hidden**0.5,
        query_pre_attn_scalar=float(head_dim),
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        model_type="gemma2",
        layers=tuple(LayerSpec() if (i + 1) % period == 0 else local for i in range(n)),
    )
