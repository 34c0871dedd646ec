"""GGUF files -> attnlab models (:func:`from_gguf`), with their tokenizer and chat template.

The file is parsed by :mod:`attnlab.interop.gguf_reader` (header only; tensor bytes are
mapped and read on demand), each tensor is expanded by
:mod:`attnlab.functional.gguf_blocks` (one vectorised pass per tensor), renamed to
transformers' names with llama.cpp's q/k row permutation undone
(:mod:`attnlab.interop.gguf_names`), and assembled by the same Llama converter as a
safetensors folder. The tokenizer is transformers' own GGUF conversion, fed from the
metadata already parsed; the chat template, special tokens and sampling defaults come
from the metadata too. Writing is :mod:`attnlab.interop.gguf_writer`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnlab.errors import ModelFileError
from attnlab.interop.gguf_names import config_from_gguf, hf_name, unpermute_qk
from attnlab.interop.gguf_reader import GGUFFile, read_gguf

__all__ = ["from_gguf", "generation_settings", "gguf_tokenizer"]

log = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# general.sampling.* (llama.cpp) -> transformers' GenerationConfig names
_SAMPLING = {
    "temp": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "penalty_repeat": "repetition_penalty",
}
_SPECIAL = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def from_gguf(
    path: str | Path,
    *,
    dtype: torch.dtype | str = torch.float32,
    tokenizer: bool = True,
    progress: bool = False,
    quantize: str | None = None,
    compute: str | None = None,
) -> Any:
    """Load a GGUF file (llama.cpp's format) as an attnlab :class:`~attnlab.models.DecoderLM`.

    Quantized tensors (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K) are dequantized to
    ``dtype``; the result has the logits transformers' GGUF loader gives for the file.

    Args:
        path: the ``.gguf`` file.
        dtype: float32 (default), float16 or bfloat16, or ``"auto"``: bfloat16 where
            the CPU multiplies it natively, float32 elsewhere
            (:func:`attnlab.backends.precision.choose_float_dtype`; the choice and its
            reason are kept in ``model.dtype_choice``).
        tokenizer: build ``model.tokenizer`` (a transformers fast tokenizer with the
            file's chat template and special tokens); needs the ``hf`` extra.
        progress: show a progress bar over the tensors on stderr (tqdm).
        quantize: None (every tensor expanded to ``dtype``); ``"gguf"`` (the file's
            quantized matrices kept as they are stored, repacked once into int8/int4
            layers without going through float: :mod:`attnlab.interop.gguf_quant`); or
            ``"int8"``/``"int4"``/``"int4:g64"``... (the same, and the file's float
            matrices quantized so).
        compute: the quantized layers' compute policy
            (:data:`attnlab.backends.qmatmul.COMPUTE_POLICIES`). None (the default) is
            ``"int8"`` for a quantized load: activations quantized to int8 blocks of 32,
            as llama.cpp multiplies this file (:mod:`attnlab.backends.qmatmul`). Float
            activations: ``"auto"`` (bfloat16 where the CPU multiplies it natively, else
            float32), ``"float32"`` or ``"bfloat16"``. Needs ``quantize``.

    Returns:
        The model in eval mode, with ``model.tokenizer`` (or None) and
        ``model.generation_config`` (a dict: token ids and the file's sampling defaults).

    Raises:
        ModelFileError: a missing, damaged or truncated file, an architecture attnlab
            does not map (named), tensors it cannot place (named), or metadata that does
            not fit the weights.
        ValueError: an unsupported ``dtype``.
    """
    from attnlab.interop import llama
    from attnlab.interop.hf import _assemble

    choice = None
    if isinstance(dtype, str):
        from attnlab.backends.precision import choose_float_dtype

        choice = choose_float_dtype(dtype)
        dtype = choice.dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {list(_DTYPES)} or 'auto', got {dtype!r}")
    gguf = read_gguf(path)
    try:
        cfg = config_from_gguf(gguf.metadata, set(gguf.tensors), str(gguf.path))
    except KeyError as e:
        raise ModelFileError(
            f"{gguf.path}: lacks the metadata key {e.args[0]!r}, which a "
            f"{gguf.architecture} model needs"
        ) from None
    except ValueError as e:
        raise ModelFileError(str(e)) from None
    from attnlab.backends.qmatmul import COMPUTE_POLICIES

    if compute is not None and compute not in COMPUTE_POLICIES:
        raise ValueError(
            f"compute must be None or one of {list(COMPUTE_POLICIES)}, got {compute!r}"
        )
    if compute not in (None, "auto") and quantize is None:
        raise ValueError(f"compute={compute!r} applies to quantized layers: pass quantize= too")
    kept: set[str] = set()
    if quantize is not None:
        from attnlab.interop.gguf_quant import blocks_to_keep
        from attnlab.modules.linear import LinearSpec

        if quantize != "gguf":
            LinearSpec.parse(quantize)  # a bad spec fails before any tensor is read
        kept = blocks_to_keep(gguf)
    weights = _hf_weights(gguf, cfg, dtype, progress=progress, placeholders=kept)
    model: Any = _assemble(
        llama.LLAMA,
        cfg,
        weights,
        "",
        source=str(gguf.path),
        strict_extra=True,
        error=ModelFileError,
        assign=True,
    )
    if quantize is not None:
        from attnlab.interop.gguf_quant import load_blocks

        heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
        load_blocks(model, gguf, kept, heads, quantize)
        if compute != "auto":  # None: int8 activations, as llama.cpp runs the file
            from attnlab.models.quantize import set_compute

            set_compute(model, compute or "int8")
    model.tokenizer = gguf_tokenizer(gguf) if tokenizer else None
    model.generation_config = generation_settings(gguf.metadata)
    model.dtype_choice = choice
    return model


def _hf_weights(
    gguf: GGUFFile,
    cfg: dict[str, Any],
    dtype: torch.dtype,
    *,
    progress: bool,
    placeholders: set[str] | frozenset[str] = frozenset(),
) -> dict[str, Tensor]:
    """transformers-named weights; ``placeholders`` (quantized tensors a quantized load
    keeps as blocks) are shape-only meta tensors, never expanded."""
    names = list(gguf.tensors)
    unmapped = [n for n in names if hf_name(n) is None]
    if unmapped:
        raise ModelFileError(
            f"{gguf.path}: tensors attnlab cannot place in a {gguf.architecture} model: "
            f"{unmapped[:8]}{' ...' if len(unmapped) > 8 else ''}"
        )
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    it: Any = names
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(names, desc=f"loading {gguf.path.name}", unit="tensor", leave=False, disable=None)
    out: dict[str, Tensor] = {}
    for name in it:
        if name in placeholders:
            w = torch.empty(gguf.tensors[name].shape, dtype=dtype, device="meta")
        else:
            w = gguf.tensor(name, dtype)
        part = name.split(".")[2] if name.startswith("blk.") else ""
        if part in heads:
            w = unpermute_qk(w, heads[part])
        out[str(hf_name(name))] = w
    return out


def generation_settings(meta: dict[str, Any]) -> dict[str, Any]:
    """Token ids and sampling defaults from GGUF metadata, under transformers' names."""
    out: dict[str, Any] = {}
    for key, name in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("padding_token_id", "pad_token_id"),
    ):
        if f"tokenizer.ggml.{key}" in meta:
            out[name] = int(meta[f"tokenizer.ggml.{key}"])
    for key, name in _SAMPLING.items():
        if f"general.sampling.{key}" in meta:
            out[name] = meta[f"general.sampling.{key}"]
    return out


def gguf_tokenizer(gguf: GGUFFile) -> Any:
    """The transformers fast tokenizer a GGUF file describes (transformers' own conversion).

    Raises:
        ImportError: transformers (the ``hf`` extra) is missing or lacks its GGUF tokenizer
            conversion.
        ModelFileError: the file has no vocabulary.
    """
    from attnlab.interop.hf import require_transformers

    tf = require_transformers()
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError as e:  # pragma: no cover - depends on the installed transformers
        raise ImportError(
            f"transformers {tf.__version__} lacks the GGUF tokenizer conversion attnlab uses "
            "(transformers.integrations.gguf); install 'attnlab[hf]'"
        ) from e
    meta = gguf.metadata
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ModelFileError(f"{gguf.path}: no tokenizer.ggml.tokens; the file has no tokenizer")
    grouped = {
        group: {
            name: meta[f"tokenizer.{key}"]
            for key, name in keys.items()
            if f"tokenizer.{key}" in meta
        }
        for group, keys in GGUF_TOKENIZER_MAPPING.items()
    }
    tok_dict, tok_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tok_dict.get("tokenizer_type") == "llama":
        # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise
        tok_config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        tok_config[name] = tokens[token_id] if token_id is not None else None
    try:
        backend, extra = convert_gguf_tokenizer(gguf.architecture, tok_dict)
    except (KeyError, ValueError, TypeError) as e:
        raise ModelFileError(f"{gguf.path}: the tokenizer cannot be built: {e}") from None
    tf.utils.logging.disable_progress_bar()
    return tf.PreTrainedTokenizerFast(tokenizer_object=backend, **(tok_config | extra))
