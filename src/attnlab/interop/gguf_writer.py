"""attnlab models -> GGUF files (:func:`to_gguf`), written with the ``gguf`` package's writer.

The layout follows llama.cpp's converter (``convert_hf_to_gguf.py``): llama.cpp's tensor
names, q/k rows permuted for its RoPE kernel, one-dimensional tensors (norms) in F32,
matrices in the requested type (F32, F16, or Q8_0/Q4_0/Q4_1 blocks quantized by
``gguf.quants``), no ``output.weight`` when the embeddings are tied. A quantized model's
layers (:mod:`attnlab.modules.quant_linear`) are written from their levels without going
through float: ``int8:g32`` as Q8_0, ``int4:g32`` as Q4_1 (Q4_0 when its minimums are
``-8 * scale``, as a layer read from a Q4_0 file has them). Files are written
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
GGUF_DTYPES = {
    "f32": ("F32", 0),
    "f16": ("F16", 1),
    "q8_0": ("Q8_0", 7),
    "q4_0": ("Q4_0", 2),
    "q4_1": ("Q4_1", 3),
}
_FILE_TYPES = {kind: file_type for kind, file_type in GGUF_DTYPES.values()}


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


def layer_block_type(layer: nn.Module) -> str | None:
    """The GGUF block type holding a quantized layer exactly (scales aside), or None.

    ``int8:g32`` is Q8_0; ``int4:g32`` is Q4_1, or Q4_0 when every minimum is ``-8 *
    scale``. Other layouts (per-channel int8, int4 in groups of 64/128) have no GGUF type
    of the same arithmetic.
    """
    from attnlab.modules.quant_linear import Int4Linear, Int8Linear

    if isinstance(layer, Int8Linear) and layer.group_size == 32:
        return "Q8_0"
    if isinstance(layer, Int4Linear) and layer.group_size == 32:
        return "Q4_0" if torch.equal(layer.mins, -8.0 * layer.scales) else "Q4_1"
    return None


def _encode_layer(layer: Any, kind: str | None, name: str, heads: int | None) -> tuple[Any, str]:
    """A quantized layer's weight in ``kind`` (None: as stored), its rows in llama.cpp's
    q/k order when ``heads`` is given."""
    from attnlab.functional.gguf_blocks import join_blocks
    from attnlab.functional.quant import unpack_nibbles
    from attnlab.modules.quant_linear import Int4Linear

    own = layer_block_type(layer)
    if kind in ("F32", "F16"):
        w = layer.dequantize(torch.float32)
        w = permute_qk(w, heads) if heads is not None else w
        a = w.contiguous().numpy()
        return (a if kind == "F32" else a.astype("float16")), kind
    # a Q4_0 layer is also a Q4_1 one (minimum -8 d); nothing else converts without rounding
    exact = own is not None and (kind in (None, own) or (kind, own) == ("Q4_1", "Q4_0"))
    target = own if kind is None else kind
    if not exact or target is None:
        spec = f"{layer.kind}:g{layer.group_size}"
        raise ValueError(
            f"{name} is a {spec} layer"
            + (f" (GGUF {own})" if own else " (no GGUF block type holds it exactly)")
            + f"; writing it as {kind or 'stored'} would round it again: pass "
            + ("dtype=None to write it as stored, or " if own else "")
            + "dtype='f32' or 'f16' (its values dequantized)"
        )
    n = layer.out_features
    mins: Tensor | None = None
    if isinstance(layer, Int4Linear):
        q = unpack_nibbles(layer.qweight).to(torch.int16)  # [N, K] in 0..15
        mins = layer.mins
        if target == "Q4_0":
            q, mins = q - 8, None
    else:
        q = layer.qweight
    scales = layer.scales
    if heads is not None:  # llama.cpp's rotary row order, on the levels and their scales
        q, scales = permute_qk(q, heads), permute_qk(scales, heads)
        mins = None if mins is None else permute_qk(mins, heads)
    m = None if mins is None else mins.reshape(-1)
    raw = join_blocks(target, q.reshape(-1, 32), scales.reshape(-1), m)
    return raw.reshape(n, -1).numpy(), target


def to_gguf(
    model: nn.Module,
    path: str | Path,
    *,
    dtype: str | None = None,
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
        dtype: ``"f32"``, ``"f16"``, ``"q8_0"``, ``"q4_0"`` or ``"q4_1"`` for the
            matrices; norms stay F32. ``None`` (default): a quantized model's layers as
            stored (:func:`layer_block_type`; float matrices in F32), a float model in F32.
        name: ``general.name`` (default: the file's stem).
        tokenizer: a transformers fast tokenizer (byte-level BPE) to store; default
            ``model.tokenizer`` when set. Without one the file holds no vocabulary.

    Returns:
        The path written.

    Raises:
        ValueError: a model that is not a Llama-architecture decoder (what differs), an
            unknown ``dtype``, or a quantized layer ``dtype`` would round again.
    """
    from attnlab.interop import llama
    from attnlab.models.decoder import DecoderLM
    from attnlab.models.decoder_config import DecoderConfig

    if dtype is not None and dtype not in GGUF_DTYPES:
        raise ValueError(f"dtype must be None or one of {sorted(GGUF_DTYPES)}, got {dtype!r}")
    if not isinstance(model, DecoderLM) or not isinstance(model.config, DecoderConfig):
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
    weights = _weights(model)
    kind = None if dtype is None else GGUF_DTYPES[dtype][0]
    cfg = llama._hf_kwargs(c)
    meta = gguf_metadata_from_config(cfg)
    meta["general.name"] = name or Path(path).stem
    tok = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if tok is not None:
        from attnlab.interop.gguf_vocab import tokenizer_metadata

        meta |= tokenizer_metadata(tok, c)
    heads = {
        "self_attn.q_proj": c.num_attention_heads,
        "self_attn.k_proj": c.num_key_value_heads or c.num_attention_heads,
    }
    tensors: dict[str, tuple[Any, str]] = {}
    for ours, theirs in llama.key_map(model, present=weights).items():
        w = weights[ours]
        part = next((p for p in heads if f".{p}." in theirs), None)
        target = gguf_name(theirs)
        assert target is not None, theirs
        if isinstance(w, Tensor):
            w = permute_qk(w, heads[part]) if part is not None else w
            tensors[target] = _encode(w, kind or "F32", gguf)
        else:
            tensors[target] = _encode_layer(w, kind, ours, heads[part] if part else None)
    written = [k for _, k in tensors.values() if k != "F32"]
    main = kind or (max(set(written), key=written.count) if written else "F32")
    meta["general.file_type"] = _FILE_TYPES[main]
    if main not in ("F32", "F16"):
        meta["general.quantization_version"] = 2
    return write_gguf(path, meta, tensors)


def _weights(model: nn.Module) -> dict[str, Any]:
    """Every weight by state-dict name: float tensors, and quantized layers (their
    ``.weight`` name) as the layer itself."""
    from attnlab.modules.quant_linear import QuantEmbedding, QuantLinear

    out: dict[str, Any] = dict(model.state_dict())
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            out[f"{name}.weight"] = mod
        elif isinstance(mod, QuantEmbedding):
            out[f"{name}.weight"] = mod.table
    return out
