"""LoRA targets by transformers' module names, and adapters in peft's folder format.

A LoRA target is a module name as either library spells it: attnlab's (``q_proj``,
``out_proj``, ``fc_in``) or transformers' (``o_proj``, ``gate_proj``, GPT-2's ``c_attn``,
BERT's ``query``). The architecture's converter (:mod:`attnlab.interop.hf`) says which
transformers module each attnlab layer is, so the names need no table of their own; a
fused transformers module (GPT-2's ``c_attn``, held by attnlab as q, k and v) becomes one
adapter group sharing ``lora_A``, exactly as peft adapts it.

:func:`save_peft_adapter` writes ``adapter_config.json`` and ``adapter_model.safetensors``
as peft does, so ``peft.PeftModel.from_pretrained(to_hf(base), folder)`` computes what the
adapted attnlab model computes; :func:`load_peft_adapter` reads such a folder back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnlab._files import atomic_folder
from attnlab.interop.hf import converter_for
from attnlab.modules.lora import LoRALinear, apply_lora, is_linear_like, lora_modules

__all__ = [
    "hf_module_names",
    "load_peft_adapter",
    "resolve_targets",
    "save_peft_adapter",
]

ALL_LINEAR = "all-linear"
_FUSED_PARTS = ("q", "k", "v")  # interop's names for the parts of a fused q/k/v weight
_CONCATENATED = ("gpt2",)  # fused parts stacked [q; k; v] (BLOOM interleaves per head)
_OUTPUT_LAYERS = ("lm_head",)


@contextmanager
def _float_view(model: nn.Module) -> Iterator[None]:
    """Inside the block, every adapted or quantized linear layer is a plain ``nn.Linear``
    (on the meta device: shapes only), so the converter's key map sees its usual names."""
    swapped: list[tuple[str, nn.Module]] = []
    for path, m in model.named_modules():
        if any(path.startswith(f"{p}.") for p, _ in swapped):
            continue
        if isinstance(m, LoRALinear) or (is_linear_like(m) and not isinstance(m, nn.Linear)):
            swapped.append((path, m))
    for path, m in swapped:
        bias = getattr(m.base_layer if isinstance(m, LoRALinear) else m, "bias", None)
        i, o = getattr(m, "in_features"), getattr(m, "out_features")  # noqa: B009
        stand_in = nn.Linear(int(i), int(o), bias=bias is not None, device="meta")
        _set(model, path, stand_in)
    try:
        yield
    finally:
        for path, m in swapped:
            _set(model, path, m)


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def hf_module_names(model: nn.Module) -> dict[str, str]:
    """attnlab linear-layer path -> transformers module path (``{}`` without a converter).

    Fused parts keep interop's suffix: GPT-2's ``layers.0.self_attention.q_proj`` is
    ``transformer.h.0.attn.c_attn.q``.
    """
    conv = converter_for(model)
    if conv is None:
        return {}
    with _float_view(model):
        mapping = conv.key_map(model)
        linear = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    return {
        ours[: -len(".weight")]: theirs[: -len(".weight")]
        for ours, theirs in mapping.items()
        if ours.endswith(".weight") and ours[: -len(".weight")] in linear
    }


def _fused_parent(hf_name: str) -> str | None:
    parent, _, part = hf_name.rpartition(".")
    return parent if part in _FUSED_PARTS and parent else None


def _leaf(path: str) -> str:
    return path.rpartition(".")[2]


