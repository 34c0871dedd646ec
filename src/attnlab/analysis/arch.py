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
        window: sliding window ``W`` in keys, itself included (Mistral), or None. A
            causal model sees the last ``W`` keys; a bidirectional one (an encoder's local
            layers) ``W // 2`` keys on each side (ModernBERT's ``local_attention``).
        layer_windows: per layer, its window (None: global attention), when the layers
            differ: Gemma 2's alternate local and global layers, Gemma 3's five local to
            one global, ModernBERT's every third global; None when they are uniform
            (``window`` then applies to every layer).
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
    layer_windows: tuple[int | None, ...] | None = None

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
        if self.layer_windows is not None:
            self._check_layer_windows(self.layer_windows)

    def _check_layer_windows(self, windows: tuple[int | None, ...]) -> None:
        if not isinstance(windows, tuple) or len(windows) != self.num_layers:
            raise ValueError(
                f"layer_windows must be a tuple of one window (or None) per layer, "
                f"{self.num_layers} in all, got {windows!r}"
            )
        for w in windows:
            if w is not None:
                check_positive_int("layer_windows entry", w)
        if self.window is not None:
            raise ValueError(
                f"layer_windows ({windows}) and window ({self.window}) do not combine: "
                "give the window of every layer in layer_windows"
            )
        if self.num_decoder_layers:
            raise ValueError("layer_windows is for encoder-only and decoder-only models")

    @property
    def window_groups(self) -> list[tuple[int | None, int]]:
        """``(window, layers)`` for each window the layers use, in order of first use."""
        if self.layer_windows is None:
            return [(self.window, self.num_layers)]
        counts: dict[int | None, int] = {}
        for w in self.layer_windows:
            counts[w] = counts.get(w, 0) + 1
        return list(counts.items())

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


_BUILTIN_DONE = False


def _register_builtin() -> None:
    """Register the adapters of the library's own configs (lazily: no work at import)."""
    global _BUILTIN_DONE
    if _BUILTIN_DONE:
        return
    from attnlab.analysis.arch_adapters import decoder_spec, encoder_spec, seq2seq_spec
    from attnlab.models.config import EncoderConfig
    from attnlab.models.decoder_config import DecoderConfig
    from attnlab.models.seq2seq_config import Seq2SeqConfig

    _ADAPTERS.setdefault(EncoderConfig, encoder_spec)
    _ADAPTERS.setdefault(DecoderConfig, decoder_spec)
    _ADAPTERS.setdefault(Seq2SeqConfig, seq2seq_spec)
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
        # Gemma 2 2B: local (4096) and global layers alternating, the first local; four
        # norms per layer (two beyond the usual pair), tied embeddings
        "gemma-2-2b": llama.with_(
            name="gemma-2-2b",
            num_layers=26,
            hidden_size=2304,
            num_heads=8,
            num_kv_heads=4,
            head_dim=256,
            intermediate_size=9216,
            vocab_size=256000,
            activation="gelu_pytorch_tanh",
            max_positions=8192,
            tied_embeddings=True,
            layer_windows=(4096, None) * 13,
            extra_parameters=26 * 2 * 2304,
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
