"""State-space and recurrent language models: Mamba, Mamba-2, RWKV-4 and RetNet.

Shape notation: ``B`` batch, ``L`` new tokens, ``D`` width, ``V`` vocabulary.

Each is a preset of the one decoder shell: a :class:`~attnlab.models.decoder.DecoderLM`
built from the :class:`~attnlab.models.decoder_config.DecoderConfig` its own config maps
to (:mod:`attnlab.models.recurrent_presets`: ``mamba``/``mamba2`` layers without a
feed-forward, ``rwkv`` layers with RWKV's channel mix, ``retention`` layers with a gated
feed-forward). Forward, caches (one recurrent state per layer, constant in size),
``generate``/``stream``, serving (``forward_flat``) and the input checks are the shell's.
Left-padded batches equal each row run alone: every mixer skips padding, so a state
starts at the row's first real token (transformers' Mamba only zeroes padded inputs, and
its RWKV ignores the mask). Two things stay the model's own, so that converters, saved
weights and parity with the references are unchanged:

* ``config`` is the model's config (:class:`MambaConfig`, :class:`RWKVConfig`,
  :class:`RetNetConfig`), which ``from_hf``/``to_hf`` and the cost model read;
  ``decoder_config`` is the :class:`DecoderConfig` the shell runs;
* ``state_dict()`` writes, and ``load_state_dict()`` reads, the checkpoint names the
  models have always had (transformers' and torchscale's inside each block:
  ``layers.{i}.mixer.*``, ``norm_f.*``, RWKV's ``pre_ln.*``...); the modules themselves
  are the shell's (``model.layers[i].self_attention.mixer``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from attnlab.functional.losses import causal_lm_loss
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.recurrent_config import MambaConfig, RetNetConfig, RWKVConfig
from attnlab.models.recurrent_presets import (
    MAMBA_PARTS,
    RETNET_PARTS,
    RWKV_PARTS,
    checkpoint_key,
    mamba_decoder_config,
    retnet_decoder_config,
    rwkv_decoder_config,
    shell_key,
)
from attnlab.modules.retention import MultiScaleRetention

__all__ = ["RWKVLM", "MambaLM", "RecurrentLM", "RetNetLM", "causal_lm_loss"]


class RecurrentLM(DecoderLM):
    """A :class:`DecoderLM` preset of a recurrent language model.

    Subclasses name their config class, the function that maps it to a
    :class:`DecoderConfig`, and the checkpoint names of a layer's parts.

    Args:
        config: the model's own config (an instance of :attr:`config_class`).
        backend: attention backend of the shell (unused by purely recurrent layers).

    Raises:
        TypeError: ``config`` is not a :attr:`config_class`.
    """

    config_class: ClassVar[type]
    #: checkpoint name -> shell name of each part of a layer
    checkpoint_parts: ClassVar[dict[str, str]]

    @staticmethod
    def to_decoder_config(config: Any) -> DecoderConfig:
        """The model's config as the shell's :class:`DecoderConfig`."""
        raise NotImplementedError

    def __init__(self, config: Any, *, backend: str = "auto") -> None:
        if not isinstance(config, self.config_class):
            name = self.config_class.__name__
            article = "an" if name.startswith(("A", "E", "I", "O", "U", "RWKV")) else "a"
            raise TypeError(f"config must be {article} {name}, got {type(config).__name__}")
        decoder = type(self).to_decoder_config(config)
        super().__init__(decoder, backend=backend)
        self._decoder_config = decoder
        self.config = config
        self.register_state_dict_post_hook(_checkpoint_names)
        self.register_load_state_dict_pre_hook(_shell_names)

    @property
    def decoder_config(self) -> DecoderConfig:
        """The :class:`DecoderConfig` the shell runs (``config`` is the model's own)."""
        return self._decoder_config


def _checkpoint_names(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """``state_dict()``'s names, rewritten from the shell's to the checkpoint's (in place,
    in order)."""
    assert isinstance(module, RecurrentLM)
    parts = module.checkpoint_parts
    ours = [k for k in state_dict if k.startswith(prefix)]
    moved = [(k, state_dict.pop(k)) for k in ours]
    for key, value in moved:
        state_dict[prefix + checkpoint_key(key[len(prefix) :], parts)] = value


def _shell_names(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """``load_state_dict()``'s names, rewritten from the checkpoint's to the shell's (in
    place); a name that is no checkpoint name is left for ``strict`` to report."""
    assert isinstance(module, RecurrentLM)
    parts = module.checkpoint_parts
    ours = [k for k in state_dict if k.startswith(prefix)]
    renamed = {k: shell_key(k[len(prefix) :], parts) for k in ours}
    for key, new in renamed.items():
        if new is not None:
            state_dict[prefix + new] = state_dict.pop(key)


class MambaLM(RecurrentLM):
    """Mamba (Gu & Dao, 2023) or Mamba-2 (Dao & Gu, 2024) language model:
    ``x + mixer(RMSNorm(x))`` blocks (``config.version`` picks the mixer).

    Args:
        config: the architecture.
        backend: as :class:`DecoderLM`'s (no attention layer uses it).
    """

    config_class = MambaConfig
    to_decoder_config = staticmethod(mamba_decoder_config)
    checkpoint_parts = MAMBA_PARTS
    config: MambaConfig


class RWKVLM(RecurrentLM):
    """RWKV-4 language model (Peng et al., 2023): ``x + TimeMix(LN(x))``, then
    ``x + ChannelMix(LN(x))``, after a LayerNorm of the embeddings.

    Args:
        config: the architecture.
        backend: as :class:`DecoderLM`'s (no attention layer uses it).
    """

    config_class = RWKVConfig
    to_decoder_config = staticmethod(rwkv_decoder_config)
    checkpoint_parts = RWKV_PARTS
    config: RWKVConfig


class RetNetLM(RecurrentLM):
    """RetNet language model (Sun et al., 2023), shaped as torchscale's ``RetNetDecoder``:
    ``x + MSR(RMSNorm(x))``, then ``x + GLU(RMSNorm(x))``.

    ``config.form`` picks the multi-token form of every retention layer (chunkwise or
    parallel: the same values, another cost).

    Args:
        config: the architecture.
        backend: as :class:`DecoderLM`'s (no attention layer uses it).
    """

    config_class = RetNetConfig
    to_decoder_config = staticmethod(retnet_decoder_config)
    checkpoint_parts = RETNET_PARTS
    config: RetNetConfig

    def __init__(self, config: RetNetConfig, *, backend: str = "auto") -> None:
        super().__init__(config, backend=backend)
        for m in self.modules():
            if isinstance(m, MultiScaleRetention):
                m.form = config.form

    @property
    def embed_scale(self) -> float:
        """The embeddings' scale, ``sqrt(D)`` or 1 (torchscale's ``scale_embedding``)."""
        return self._decoder_config.embedding_scale or 1.0
