"""Save and reload quantized models: safetensors with the layout of every layer recorded.

A folder written by :func:`save_quantized` holds ``model.safetensors`` (the int8 levels,
packed 4-bit levels, scales, minimums and the float parameters, each stored once) and
``attnlab_quantized.json`` (the model's config and, for every quantized layer, its kind,
group size and shape), plus the tokenizer when the model carries one. :func:`load_quantized`
builds the same modules from the record and loads the tensors as they are: nothing is
re-quantized, so a reloaded model computes what the saved one did.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from attnlab.errors import ModelFileError
from attnlab.interop.checkpoints import load_safetensors_dir, read_json_object
from attnlab.modules.linear import LinearSpec, make_linear
from attnlab.modules.quant_linear import QuantEmbedding, QuantLinear

__all__ = ["RECORD", "load_quantized", "save_quantized"]

RECORD = "attnlab_quantized.json"
_FORMAT = "attnlab-quantized/1"


def _layer_record(layer: QuantLinear) -> dict[str, Any]:
    return {
        "weights": layer.kind,
        "group_size": layer.group_size,
        "in_features": layer.in_features,
        "out_features": layer.out_features,
        "bias": layer.bias is not None,
    }


def save_quantized(model: nn.Module, folder: str | Path) -> Path:
    """Write ``model`` (a quantized :class:`~attnlab.models.DecoderLM`) to ``folder``.

    Files are written to temporary names and renamed into place.

    Raises:
        TypeError: not a decoder with a config.
    """
    from safetensors.torch import save_file

    from attnlab.models.decoder import DecoderLM
    from attnlab.models.decoder_config import DecoderConfig

    if not isinstance(model, DecoderLM) or not isinstance(model.config, DecoderConfig):
        raise TypeError(f"save_quantized writes a DecoderLM, got {type(model).__name__}")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    layers = {n: _layer_record(m) for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    record = {
        "format": _FORMAT,
        "config": model.config.to_dict(),
        "layers": layers,
        "quantization": getattr(model, "quantization", None),
        "generation_config": getattr(model, "generation_config", {}),
    }
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    _atomic(out / "model.safetensors", lambda p: save_file(state, str(p)))
    _atomic(out / RECORD, lambda p: p.write_text(json.dumps(record, indent=2) + "\n"))
    tok = getattr(model, "tokenizer", None)
    if tok is not None and hasattr(tok, "save_pretrained"):
        tok.save_pretrained(str(out))
    return out


def _atomic(path: Path, write: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_quantized(folder: str | Path) -> nn.Module:
    """The model :func:`save_quantized` wrote to ``folder``, in eval mode.

    Raises:
        ModelFileError: no record, a record of another format, or tensors that do not
            fit the recorded layers (named).
    """
    from attnlab.models.decoder import DecoderLM
    from attnlab.models.decoder_config import DecoderConfig

    src = Path(folder)
    path = src / RECORD
    if not path.is_file():
        raise ModelFileError(f"{src} has no {RECORD}; it was not written by save_quantized")
    record = read_json_object(path)
    if record.get("format") != _FORMAT:
        raise ModelFileError(f"{path}: format {record.get('format')!r}, expected {_FORMAT!r}")
    try:
        model = DecoderLM(DecoderConfig.from_dict(record["config"]))
        placed = _place_experts(model, record["layers"])
        for name, rec in record["layers"].items():
            if name not in placed:
                _place(model, name, rec)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFileError(f"{path}: the record does not describe a model: {e}") from None
    state = load_safetensors_dir(src)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ModelFileError(f"{src}: the tensors do not fit the recorded layers: {e}") from None
    model.quantization = record.get("quantization")  # type: ignore[assignment]
    model.generation_config = record.get("generation_config") or {}
    if (src / "tokenizer.json").is_file():
        from attnlab.interop.hf import require_transformers

        model.tokenizer = require_transformers().AutoTokenizer.from_pretrained(str(src))
    return model.eval()


def _empty_layer(rec: dict[str, Any]) -> Any:
    spec = LinearSpec(rec["weights"], rec["group_size"])
    return make_linear(rec["in_features"], rec["out_features"], bias=rec["bias"], spec=spec)


def _place_experts(model: nn.Module, layers: dict[str, Any]) -> set[str]:
    """Empty :class:`QuantExperts` where the record has ``{experts}.w_in.{e}`` layers;
    returns the layer names placed so."""
    from attnlab.modules.experts import Experts
    from attnlab.modules.quant_experts import QuantExperts

    placed: set[str] = set()
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, Experts) or f"{name}.w_in.0" not in layers:
            continue
        names = {
            part: [f"{name}.{part}.{e}" for e in range(mod.num_experts)]
            for part in ("w_in", "w_out")
        }
        quant = QuantExperts(
            w_in=[_empty_layer(layers[n]) for n in names["w_in"]],
            w_out=[_empty_layer(layers[n]) for n in names["w_out"]],
            activation=mod.activation_name,
            gated=mod.gated,
        )
        parent_path, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, child, quant)
        placed |= set(names["w_in"]) | set(names["w_out"])
    return placed


def _place(model: nn.Module, name: str, rec: dict[str, Any]) -> None:
    """An empty layer of the recorded kind where ``name`` is (an embedding's table too)."""
    layer = _empty_layer(rec)
    parent_path, _, child = name.rpartition(".")
    if child == "table" and parent_path == "embed_tokens":
        model.embed_tokens = QuantEmbedding(table=layer)  # type: ignore[assignment]
        return
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, child, layer)
