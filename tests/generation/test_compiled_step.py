"""The compiled decode step is the model's own forward: no graph break, same tokens."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

from attnlab.generation import generate
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig

TINY: dict[str, Any] = dict(
    vocab_size=40,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    max_position_embeddings=32,
)
MODELS = {
    "llama": lambda: DecoderConfig.llama(**TINY),
    "mistral": lambda: DecoderConfig.mistral(**TINY, sliding_window=4),
    "gpt2": lambda: DecoderConfig.gpt2(**(TINY | {"num_key_value_heads": 4})),
    "bloom": lambda: DecoderConfig.bloom(**(TINY | {"num_key_value_heads": 4})),
}


def _prompt() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 40, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("padded", [False, True])
def test_decode_step_has_no_graph_break(name: str, padded: bool) -> None:
    torch.manual_seed(0)
    model = DecoderLM(MODELS[name]()).eval()
    ids, mask = _prompt()
    cache = model.new_cache(kind="static", max_length=12, batch_size=2)
    full = torch.ones(2, 12, dtype=torch.long)
    full[:, :6] = mask
    with torch.no_grad():
        model(ids, attention_mask=mask if padded else None, past_key_values=cache)
        pos = ((mask.cumsum(-1) - 1)[:, -1:] + 1) if padded else None
        start = torch.tensor(6)
        am = full if padded else None
        backend = model.decode_backend(ids[:, -1:], cache=cache, start=start, attention_mask=am)
        explained = torch._dynamo.explain(model.decode_step)(
            ids[:, -1:],
            cache=cache,
            start=start,
            position_ids=pos,
            attention_mask=am,
            backend=backend,
        )
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_compile_refuses_what_it_cannot_compile() -> None:
    model = DecoderLM(MODELS["llama"]()).eval()
    ids, _ = _prompt()
    with pytest.raises(ValueError, match="compile=True needs static caches"):
        generate(model, ids, 2, compile=True, cache=model.new_cache(max_length=8))
    dyn = DecoderLM(
        DecoderConfig.llama(**TINY, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    ).eval()
    with pytest.raises(ValueError, match="dynamic NTK"):
        generate(dyn, ids, 2, compile=True)


def test_too_many_compiled_graphs_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """dynamo's recompile limit is shared by every model's decode step: attnlab raises its
    own limit, and reaching that one is a RuntimeError that says what to do."""
    gen = importlib.import_module("attnlab.generation.generate")  # the module, not the function
    monkeypatch.setattr(gen, "COMPILED_STEP_GRAPHS", 1)
    torch.manual_seed(0)
    model = DecoderLM(MODELS["llama"]()).eval()
    ids, _ = _prompt()
    with pytest.raises(RuntimeError, match="compile=False"):  # a second batch size: graph 2
        for rows in (2, 1):
            generate(model, ids[:rows], 2, compile=True)