def resolve_targets(model: nn.Module, targets: list[str] | str) -> list[str | list[str]]:
    """The module paths (and fused groups) that ``targets`` name in ``model``.

    Args:
        model: an attnlab model.
        targets: module names, attnlab's or transformers' (``["q_proj", "v_proj"]``,
            ``["c_attn"]``, ``"q_proj,o_proj"``), or ``"all-linear"`` (every linear layer
            but the output head, as peft's ``all-linear``).

    Returns:
        Paths for :func:`~attnlab.modules.lora.apply_lora`; a fused transformers module
        named as a whole is one inner list of its parts.

    Raises:
        ValueError: no targets, or a name that matches no linear layer (the message lists
            the names that would).
    """
    names = [t.strip() for t in targets.split(",")] if isinstance(targets, str) else list(targets)
    names = [t for t in names if t]
    if not names:
        raise ValueError("LoRA needs at least one target module name (e.g. q_proj,v_proj)")
    hf = hf_module_names(model)
    layers = [
        p
        for p, m in model.named_modules()
        if is_linear_like(m) and _leaf(p) not in _OUTPUT_LAYERS and not isinstance(m, LoRALinear)
    ]
    chosen: dict[str, str | list[str]] = {}  # first path of a unit -> the unit
    available: set[str] = set()
    for t in names:
        hits = 0
        for path in layers:
            theirs = hf.get(path)
            parent = _fused_parent(theirs) if theirs else None
            leaves = {_leaf(path)} | ({_leaf(theirs)} if theirs and not parent else set())
            available |= leaves | ({_leaf(parent)} if parent else set())
            if t == ALL_LINEAR or t in leaves:
                chosen.setdefault(path, path)
                hits += 1
            elif parent and t == _leaf(parent):
                group = [p for p in layers if hf.get(p, "").rpartition(".")[0] == parent]
                chosen.setdefault(group[0], group)
                hits += 1
        if not hits:
            raise ValueError(
                f"LoRA target {t!r} matches no linear layer of {type(model).__name__}; "
                f"its linear layers are named {sorted(available)} (or use 'all-linear')"
            )
    units = list(chosen.values())
    flat = [p for u in units for p in ([u] if isinstance(u, str) else u)]
    dupes = sorted({p for p in flat if flat.count(p) > 1})
    if dupes:
        raise ValueError(
            f"LoRA targets name {dupes} both alone and as part of a fused module; name one"
        )
    return units


def _adapter_groups(model: nn.Module) -> list[list[tuple[str, LoRALinear]]]:
    """Adapters grouped by their (possibly shared) ``lora_A``."""
    groups: dict[int, list[tuple[str, LoRALinear]]] = {}
    for path, m in lora_modules(model):
        groups.setdefault(id(m.lora_A), []).append((path, m))
    return list(groups.values())


def _peft_tensors(model: nn.Module) -> tuple[dict[str, Tensor], list[str], dict[str, Any]]:
    """``(tensors, transformers module names, shared settings)`` of ``model``'s adapters."""
    conv = converter_for(model)
    if conv is None:
        raise ValueError(
            f"{type(model).__name__} has no transformers equivalent, so there is no peft "
            "adapter for it (save the attnlab checkpoint instead)"
        )
    hf = hf_module_names(model)
    tensors: dict[str, Tensor] = {}
    modules: list[str] = []
    settings: set[tuple[int, float, bool, float]] = set()
    for group in _adapter_groups(model):
        first = group[0][1]
        p = first.lora_dropout.p if isinstance(first.lora_dropout, nn.Dropout) else 0.0
        settings.add((first.rank, first.alpha, first.use_rslora, float(p)))
        names = [hf[path] for path, _ in group]
        parents = {_fused_parent(n) for n in names}
        if len(group) == 1:
            name, b = names[0], first.lora_B.weight
            if _fused_parent(name) is not None:
                raise ValueError(
                    f"{group[0][0]} is one part of the fused transformers module "
                    f"{_fused_parent(name)}: peft adapts the fused module as a whole (target "
                    f"{_leaf(str(_fused_parent(name)))!r} instead)"
                )
        else:
            parent = next(iter(parents))
            order = [_leaf(n) for n in names]
            if len(parents) != 1 or parent is None or sorted(order) != sorted(_FUSED_PARTS):
                raise ValueError(
                    f"adapters {[path for path, _ in group]} share lora_A but are not the "
                    "q, k and v of one fused transformers module"
                )
            if conv.model_type not in _CONCATENATED:
                raise ValueError(
                    f"a fused {conv.model_type} projection ({parent}) cannot be written as "
                    "one peft adapter (its q, k and v rows interleave); adapt q_proj, "
                    "k_proj and v_proj separately"
                )
            by_part = {_leaf(n): m.lora_B.weight for n, (_, m) in zip(names, group)}
            name, b = parent, torch.cat([by_part[k] for k in _FUSED_PARTS], dim=0)
        modules.append(name)
        tensors[f"base_model.model.{name}.lora_A.weight"] = first.lora_A.weight.detach()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.detach()
    if len(settings) != 1:
        raise ValueError(f"adapters with different settings {sorted(settings)}: peft has one")
    r, alpha, rslora, dropout = settings.pop()
    shared = {
        "r": r,
        "lora_alpha": alpha,
        "use_rslora": rslora,
        "lora_dropout": dropout,
        "fan_in_fan_out": conv.model_type in _CONCATENATED,  # GPT-2's Conv1D
        "model_type": conv.model_type,
    }
    return tensors, modules, shared


