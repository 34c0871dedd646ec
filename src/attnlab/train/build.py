"""The model a training config's ``[model]`` section describes, freshly initialised.

``kind`` picks the family and ``arch`` the config preset; the other keys are fields of
that config class. ``kind = "custom"`` names any model that follows the forward contract
(``labels=`` in, ``loss`` out) by import path: ``model_class = "pkg.module:Class"`` and
``config_class = "pkg.module:ConfigClass"`` (the MoE and state-space models use this
until they have an ``arch`` here).
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch
from torch import nn

from attnlab._validate import check_real

__all__ = ["build_model", "init_weights"]

DECODER_ARCHS = ("llama", "gpt2", "bloom", "mistral")
SEQ2SEQ_ARCHS = ("t5", "transformer")
ENCODER_ARCHS = ("bert",)


def _import(path: str, what: str) -> Any:
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"model.{what} must look like 'package.module:Name', got {path!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"model.{what} {path!r} cannot be imported: {e}") from e


def init_weights(model: nn.Module, std: float) -> None:
    """GPT-2's initialisation (Radford et al., 2019): linear and embedding weights from
    ``N(0, std)``, biases zero; output projections of residual branches scaled by
    ``1/sqrt(2 * layers)``. Norms keep their ones and zeros."""
    layers = max(
        1,
        sum(len(m) for name, m in model.named_children() if isinstance(m, nn.ModuleList)),
    )
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            scale = 1 / math.sqrt(2 * layers) if name.endswith(("out_proj", "fc_out")) else 1.0
            nn.init.normal_(module.weight, mean=0.0, std=std * scale)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)


def build_model(
    section: dict[str, Any], *, vocab_size: int, max_length: int, seed: int
) -> nn.Module:
    """A model for ``section`` with the data's vocabulary, initialised from ``seed``.

    Args:
        section: ``kind``, ``arch``, ``init_std`` (default 0.02; 0 keeps PyTorch's
            defaults), ``backend`` and fields of the config class.
        vocab_size: the data's vocabulary (overrides any ``vocab_size`` given).
        max_length: the longest row; learned position tables are made at least this long.
        seed: seeds the initial weights.

    Raises:
        ValueError: an unknown kind or arch, or config fields the class rejects.
    """
    from attnlab.models import (
        DecoderConfig,
        DecoderLM,
        EncoderConfig,
        EncoderForMaskedLM,
        Seq2SeqConfig,
        Seq2SeqLM,
    )

    fields = dict(section)
    kind = fields.pop("kind", "decoder")
    arch = fields.pop("arch", None)
    std = check_real("model.init_std", fields.pop("init_std", 0.02), ge=0.0)
    backend = str(fields.pop("backend", "auto"))
    fields["vocab_size"] = vocab_size
    torch.manual_seed(seed)
    model: nn.Module
    try:
        if kind == "decoder":
            arch = arch or "llama"
            if arch not in DECODER_ARCHS:
                raise ValueError(
                    f"model.arch for a decoder must be one of {list(DECODER_ARCHS)}, got {arch!r}"
                )
            fields.setdefault("max_position_embeddings", max(2048, max_length))
            model = DecoderLM(getattr(DecoderConfig, arch)(**fields), backend=backend)
        elif kind == "encoder":
            arch = arch or "bert"
            if arch not in ENCODER_ARCHS:
                raise ValueError(
                    f"model.arch for an encoder must be one of {list(ENCODER_ARCHS)}, got {arch!r}"
                )
            fields.setdefault("max_position_embeddings", max(512, max_length))
            fields.setdefault("pad_token_id", None)
            model = EncoderForMaskedLM(EncoderConfig(**fields), backend=backend)
        elif kind == "seq2seq":
            arch = arch or "t5"
            if arch not in SEQ2SEQ_ARCHS:
                raise ValueError(
                    f"model.arch for seq2seq must be one of {list(SEQ2SEQ_ARCHS)}, got {arch!r}"
                )
            fields.setdefault("max_position_embeddings", max(512, max_length))
            model = Seq2SeqLM(getattr(Seq2SeqConfig, arch)(**fields), backend=backend)
        elif kind == "custom":
            model_cls = _import(str(fields.pop("model_class", "")), "model_class")
            config_cls = _import(str(fields.pop("config_class", "")), "config_class")
            model = model_cls(config_cls(**fields))
        else:
            raise ValueError(
                f"model.kind must be one of ['decoder', 'encoder', 'seq2seq', 'custom'], got {kind!r}"
            )
    except TypeError as e:  # an unknown config field
        raise ValueError(f"[model] ({kind}): {e}") from e
    if std > 0:
        init_weights(model, std)
    return model
