"""A small description of a Transformer architecture, derived from any config the library builds.

The cost model (:mod:`attnlab.analysis.cost`) and the advisor reason about an
:class:`ArchSpec`, never about a config class directly: each config type registers an
*adapter* that turns it into a spec (:func:`register_adapter`), so a model family added
later plugs in with one function and the cost model needs no change.

Fields are what the arithmetic needs: widths and counts, the feed-forward kind, what
sits around the layer stack (embeddings, LM head, pooler), and the attention's shape
(causal, sliding window, sparse pattern density, encoder-decoder cross-attention).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from attnlab._validate import check_positive_int

__all__ = ["PRESETS", "ArchSpec", "MoESpec", "adapters", "describe", "preset", "register_adapter"]

FfnKind = Literal["standard", "gated"]
NormKind = Literal["layernorm", "rmsnorm"]


@dataclass(frozen=True)
class MoESpec:
    """The mixture-of-experts layers of an architecture, as the cost model needs them.

    Attributes:
        num_layers: how many layers have an MoE feed-forward (the others are dense).
        num_experts: routed experts ``E``.
        top_k: experts per token ``k``.
        intermediate_size: each routed expert's inner width ``F``.
        gated: gated (three-matrix) experts.
        activation: the experts' activation.
        shared_intermediate_size: shared-expert width ``F_s`` (0: none).
        shared_gate: the shared expert has a sigmoid gate (``D`` parameters).
    """

    num_layers: int
    num_experts: int
    top_k: int
    intermediate_size: int
    gated: bool = True
    activation: str = "silu"
    shared_intermediate_size: int = 0
    shared_gate: bool = False

    @property
    def matrices(self) -> int:
        """Weight matrices per expert: 3 gated, 2 plain."""
        return 3 if self.gated else 2


@dataclass(frozen=True)
class ArchSpec:
    """What the cost model needs to know about an architecture.

    Attributes:
        name: a label for reports (``"encoder"``, ``"llama"``...).
        num_layers: self-attention layers (the encoder's, or the decoder's in a decoder-only LM).
        hidden_size: model width ``D``.
        num_heads: query heads ``H``.
        num_kv_heads: key/value heads ``H_kv`` (``H`` for MHA, 1 for MQA, between for GQA).
        head_dim: per-head width ``E`` (``H * E`` may differ from ``D``).
        ffn: ``"standard"`` (two matrices) or ``"gated"`` (SwiGLU: three matrices).
        intermediate_size: feed-forward inner width ``F``.
        vocab_size: token ids ``V``.
        activation: feed-forward activation name.
        causal: decoder-style causal self-attention (halves the useful attention work).
        position: ``"learned"``, ``"sinusoidal"``, ``"rope"``, ``"alibi"``, ``"relative"``
            or ``"none"``.
        max_positions: rows of a learned position table (or a RoPE reference length).
        learned_positions: the position table is a parameter.
        type_vocab_size: token-type (segment) embeddings rows (BERT), 0 for none.
        norm: ``"layernorm"`` or ``"rmsnorm"``.
        embedding_norm: a norm after the embeddings (BERT, BLOOM).
        final_norm: a norm after the last layer (pre-LN stacks).
        attention_bias: biases on the q/k/v projections.
        attention_out_bias: bias on the output projection.
        mlp_bias: biases in the feed-forward.
        lm_head: a vocabulary projection on top.
        tied_embeddings: the LM head reuses the token embedding matrix (no extra parameters).
        pooler: BERT's pooler (a ``D x D`` dense on the first token).
        window: sliding window ``W`` in keys, itself included (Mistral), or None.
        pattern_density: fraction of (query, key) pairs a sparse pattern keeps, or None.
        num_decoder_layers: decoder layers of an encoder-decoder model (each with
            self- and cross-attention); 0 for encoder-only and decoder-only models.
        attention_dropout: dropout probability on attention weights (training).
        hidden_dropout: dropout probability on sublayer outputs (training).
        extra_parameters: parameters outside the pattern above (T5's relative-position
            bias tables...).
        moe: the mixture-of-experts layers (their feed-forward replaces the dense one),
            or None.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: FfnKind
    intermediate_size: int
    vocab_size: int
    activation: str = "gelu"
    causal: bool = False
    position: str = "learned"
    max_positions: int | None = None
    learned_positions: bool = True
    type_vocab_size: int = 0
    norm: NormKind = "layernorm"
    embedding_norm: bool = False
    final_norm: bool = False
    attention_bias: bool = True
    attention_out_bias: bool = True
    mlp_bias: bool = True
    lm_head: bool = False
    tied_embeddings: bool = True
    pooler: bool = False
    window: int | None = None
    pattern_density: float | None = None
    num_decoder_layers: int = 0
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    extra_parameters: int = 0
    moe: MoESpec | None = None

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
        ):
            check_positive_int(f"ArchSpec.{name}", getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be divisible by num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.ffn not in ("standard", "gated"):
            raise ValueError(f"ffn must be 'standard' or 'gated', got {self.ffn!r}")
        if self.window is not None:
            check_positive_int("window", self.window)
        if self.pattern_density is not None and not 0.0 < self.pattern_density <= 1.0:
            raise ValueError(f"pattern_density must be in (0, 1], got {self.pattern_density!r}")

    @property
    def q_dim(self) -> int:
        """Width of the concatenated query heads, ``H * E``."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the concatenated key (or value) heads, ``H_kv * E``."""
        return self.num_kv_heads * self.head_dim

    @property
    def attention_kind(self) -> str:
        """``"MHA"``, ``"GQA"`` or ``"MQA"`` from the head counts."""
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    def with_(self, **changes: Any) -> ArchSpec:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


Adapter = Callable[[Any], ArchSpec]
_ADAPTERS: dict[type, Adapter] = {}


def register_adapter(config_type: type, adapter: Adapter) -> None:
    """Teach :func:`describe` a config type: ``adapter(config) -> ArchSpec``."""
    _ADAPTERS[config_type] = adapter


def adapters() -> dict[type, Adapter]:
    """The registered adapters by config type (built-in ones included)."""
    _register_builtin()
    return dict(_ADAPTERS)


def describe(config_or_model: Any) -> ArchSpec:
    """The :class:`ArchSpec` of a config, or of a model that has a ``.config``.

    Raises:
        TypeError: no adapter knows the object's config type (the message lists those known).
    """
    if isinstance(config_or_model, ArchSpec):
        return config_or_model
    _register_builtin()
    config = getattr(config_or_model, "config", config_or_model)
    for cls in type(config).__mro__:
        if cls in _ADAPTERS:
            return _ADAPTERS[cls](config)
    known = sorted(t.__name__ for t in _ADAPTERS)
    raise TypeError(
        f"no cost-model adapter for {type(config).__name__}; known config types: {known} "
        "(add one with attnlab.analysis.arch.register_adapter)"
    )


# --------------------------------------------------------------------------- adapters


def _encoder(config: Any) -> ArchSpec:
    if config.local_attention is not None and any(w is not None for w in config.local_attention):
        raise ValueError(
            "the cost model costs uniform attention layers; this encoder mixes local windows "
            f"{list(config.local_attention)} (None: global) across its layers (ModernBERT), "
            "which it does not estimate yet"
        )
    return ArchSpec(
        name="encoder",
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        ffn="gated" if config.mlp == "gated" else "standard",
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        activation=config.hidden_act,
        attention_bias=config.attention_bias,
        attention_out_bias=config.attention_bias,
        mlp_bias=config.mlp_bias,
        causal=False,
        position="learned",
        max_positions=config.max_position_embeddings,
        learned_positions=True,
        type_vocab_size=config.type_vocab_size,
        norm="layernorm",
        embedding_norm=True,
        final_norm=config.norm_position == "pre",
        lm_head=False,
        pooler=config.add_pooler,
        attention_dropout=config.attention_probs_dropout_prob,
        hidden_dropout=config.hidden_dropout_prob,
    )


def _ffn_name(config: Any) -> str:
    moe = _moe_spec(config)
    if moe is None:
        return str(config.mlp)
    return f"MoE {moe.num_experts}x top-{moe.top_k} in {moe.num_layers} layers"


def _decoder(config: Any) -> ArchSpec:
    mixers = sorted({spec.mixer for spec in config.layer_specs})
    if mixers != ["attention"]:
        # an ArchSpec describes uniform attention layers: costing a hybrid's Mamba layers as
        # attention would be wrong (parameters, FLOPs, and a KV cache they do not keep)
        raise ValueError(
            f"the cost model covers attention decoders (and, through estimate_recurrent, "
            f"pure state-space models); this layout mixes {mixers} layers, a hybrid it does "
            "not estimate"
        )
    windows = {config.layer_window(i) for i in range(config.num_hidden_layers)}
    if len(windows) > 1:
        raise ValueError(
            "the cost model costs uniform attention layers; this layout mixes windows "
            f"{sorted(windows, key=lambda w: (w is not None, w or 0))} (None: global) across "
            "its layers (Gemma, windowed Qwen), which it does not estimate yet"
        )
    pos = config.position_embedding
    out_bias = config.attention_out_bias
    return ArchSpec(
        name=f"decoder ({pos}, {_ffn_name(config)} FFN"
        + (f", window {config.sliding_window})" if config.sliding_window else ")"),
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        ffn="gated" if config.mlp == "gated" else "standard",
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        activation=config.hidden_act,
        causal=True,
        position=pos,
        max_positions=config.max_position_embeddings,
        learned_positions=pos == "learned",
        type_vocab_size=0,
        norm="rmsnorm" if config.norm == "rmsnorm" else "layernorm",
        embedding_norm=config.embedding_norm,
        final_norm=True,
        attention_bias=config.attention_bias,
        attention_out_bias=config.attention_bias if out_bias is None else out_bias,
        mlp_bias=config.mlp_bias,
        lm_head=True,
        tied_embeddings=config.tie_word_embeddings,
        window=config.sliding_window,
        attention_dropout=config.attention_dropout,
        hidden_dropout=config.hidden_dropout,
        moe=_moe_spec(config),
        extra_parameters=_extra_norm_parameters(config),
    )


def _extra_norm_parameters(config: Any) -> int:
    """Norm weights beyond one per sublayer: QK-norm (per channel of the projection, OLMoE;
    or per head feature, shared by the heads, Qwen3) and the sandwich's two output norms
    (Gemma 2 and 3)."""
    n, d = config.num_hidden_layers, config.hidden_size
    qk = 0
    if config.qk_norm:
        heads = config.num_attention_heads + config.num_key_value_heads
        qk = 2 * config.head_dim if config.qk_norm_scope == "head" else heads * config.head_dim
    sandwich = 2 * d if config.norm_placement == "sandwich" else 0
    return n * (qk + sandwich)


def _moe_spec(config: Any) -> MoESpec | None:
    """The MoE layers of a ``DecoderConfig`` (the first MoE layer's settings stand for all)."""
    layers = getattr(config, "moe_layers", None)
    if not layers:
        return None
    moe = config.layer_specs[layers[0]].moe
    return MoESpec(
        num_layers=len(layers),
        num_experts=moe.num_experts,
        top_k=moe.top_k,
        intermediate_size=moe.intermediate_size,
        gated=moe.expert_mlp == "gated",
        activation=moe.hidden_act,
        shared_intermediate_size=moe.shared_expert_intermediate_size,
        shared_gate=moe.shared_expert_gate,
    )


def _seq2seq(config: Any) -> ArchSpec:
    pos = config.position_embedding
    relative = pos == "t5_relative"
    return ArchSpec(
        name=f"encoder-decoder ({pos})",
        num_layers=config.num_layers,
        hidden_size=config.d_model,
        num_heads=config.num_heads,
        num_kv_heads=config.num_heads,
        head_dim=config.d_kv,
        ffn="gated" if config.mlp == "gated" else "standard",
        intermediate_size=config.d_ff,
        vocab_size=config.vocab_size,
        activation=config.dense_act_fn,
        causal=False,
        position="relative" if relative else pos,
        max_positions=config.max_position_embeddings,
        learned_positions=pos == "learned",
        norm="rmsnorm" if config.norm == "rmsnorm" else "layernorm",
        final_norm=config.norm_position == "pre",
        attention_bias=config.bias,
        attention_out_bias=config.bias,
        mlp_bias=config.bias,
        lm_head=True,
        tied_embeddings=config.tie_word_embeddings,
        num_decoder_layers=config.num_decoder_layers,
        hidden_dropout=config.dropout_rate,
        # one bucket table per stack (encoder: bidirectional, decoder: causal)
        extra_parameters=2 * config.relative_attention_num_buckets * config.num_heads
        if relative
        else 0,
    )


_BUILTIN_DONE = False


def _register_builtin() -> None:
    """Register the adapters of the library's own configs (lazily: no work at import)."""
    global _BUILTIN_DONE
    if _BUILTIN_DONE:
        return
    from attnlab.models.config import EncoderConfig
    from attnlab.models.decoder_config import DecoderConfig
    from attnlab.models.seq2seq_config import Seq2SeqConfig

    _ADAPTERS.setdefault(EncoderConfig, _encoder)
    _ADAPTERS.setdefault(DecoderConfig, _decoder)
    _ADAPTERS.setdefault(Seq2SeqConfig, _seq2seq)
    _BUILTIN_DONE = True


# --------------------------------------------------------------------------- presets


def _presets() -> dict[str, ArchSpec]:
    tutorial = ArchSpec(
        name="tutorial",
        num_layers=12,
        hidden_size=768,
        num_heads=12,
        num_kv_heads=12,
        head_dim=64,
        ffn="standard",
        intermediate_size=3072,
        vocab_size=30522,
        max_positions=512,
        type_vocab_size=2,
        embedding_norm=True,
        pooler=True,
    )
    llama = ArchSpec(
        name="llama-2-7b",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=32,
        head_dim=128,
        ffn="gated",
        intermediate_size=11008,
        vocab_size=32000,
        activation="silu",
        causal=True,
        position="rope",
        max_positions=4096,
        learned_positions=False,
        norm="rmsnorm",
        final_norm=True,
        attention_bias=False,
        attention_out_bias=False,
        mlp_bias=False,
        lm_head=True,
        tied_embeddings=False,
    )
    return {
        # BERT-base sizes: the tutorial's table (hidden 768, 12 heads)
        "tutorial": tutorial,
        "bert-base": tutorial.with_(name="bert-base"),
        "minilm": tutorial.with_(
            name="all-MiniLM-L6-v2",
            num_layers=6,
            hidden_size=384,
            head_dim=32,
            intermediate_size=1536,
        ),
        "gpt2": ArchSpec(
            name="gpt2",
            num_layers=12,
            hidden_size=768,
            num_heads=12,
            num_kv_heads=12,
            head_dim=64,
            ffn="standard",
            intermediate_size=3072,
            vocab_size=50257,
            activation="gelu_new",
            causal=True,
            max_positions=1024,
            final_norm=True,
            lm_head=True,
            tied_embeddings=True,
        ),
        "llama-2-7b": llama,
        "llama-3-8b": llama.with_(
            name="llama-3-8b",
            num_kv_heads=8,
            intermediate_size=14336,
            vocab_size=128256,
            max_positions=8192,
        ),
        "mistral-7b": llama.with_(
            name="mistral-7b",
            num_kv_heads=8,
            intermediate_size=14336,
            window=4096,
            max_positions=32768,
        ),
    }


#: Named architectures for the command line (sizes from the published configs).
PRESETS: dict[str, ArchSpec] = _presets()


def preset(name: str) -> ArchSpec:
    """The preset called ``name``; ``ValueError`` lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}") from None