def save_peft_adapter(
    model: nn.Module, folder: str | Path, *, base_model_name_or_path: str | None = None
) -> Path:
    """Write ``model``'s adapters as a peft LoRA folder.

    Args:
        model: an attnlab model with LoRA adapters whose architecture converts to
            transformers.
        folder: the folder to write (replaced atomically if it exists).
        base_model_name_or_path: recorded in ``adapter_config.json``.

    Returns:
        The folder.

    Raises:
        ValueError: no adapters, no transformers equivalent, adapters with different
            settings, or an adapter on one part of a fused module.
    """
    import safetensors.torch

    if not any(True for _ in lora_modules(model)):
        raise ValueError(f"{type(model).__name__} has no LoRA adapters to save")
    tensors, modules, shared = _peft_tensors(model)
    shared.pop("model_type")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM" if hasattr(model, "generate") else None,
        "base_model_name_or_path": base_model_name_or_path,
        "target_modules": "|".join(re.escape(m) for m in modules),  # full names, fullmatch
        "bias": "none",
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        **shared,
    }
    folder = Path(folder)
    with atomic_folder(folder) as tmp:
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        safetensors.torch.save_file(
            {k: v.contiguous().clone() for k, v in tensors.items()},
            str(tmp / "adapter_model.safetensors"),
            metadata={"format": "pt"},
        )
    return folder


def load_peft_adapter(model: nn.Module, folder: str | Path) -> nn.Module:
    """Wrap ``model`` with the LoRA adapters of a peft folder, in place.

    Raises:
        ValueError: a folder that is not a peft LoRA adapter, or adapters for modules
            ``model`` does not have.
    """
    import safetensors.torch

    folder = Path(folder)
    cfg_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not cfg_path.is_file() or not weights_path.is_file():
        raise ValueError(
            f"{folder} is not a peft adapter folder (needs adapter_config.json and "
            "adapter_model.safetensors)"
        )
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r}; only LORA is read")
    weights = safetensors.torch.load_file(str(weights_path))
    prefix = "base_model.model."
    names = sorted({k[len(prefix) :].rsplit(".lora_", 1)[0] for k in weights})
    ours_of: dict[str, list[str]] = {}
    hf_names = hf_module_names(model)
    for ours, theirs in hf_names.items():
        parent = _fused_parent(theirs)
        ours_of.setdefault(parent or theirs, []).append(ours)
    for parts in ours_of.values():  # fused parts in q, k, v order, the rows' order
        parts.sort(key=lambda p: _FUSED_PARTS.index(_leaf(hf_names[p])) if len(parts) > 1 else 0)
    unknown = [n for n in names if n not in ours_of]
    if unknown:
        raise ValueError(f"{folder}: adapters for modules the model does not have: {unknown}")
    units: list[str | list[str]] = [
        ours_of[n][0] if len(ours_of[n]) == 1 else ours_of[n] for n in names
    ]
    dropout = float(cfg.get("lora_dropout", 0.0))
    apply_lora(
        model,
        units,
        rank=int(cfg["r"]),
        alpha=float(cfg["lora_alpha"]),
        dropout=dropout,
        use_rslora=bool(cfg.get("use_rslora", False)),
    )
    modules = dict(lora_modules(model))
    with torch.no_grad():
        for n in names:
            a = weights[f"{prefix}{n}.lora_A.weight"]
            b = weights[f"{prefix}{n}.lora_B.weight"]
            parts = ours_of[n]
            bs = b.chunk(len(parts), dim=0) if len(parts) > 1 else (b,)
            for path, bp in zip(parts, bs):
                modules[path].lora_A.weight.copy_(a)
                modules[path].lora_B.weight.copy_(bp)
    return model
