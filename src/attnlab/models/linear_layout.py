"""Settings of the linear-attention and gated-recurrence mixers in a decoder layout.

``LayerSpec(mixer="gated_delta_net", linear=LinearLayerConfig(...))``: one dataclass for
DeltaNet, Gated DeltaNet, GLA, the RG-LRU block and the gated short convolution (each
reads the fields it needs; None fields default from the :class:`DecoderConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass

from attnlab.functional._checks import check_positive_int

__all__ = ["LINEAR_MIXERS", "LinearLayerConfig"]

#: the mixers that read a :class:`LinearLayerConfig`
LINEAR_MIXERS = (
    "delta_net",
    "gated_delta_net",
    "gla",
    "rglru",
    "short_conv",
    "rwkv7",
    "mamba2",
    "retention",
    "rwkv",
)


@dataclass(frozen=True)
class LinearLayerConfig:
    """A linear-attention or gated-recurrence mixer's settings.

    Attributes:
        num_heads: key heads (DeltaNet/GDN ``H_k``, GLA ``H``, the RG-LRU's gate blocks,
            retention's heads; Mamba-2: default ``width / head_dim``);
            default the config's ``num_attention_heads``.
        num_value_heads: value heads of (Gated) DeltaNet (a multiple of ``num_heads``);
            default ``num_heads``.
        head_dim: key head dim; default the config's ``head_dim`` (GLA: half of it;
            Mamba-2: its ``P``, default 64).
        value_head_dim: value head dim; default ``head_dim`` (GLA: the config's ``head_dim``).
        conv_kernel: width of the causal short convolution (GDN/DeltaNet 4, RG-LRU 4,
            LFM2 3).
        width: the RG-LRU's width ``W`` (Mamba-2: its inner width ``H P``; retention: its
            total value width; RWKV-4: its WKV width); default the config's ``hidden_size``
            (Mamba-2 and retention: twice it).
        conv_bias: biases in the short convolution block (LFM2's ``conv_bias``; Mamba-2's
            convolution bias).
        state_size: Mamba-2's ``N``.
        n_groups: Mamba-2's groups of ``B``/``C``.
        proj_bias: biases in Mamba-2's input/output projections.
        dt_limit: Mamba-2's clamp of the step sizes, or None (no clamp).
        chunk_size: tokens per chunk of the chunked forms.
        value_residual: RWKV-7's cross-layer value residual (the first RWKV-7 layer's
            values mixed into every later one's by a learnt gate); False turns it off.
    """

    num_heads: int | None = None
    num_value_heads: int | None = None
    head_dim: int | None = None
    value_head_dim: int | None = None
    conv_kernel: int = 4
    width: int | None = None
    conv_bias: bool = False
    state_size: int = 64
    n_groups: int = 1
    proj_bias: bool = False
    dt_limit: tuple[float, float] | None = None
    chunk_size: int = 64
    value_residual: bool = True

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_value_heads", "head_dim", "value_head_dim", "width"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        check_positive_int("conv_kernel", self.conv_kernel)
        check_positive_int("chunk_size", self.chunk_size)
        check_positive_int("state_size", self.state_size)
        check_positive_int("n_groups", self.n_groups)
        if self.dt_limit is not None:
            lo, hi = (float(v) for v in self.dt_limit)
            if not 0.0 <= lo < hi:
                raise ValueError(
                    f"dt_limit must be (low, high) with 0 <= low < high, got {self.dt_limit}"
                )
            object.__setattr__(self, "dt_limit", (lo, hi))
