"""attnlab models -> GGUF files (:func:`to_gguf`), written with the ``gguf`` package's writer.

The layout follows llama.cpp's converter (``convert_hf_to_gguf.py``): llama.cpp's tensor
names, q/k rows permuted for its RoPE kernel, one-dimensional tensors (norms) in F32,
matrices in the requested type (F32, F16, or Q8_0 blocks quantized by
``gguf.quants``), no ``output.weight`` when the embeddings are tied. Files are written
to a temporary name beside the target and renamed, so a failed write leaves nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnlab._files import atomic_write
from attnlab.interop.gguf_names import gguf_metadata_from_config, gguf_name, permute_qk

__all__ = ["GGUF_DTYPES", "to_gguf", "write_gguf"]

#: ``dtype=`` values of :func:`to_gguf` -> (ggml type name, llama.cpp's ``general.file_type``)
GGUF_DTYPES = {"f32": ("F32", 0), "f16": ("F16", 1), "q8_0": ("Q8_0", 7)}


def _require_gguf() -> Any:
    try:
        import gguf
    except ImportError as e:
        raise ImportError(
            "writing GGUF files needs the gguf package: pip install 'attnlab[hf]'"
        ) from e
    return gguf


def write_gguf(
    path: str | Path,
    metadata: dict[str, Any],
    tensors: dict[str, tuple[Any, str]],
) -> Path:
    """Write a GGUF file atomically.

    Args:
        path: the file to write.
        metadata: key -> value; ints are written as uint32 (int64 when negative or large),
            floats as float32, and strings, bools and lists as such.
            ``general.architecture`` is required.
        tensors: GGUF name -> ``(numpy array, ggml type name)``: float arrays for
            ``"F32"``/``"F16"``, uint8 rows of blocks for quantized types.

    Returns:
        The path written.
    """
    gguf = _require_gguf()
    path = Path(path)
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"metadata needs general.architecture (a string), got {arch!r}")

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), arch)
        for key, value in metadata.items():
            if key != "general.architecture":
                _add(writer, gguf, key, value)
        for name, (array, kind) in tensors.items():
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, array, raw_dtype=None if kind in ("F32", "F16") else qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    return atomic_write(path, write)  # the one atomic writer: temporary name, fsync, rename


def _add(writer: Any, gguf: Any, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        if 0 <= value < 2**32:
            writer.add_uint32(key, value)
        else:
            writer.add_int64(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list | tuple):
        writer.add_array(key, list(value))
    else:
        raise TypeError(f"GGUF metadata {key!r}: cannot write a {type(value).__name__}")


def _encode(w: Tensor, kind: str, gguf: Any) -> tuple[Any, str]:
    """One tensor as the numpy array the writer takes, in ``kind`` (matrices) or F32 (vectors)."""
    a = w.detach().to(torch.float32).contiguous().numpy()
    if w.dim() < 2 or kind == "F32":
        return a, "F32"
    if kind == "F16":
        return a.astype("float16"), "F16"
    if w.shape[-1] % 32:
        return a, "F32"  # Q8_0 needs whole blocks of 32 along a row (llama.cpp falls back too)
    return gguf.quants.quantize(a, gguf.GGMLQuantizationType[kind]), kind


def to_gguf(
    model: nn.Module,
    path: str | Path,
    *,
    dtype: str = "f32",
    name: str | None = None,
    tokenizer: Any = None,
) -> Path:
    """Write a Llama-architecture :class:`~attnlab.models.DecoderLM` as a GGUF file.

    llama.cpp, ollama and transformers' GGUF loader read the result (transformers gives
    the same logits as the model, to the rounding of ``dtype``).

    Args:
        model: a RoPE + RMSNorm + SwiGLU decoder without biases (Llama; what
            ``attnlab.to_hf`` turns into ``LlamaForCausalLM``).
        path: the file to write (atomically).
        dtype: ``"f32"``, ``"f16"`` or ``"q8_0"`` for the matrices; norms stay F32.
        name: ``general.name`` (default: the file's stem).
        tokenizer: a transformers fast tokenizer (byte-level BPE) to store; default
            ``model.tokenizer`` when set. Without one the file holds no vocabulary.

    Returns:
        The path written.

    Raises:
        ValueError: a model that is not a Llama-architecture decoder (what differs), or
            an unknown ``dtype``.
    """
    from attnlab.interop import llama
    from attnlab.models.decoder import DecoderLM

    if dtype not in GGUF_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(GGUF_DTYPES)}, got {dtype!r}")
    if not isinstance(model, DecoderLM):
        raise ValueError(
            f"to_gguf writes a DecoderLM (Llama architecture), got {type(model).__name__}"
        )
    c = model.config
    llama._check_convertible(c, "GGUF's llama architecture")
    if not llama.LLAMA.accepts or not llama.LLAMA.accepts(model):
        raise ValueError(
            "to_gguf writes the Llama architecture: no sliding window, QK-norm or MoE layers"
        )
    if c.attention_bias or c.mlp_bias:
        raise ValueError("to_gguf writes Llama without attention or MLP biases")
    gguf = _require_gguf()
    kind, file_type = GGUF_DTYPES[dtype]
    cfg = llama._hf_kwargs(c)
    meta = gguf_metadata_from_config(cfg)
    meta["general.name"] = name or Path(path).stem
    meta["general.file_type"] = file_type
    if kind != "F32" and kind != "F16":
        meta["general.quantization_version"] = 2
    tok = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if tok is not None:
        from attnlab.interop.gguf_vocab import tokenizer_metadata

        meta |= tokenizer_metadata(tok, c)
    own = model.state_dict()
    heads = {
        "self_attn.q_proj": c.num_attention_heads,
        "self_attn.k_proj": c.num_key_value_heads or c.num_attention_heads,
    }
    tensors: dict[str, tuple[Any, str]] = {}
    for ours, theirs in llama.key_map(model).items():
        w = own[ours]
        part = next((p for p in heads if f".{p}." in theirs), None)
        if part is not None:
            w = permute_qk(w, heads[part])
        target = gguf_name(theirs)
        assert target is not None, theirs
        tensors[target] = _encode(w, kind, gguf)
    return write_gguf(path, meta, tensors)
