"""llama.cpp's GGUF names and settings <-> transformers' names and config, per architecture.

A GGUF file carries no ``config.json``: the metadata is the config, under llama.cpp's key
names (``llama.embedding_length``...). This module turns it into the transformers config
dict and transformers weight names, so a GGUF file goes through the same converter
(``attnlab.interop.llama``) as a safetensors folder, and back for writing.

llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) reorders the
rows of ``q_proj`` and ``k_proj`` in each head from rotate-half pairs ``(i, i + d/2)``
to interleaved pairs ``(2i, 2i + 1)``, for its RoPE kernel: :func:`unpermute_qk` undoes
it, :func:`permute_qk` does it. Both reorder whole rows, so they apply to float
weights and to a quantized tensor's rows of blocks alike.
"""

from __future__ import annotations

import re
from typing import Any

from torch import Tensor

__all__ = [
    "SUPPORTED",
    "config_from_gguf",
    "gguf_metadata_from_config",
    "gguf_name",
    "hf_name",
    "permute_qk",
    "unpermute_qk",
]

#: GGUF architectures attnlab maps (``general.architecture``).
SUPPORTED = ("llama",)

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_GLOBAL_BACK = {v: k for k, v in _GLOBAL.items()}
_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.([\w.]+)\.(weight|bias)")


def hf_name(name: str) -> str | None:
    """transformers' name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``), or None."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _BLK.fullmatch(name)
    if m is None or m.group(2) not in _LAYER:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"


def gguf_name(name: str) -> str | None:
    """The GGUF name of a transformers Llama weight, or None (the inverse of :func:`hf_name`)."""
    if name in _GLOBAL_BACK:
        return _GLOBAL_BACK[name]
    m = _HF_LAYER.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_BACK:
        return None
    return f"blk.{m.group(1)}.{_LAYER_BACK[m.group(2)]}.{m.group(3)}"


def _head_rows(w: Tensor, n_heads: int, *, to_interleaved: bool) -> Tensor:
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of rotary pairs")
    half = rows // n_heads // 2
    if to_interleaved:  # rows of a head: [a0..a_{h-1}, b0..b_{h-1}] -> [a0, b0, a1, b1, ...]
        return w.reshape(n_heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_qk(w: Tensor, n_heads: int) -> Tensor:
    """llama.cpp's q/k row order -> transformers' (``n_heads``: key/value heads for ``k``)."""
    return _head_rows(w, n_heads, to_interleaved=False)


def permute_qk(w: Tensor, n_heads: int) -> Tensor:
    """transformers' q/k row order -> llama.cpp's (the inverse of :func:`unpermute_qk`)."""
    return _head_rows(w, n_heads, to_interleaved=True)


def _need(meta: dict[str, Any], key: str, path: str) -> Any:
    if key not in meta:
        raise KeyError(key)
    return meta[key]


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str], path: str) -> dict[str, Any]:
    """A transformers ``LlamaConfig`` dict from a GGUF file's metadata.

    Raises:
        ValueError: an architecture attnlab does not map (named), or settings it cannot
            honour (partial rotary dimensions, RoPE scaling other than linear).
        KeyError: a metadata key the config needs is missing (the key).
    """
    arch = str(meta.get("general.architecture"))
    if arch not in SUPPORTED:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; attnlab maps {list(SUPPORTED)}"
        )
    a = arch + "."
    hidden = int(_need(meta, a + "embedding_length", path))
    heads = int(_need(meta, a + "attention.head_count", path))
    head_dim = int(meta.get(a + "attention.key_length", hidden // heads))
    rot = int(meta.get(a + "rope.dimension_count", head_dim))
    if rot != head_dim:
        raise ValueError(
            f"{path}: rope.dimension_count {rot} != head dim {head_dim} (partial RoPE)"
        )
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(meta.get(a + "rope.freq_base", 10000.0)),
    }
    scaling = meta.get(a + "rope.scaling.type", "none")
    if scaling == "linear":
        rope |= {"rope_type": "linear", "factor": float(meta[a + "rope.scaling.factor"])}
    elif scaling != "none":
        raise ValueError(
            f"{path}: RoPE scaling {scaling!r} is not supported; attnlab reads 'linear'"
        )
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            f"{path}: per-frequency RoPE factors (rope_freqs.weight) are not supported"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(a + "vocab_size", len(tokens) if isinstance(tokens, list) else None)
    if vocab is None:
        raise KeyError(a + "vocab_size")
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "num_hidden_layers": int(_need(meta, a + "block_count", path)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(a + "attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "intermediate_size": int(_need(meta, a + "feed_forward_length", path)),
        "rms_norm_eps": float(meta.get(a + "attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(meta.get(a + "context_length", 2048)),
        "rope_parameters": rope,
        # llama.cpp writes the output projection only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }


def gguf_metadata_from_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``llama.*`` metadata of a transformers Llama config dict (for writing)."""
    a = "llama."
    rope = cfg.get("rope_parameters") or {}
    meta: dict[str, Any] = {
        "general.architecture": "llama",
        a + "vocab_size": cfg["vocab_size"],
        a + "context_length": cfg["max_position_embeddings"],
        a + "embedding_length": cfg["hidden_size"],
        a + "block_count": cfg["num_hidden_layers"],
        a + "feed_forward_length": cfg["intermediate_size"],
        a + "attention.head_count": cfg["num_attention_heads"],
        a + "attention.head_count_kv": cfg["num_key_value_heads"],
        a + "attention.key_length": cfg["head_dim"],
        a + "attention.value_length": cfg["head_dim"],
        a + "rope.dimension_count": cfg["head_dim"],
        a + "rope.freq_base": float(rope.get("rope_theta", 10000.0)),
        a + "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
    }
    if rope.get("rope_type", "default") == "linear":
        meta[a + "rope.scaling.type"] = "linear"
        meta[a + "rope.scaling.factor"] = float(rope["factor"])
    elif rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"GGUF export supports default and linear RoPE, got {rope.get('rope_type')!r}"
        )
    return meta
