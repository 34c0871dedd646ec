"""Conversion between attnlab models and Hugging Face ``transformers`` models.

Each supported architecture is a :class:`Converter` registered under its
``model_type`` (as in a transformers ``config.json``). ``from_hf`` accepts a
transformers model object or a local folder (config.json + safetensors); the
folder path needs only ``safetensors``, not ``transformers``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.errors import ModelFileError
from attnlab.interop.checkpoints import check_model_folder, load_safetensors_dir, read_config

__all__ = [
    "Converter",
    "converter_for",
    "from_hf",
    "per_layer_keys",
    "register_converter",
    "supported_architectures",
    "to_hf",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Converter:
    """How one architecture maps between transformers and attnlab.

    Attributes:
        model_type: transformers' ``config.model_type``.
        hf_classes: transformers class names accepted as objects, each mapped to the
            prefix its state-dict keys carry ("" for the bare model).
        base_prefix: prefix of the base model's keys inside task checkpoints (e.g.
            ``"bert."`` in a saved ``BertForMaskedLM``); stripped when reading a folder.
        attnlab_class: the attnlab model class (for ``to_hf``).
        config_from_hf: ``(hf_config_dict, weight_names) -> attnlab config``.
        build: ``config -> attnlab model``.
        key_map: ``attnlab model -> {attnlab key: transformers key}``.
        to_hf_model: ``attnlab model -> transformers model`` (weights not yet loaded).
        weights_from_hf: optional ``(hf_weights, attnlab config) -> weights`` applied to the
            transformers state dict (prefix removed) before ``key_map`` is used: splits
            fused tensors into the names ``key_map`` uses, drops tied copies.
        weights_to_hf: optional ``(weights, attnlab model) -> hf_weights``, the inverse,
            applied to the renamed state dict before it is loaded into transformers.
        accepts: optional ``attnlab model -> bool`` choosing this converter in ``to_hf``
            when several share ``attnlab_class`` (GPT-2, Llama, ... are all ``DecoderLM``).
        folder_extras: optional ``(model, folder) -> None`` run after loading from a folder:
            reads what lives beside the weights (BERT: sentence-transformers' pooling
            settings and the tokenizer).
    """

    model_type: str
    hf_classes: dict[str, str]
    attnlab_class: type[nn.Module]
    config_from_hf: Callable[[dict[str, Any], set[str]], Any]
    build: Callable[[Any], nn.Module]
    key_map: Callable[[nn.Module], dict[str, str]]
    to_hf_model: Callable[[nn.Module], nn.Module]
    base_prefix: str = ""
    weights_from_hf: Callable[[dict[str, Tensor], Any], dict[str, Tensor]] | None = None
    weights_to_hf: Callable[[dict[str, Tensor], nn.Module], dict[str, Tensor]] | None = None
    accepts: Callable[[nn.Module], bool] | None = None
    folder_extras: Callable[[nn.Module, Path], None] | None = None


_CONVERTERS: dict[str, Converter] = {}


def per_layer_keys(
    num_layers: int,
    parts: dict[str, str],
    theirs: str,
    *,
    ours: str = "layers",
    kinds: tuple[str, ...] = ("weight", "bias"),
    present: Container[str] | None = None,
) -> dict[str, str]:
    """Key map of a layer stack: ``{ours}.{i}.{part}.{kind}`` -> ``{theirs}.{i}.{their_part}.{kind}``.

    Args:
        num_layers: number of layers.
        parts: attnlab sub-module path -> transformers sub-module path, within one layer.
        theirs: transformers' prefix of the layer list (e.g. ``"transformer.h"``).
        ours: attnlab's prefix of the layer list.
        kinds: parameter names to map in each part.
        present: if given, only attnlab keys in it are mapped (parts without a bias).
    """
    return {
        f"{ours}.{i}.{o}.{kind}": f"{theirs}.{i}.{t}.{kind}"
        for i in range(num_layers)
        for o, t in parts.items()
        for kind in kinds
        if present is None or f"{ours}.{i}.{o}.{kind}" in present
    }


def register_converter(conv: Converter) -> Converter:
    _CONVERTERS[conv.model_type] = conv
    return conv


def _ensure_registered() -> None:
    from attnlab.interop import (  # noqa: F401  (registers)
        bamba,
        bert,
        bloom,
        gemma,
        gpt2,
        jamba,
        lfm2,
        llama,
        longformer,
        modernbert,
        moe,
        phi3,
        qwen,
        qwen3_next,
        recurrent_gemma,
        roberta,
        ssm,
        t5,
    )


def supported_architectures() -> list[str]:
    """``model_type`` names ``from_hf`` understands."""
    _ensure_registered()
    return sorted(_CONVERTERS)


def _converter(model_type: str, what: str) -> Converter:
    _ensure_registered()
    if model_type not in _CONVERTERS:
        raise ValueError(
            f"unsupported architecture {what!r} (model_type {model_type!r}); attnlab converts "
            f"{supported_architectures()}"
        )
    return _CONVERTERS[model_type]


def from_hf(model_or_local_dir: Any) -> nn.Module:
    """Return the attnlab model with the same weights as a transformers model.

    Args:
        model_or_local_dir: a ``transformers.PreTrainedModel`` (e.g. ``BertModel``),
            the path of a local folder with ``config.json`` and safetensors weights, a
            quantized folder (:func:`attnlab.interop.quantized.save_quantized`), or a
            ``.gguf`` file (:func:`attnlab.interop.gguf.from_gguf`).

    Returns:
        The attnlab model, in eval mode, in the weights' dtype.

    Raises:
        ValueError: an unsupported architecture (named), a folder without config or
            safetensors weights, or weights that do not fit the config.
        TypeError: anything else.
    """
    if isinstance(model_or_local_dir, str | Path):
        folder = Path(model_or_local_dir)
        if folder.is_file() and folder.suffix.lower() == ".gguf":
            from attnlab.interop.gguf import from_gguf

            return from_gguf(folder)  # type: ignore[no-any-return]
        from attnlab.interop.quantized import RECORD, load_quantized

        if folder.is_dir() and (folder / RECORD).is_file():  # save_quantized's folder, as stored
            return load_quantized(folder)
        folder = check_model_folder(folder)
        cfg = read_config(folder)
        archs = cfg.get("architectures")
        arch = archs[0] if isinstance(archs, list) and archs else str(cfg["model_type"])
        conv = _converter(str(cfg.get("model_type")), arch)
        weights = load_safetensors_dir(folder)
        prefix = conv.hf_classes.get(arch, "")
        if not prefix and conv.base_prefix and any(k.startswith(conv.base_prefix) for k in weights):
            prefix = conv.base_prefix
        model = _assemble(
            conv,
            cfg,
            weights,
            prefix,
            source=str(folder),
            strict_extra=False,
            error=ModelFileError,
            config_file=str(folder / "config.json"),
        )
        if conv.folder_extras is not None:
            conv.folder_extras(model, folder)
        return model
    if isinstance(model_or_local_dir, nn.Module) and hasattr(model_or_local_dir, "config"):
        hf: Any = model_or_local_dir
        cls = type(hf).__name__
        conv = _converter(str(getattr(hf.config, "model_type", "?")), cls)
        if cls not in conv.hf_classes:
            raise ValueError(
                f"unsupported architecture {cls!r}: for model_type {conv.model_type!r} attnlab "
                f"converts {sorted(conv.hf_classes)}"
            )
        weights = dict(hf.state_dict())
        return _assemble(
            conv, hf.config.to_dict(), weights, conv.hf_classes[cls], source=cls, strict_extra=True
        )
    raise TypeError(
        "from_hf expects a transformers model or a local folder path, got "
        f"{type(model_or_local_dir).__name__}"
    )


def _assemble(
    conv: Converter,
    cfg: dict[str, Any],
    weights: dict[str, Tensor],
    prefix: str,
    *,
    source: str,
    strict_extra: bool,
    error: type[ValueError] = ValueError,
    config_file: str | None = None,
    assign: bool = False,
) -> nn.Module:
    """Build ``conv``'s model from a config dict and transformers-named weights.

    ``assign=True`` builds without random initialisation and makes ``weights`` (cast to
    one float dtype) the model's parameters: for weights nobody else holds (a GGUF load).
    """
    if prefix:
        weights = {(k[len(prefix) :] if k.startswith(prefix) else k): v for k, v in weights.items()}
    try:
        config = conv.config_from_hf(cfg, set(weights))
    except KeyError as e:
        raise error(
            f"{config_file or source}: lacks the field {e.args[0]!r}, which a "
            f"{conv.model_type} config needs"
        ) from None
    except (TypeError, ValueError, ArithmeticError) as e:
        raise error(f"{config_file or source}: {e}") from None
    if conv.weights_from_hf is not None:
        try:
            weights = conv.weights_from_hf(weights, config)
        except KeyError as e:
            raise error(f"{source}: weight {e.args[0]!r} is missing") from None
    model = _build_empty(conv, config) if assign else conv.build(config)
    mapping = conv.key_map(model)
    own = model.state_dict()
    state: dict[str, Tensor] = {}
    missing = []
    for ours, theirs in mapping.items():
        if theirs in weights:
            t = weights[theirs]
            if t.shape != own[ours].shape:
                raise error(
                    f"{source}: weight {theirs} has shape {tuple(t.shape)}, the config implies "
                    f"{tuple(own[ours].shape)} for {ours}"
                )
            state[ours] = t
        else:
            missing.append(theirs)
    if missing:
        raise error(f"{source}: weights missing for {missing}")
    used = set(mapping.values())
    extra = sorted(k for k in weights if k not in used and not _is_buffer_key(k))
    if extra:
        if strict_extra:
            raise ValueError(f"{source}: weights attnlab does not know how to place: {extra}")
        log.warning("%s: ignoring weights outside the converted model: %s", source, extra)
    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    model.to(dtype)
    if assign:
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=assign)
    return model.eval()


_EMPTY_LOCK = threading.Lock()


def _build_empty(conv: Converter, config: Any) -> nn.Module:
    """``conv.build(config)`` with its parameters on the meta device (no random init).

    Parameters are moved to ``meta`` as modules register them and ``torch.nn.init``'s
    initialisers do nothing meanwhile (as transformers' ``no_init_weights`` and
    accelerate's ``init_empty_weights`` do); buffers (RoPE frequencies) are built as
    usual. Every parameter must then be assigned by ``load_state_dict(..., assign=True)``
    (``strict=True`` checks it).
    """
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        if param is not None:
            self._parameters[name] = nn.Parameter(
                param.to("meta"), requires_grad=param.requires_grad
            )

    def skip(tensor: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return tensor

    init = torch.nn.init
    with _EMPTY_LOCK:
        saved = {name: getattr(init, name) for name in _INITIALISERS}
        nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
        for name in _INITIALISERS:
            setattr(init, name, skip)
        try:
            return conv.build(config)
        finally:
            nn.Module.register_parameter = register  # type: ignore[method-assign]
            for name, fn in saved.items():
                setattr(init, name, fn)


_INITIALISERS = (
    "normal_",
    "uniform_",
    "trunc_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "orthogonal_",
    "ones_",
    "zeros_",
    "constant_",
)


def _is_buffer_key(key: str) -> bool:
    # transformers keeps index buffers (position_ids, token_type_ids) in some checkpoints.
    return key.endswith(("position_ids", "token_type_ids"))


def converter_for(model: nn.Module) -> Converter | None:
    """The converter ``to_hf`` uses for ``model`` (None when transformers has no equivalent)."""
    _ensure_registered()
    return next(
        (
            c
            for c in _CONVERTERS.values()
            if _serves(c, model) and (c.accepts is None or c.accepts(model))
        ),
        None,
    )


def _serves(converter: Converter, model: nn.Module) -> bool:
    """A converter serves its class and its subclasses, except a preset's: Mamba, RWKV and
    RetNet are ``DecoderLM`` presets, converted by their own converters only."""
    from attnlab.models.recurrent import RecurrentLM

    if isinstance(model, RecurrentLM) and not issubclass(converter.attnlab_class, RecurrentLM):
        return False
    return isinstance(model, converter.attnlab_class)


def to_hf(model: nn.Module) -> nn.Module:
    """Return the transformers model with the same weights as an attnlab model.

    Raises:
        ValueError: a model class or configuration transformers has no equivalent for.
        ImportError: transformers is not installed (the ``hf`` extra).
    """
    conv = converter_for(model)
    if conv is None:
        raise ValueError(
            f"to_hf cannot convert {type(model).__name__}; supported: "
            f"{sorted(c.attnlab_class.__name__ for c in _CONVERTERS.values())}"
        )
    hf = conv.to_hf_model(model)
    own = model.state_dict()
    state = {theirs: own[ours] for ours, theirs in conv.key_map(model).items()}
    if conv.weights_to_hf is not None:
        state = conv.weights_to_hf(state, model)
    result = hf.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not _is_buffer_key(k)]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"to_hf: transformers model left missing {missing}, unexpected {result.unexpected_keys}"
        )
    dtype = next((t.dtype for t in own.values() if t.is_floating_point()), torch.float32)
    return hf.to(dtype).eval()


def require_transformers() -> Any:
    """Import transformers or say which extra installs it."""
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("this needs transformers: pip install 'attnlab[hf]'") from e
    return transformers
