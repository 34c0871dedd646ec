"""Configs of the state-space and recurrent language models: Mamba/Mamba-2, RWKV-4, RetNet.

Field names follow transformers' ``MambaConfig``/``Mamba2Config``/``RwkvConfig`` (and
torchscale's ``RetNetConfig`` for RetNet, which transformers lacks). Each is data,
validated in ``__post_init__``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from attnlab.functional._checks import check_positive_int
from attnlab.models._base import ConfigBase

__all__ = ["MambaConfig", "RWKVConfig", "RetNetConfig"]


@dataclass
class MambaConfig(ConfigBase):
    """A Mamba (``version=1``, S6) or Mamba-2 (``version=2``, SSD) language model.

    Attributes:
        vocab_size: number of token ids.
        hidden_size: width ``D``.
        num_hidden_layers: number of blocks.
        version: 1 (Gu & Dao, 2023) or 2 (Dao & Gu, 2024).
        state_size: ``N`` per channel (Mamba) or per head (Mamba-2).
        expand: inner width ``E = expand * D``.
        conv_kernel: width of the causal convolution.
        dt_rank: Mamba's step-size projection rank (default ``ceil(D / 16)``).
        num_heads: Mamba-2's heads (default ``E / head_dim``).
        head_dim: Mamba-2's head dim ``P``.
        n_groups: Mamba-2's groups of ``B``/``C``.
        dt_limit: Mamba-2's clamp of step sizes.
        use_conv_bias: a bias in the convolution.
        use_bias: biases in the projections.
        norm_eps: epsilon of the RMS norms.
        chunk_size: tokens per chunk of the chunked scans.
        tie_word_embeddings: the LM head reuses the embeddings.
        pad_token_id, bos_token_id, eos_token_id: special ids (or None).
    """

    vocab_size: int = 50280
    hidden_size: int = 768
    num_hidden_layers: int = 24
    version: int = 1
    state_size: int = 16
    expand: int = 2
    conv_kernel: int = 4
    dt_rank: int | None = None
    num_heads: int | None = None
    head_dim: int = 64
    n_groups: int = 1
    dt_limit: tuple[float, float] = (0.0, math.inf)
    use_conv_bias: bool = True
    use_bias: bool = False
    norm_eps: float = 1e-5
    chunk_size: int = 64
    tie_word_embeddings: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        self._check_positive_ints(
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "state_size",
            "expand",
            "conv_kernel",
            "head_dim",
            "n_groups",
            "chunk_size",
        )
        if self.version not in (1, 2):
            raise ValueError(f"version must be 1 (Mamba) or 2 (Mamba-2), got {self.version!r}")
        if len(self.dt_limit) != 2 or not 0 <= self.dt_limit[0] <= self.dt_limit[1]:
            raise ValueError(
                f"dt_limit must be (low, high) with 0 <= low <= high (high may be inf), "
                f"got {tuple(self.dt_limit)!r}"
            )
        self.dt_limit = (float(self.dt_limit[0]), float(self.dt_limit[1]))
        if self.dt_rank is None:
            self.dt_rank = math.ceil(self.hidden_size / 16)
        check_positive_int("dt_rank", self.dt_rank)
        if self.version == 2:
            inner = self.expand * self.hidden_size
            if self.num_heads is None:
                if inner % self.head_dim:
                    raise ValueError(
                        f"expand * hidden_size ({inner}) must be divisible by head_dim ({self.head_dim})"
                    )
                self.num_heads = inner // self.head_dim
            check_positive_int("num_heads", self.num_heads)
            if self.num_heads % self.n_groups:
                raise ValueError(
                    f"num_heads ({self.num_heads}) must be divisible by n_groups ({self.n_groups})"
                )
        self._check_token_ids("pad_token_id", "bos_token_id", "eos_token_id")

    @property
    def intermediate_size(self) -> int:
        """Inner width ``E`` (Mamba-2: ``num_heads * head_dim``)."""
        if self.version == 2:
            assert self.num_heads is not None
            return self.num_heads * self.head_dim
        return self.expand * self.hidden_size


@dataclass
class RWKVConfig(ConfigBase):
    """An RWKV-4 language model (Peng et al., 2023).

    Attributes:
        vocab_size: number of token ids.
        hidden_size: width ``D``.
        num_hidden_layers: number of blocks.
        attention_hidden_size: WKV width ``C`` (default ``D``).
        intermediate_size: channel-mix inner width (default ``4 D``).
        layer_norm_epsilon: epsilon of the LayerNorms.
        chunk_size: tokens per chunk of the chunked WKV.
        tie_word_embeddings: the LM head reuses the embeddings.
        pad_token_id, bos_token_id, eos_token_id: special ids (or None).
    """

    vocab_size: int = 50277
    hidden_size: int = 768
    num_hidden_layers: int = 12
    attention_hidden_size: int | None = None
    intermediate_size: int | None = None
    layer_norm_epsilon: float = 1e-5
    chunk_size: int = 64
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        self._check_positive_ints("vocab_size", "hidden_size", "num_hidden_layers", "chunk_size")
        if self.attention_hidden_size is None:
            self.attention_hidden_size = self.hidden_size
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size
        self._check_positive_ints("attention_hidden_size", "intermediate_size")
        self._check_token_ids("pad_token_id", "bos_token_id", "eos_token_id")


@dataclass
class RetNetConfig(ConfigBase):
    """A RetNet language model (Sun et al., 2023), as torchscale's ``RetNetDecoder`` builds it.

    Attributes:
        vocab_size: number of token ids.
        hidden_size: width ``D`` (torchscale's ``decoder_embed_dim``).
        num_hidden_layers: number of layers.
        num_heads: retention heads.
        value_dim: total value width (default ``2 D``).
        intermediate_size: GLU inner width (default ``2 D``).
        hidden_act: GLU activation (``"gelu"`` or ``"swish"``).
        norm_eps: epsilon of the RMS norms.
        scale_embedding: multiply embeddings by ``sqrt(D)`` (torchscale's ``no_scale_embedding=False``).
        form: multi-token form of retention, ``"chunkwise"`` or ``"parallel"``.
        chunk_size: tokens per chunk of the chunkwise form.
        tie_word_embeddings: the LM head reuses the embeddings.
        pad_token_id, bos_token_id, eos_token_id: special ids (or None).
    """

    vocab_size: int = 50257
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_heads: int = 3
    value_dim: int | None = None
    intermediate_size: int | None = None
    hidden_act: str = "gelu"
    norm_eps: float = 1e-6
    scale_embedding: bool = False
    form: str = "chunkwise"
    chunk_size: int = 64
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        self._check_positive_ints(
            "vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "chunk_size"
        )
        if self.value_dim is None:
            self.value_dim = 2 * self.hidden_size
        if self.intermediate_size is None:
            self.intermediate_size = 2 * self.hidden_size
        self._check_positive_ints("value_dim", "intermediate_size")
        if self.hidden_act not in ("gelu", "swish"):
            raise ValueError(f"hidden_act must be 'gelu' or 'swish', got {self.hidden_act!r}")
        if self.form not in ("chunkwise", "parallel"):
            raise ValueError(f"form must be 'chunkwise' or 'parallel', got {self.form!r}")
        self._check_token_ids("pad_token_id", "bos_token_id", "eos_token_id")
