"""The sink cache (StreamingLLM): what it keeps, where its positions are, and generate with it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attnlab.cache import SinkKVCache
from attnlab.generation import generate
from attnlab.generation.streaming import sink_cache
from attnlab.models import DecoderConfig, DecoderLM

TINY: dict[str, Any] = dict(
    vocab_size=50,
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    max_position_embeddings=256,
)


def _model(**overrides: Any) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(DecoderConfig.llama(**(TINY | overrides))).eval()


def _stream_logits(model: DecoderLM, ids: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    cache = sink_cache(model, window=window, sinks=sinks)
    out = []
    with torch.no_grad():
        for t in range(ids.shape[1]):
            out.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    return torch.cat(out, dim=1)  # [B, T, V]


def test_nothing_evicted_equals_the_full_forward() -> None:
    model = _model(num_hidden_layers=2)
    ids = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
    torch.testing.assert_close(_stream_logits(model, ids, window=40, sinks=4), full)


@pytest.mark.parametrize("sinks", [0, 4])
def test_positions_within_the_cache_as_the_paper(sinks: int) -> None:
    # One layer: keys/values depend on the token and its position only, so the stream's
    # logit at t equals a fresh forward over [sinks, newest window] at positions 0..n-1.
    model = _model()
    window = 6
    ids = torch.randint(0, 50, (1, 30), generator=torch.Generator().manual_seed(3))
    stream = _stream_logits(model, ids, window=window, sinks=sinks)
    with torch.no_grad():
        for t in range(sinks + window, 30):
            kept = torch.cat((ids[:, :sinks], ids[:, t - window + 1 : t + 1]), dim=1)
            ref = model(kept).logits[:, -1]
            torch.testing.assert_close(stream[:, t], ref, atol=1e-5, rtol=1e-5)


def test_memory_is_fixed_and_sinks_are_the_first_tokens() -> None:
    model = _model()
    cache = sink_cache(model, window=5, sinks=3)
    ids = torch.randint(0, 50, (1, 40), generator=torch.Generator().manual_seed(4))
    sizes = []
    with torch.no_grad():
        for t in range(40):
            model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            sizes.append(cache.nbytes())
    layer = cache.layers[0]
    assert isinstance(layer, SinkKVCache)
    assert layer.evicted == 40 - 3 - 4 and layer.length == 40
    assert len(set(sizes[10:])) == 1  # 3 sinks + 4 recent, whatever the length


def test_generate_with_a_sink_cache_matches_token_by_token() -> None:
    model = _model(num_hidden_layers=2)
    prompt = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(5))
    out = generate(model, prompt, 16, cache=sink_cache(model, window=6, sinks=2))
    # the same stream fed token by token, greedy
    cache = sink_cache(model, window=6, sinks=2)
    seq = prompt
    with torch.no_grad():
        logits = None
        for t in range(12):
            logits = model(prompt[:, t : t + 1], past_key_values=cache, use_cache=True).logits
        for _ in range(16):
            assert logits is not None
            tok = logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat((seq, tok), dim=1)
            logits = model(tok, past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(out, seq)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="window"):
        SinkKVCache(window=0)
    with pytest.raises(ValueError, match="sinks"):
        SinkKVCache(window=4, sinks=True)
    with pytest.raises(ValueError, match="dynamic"):
        sink_cache(_model(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), window=4)
    with pytest.raises(ValueError, match="sliding-window"):
        sink_cache(DecoderLM(DecoderConfig.mistral(**TINY, sliding_window=4)), window=4)
    model = _model()
    cache = sink_cache(model, window=4, sinks=1)
    with pytest.raises(ValueError, match="at most 5 new tokens"):
        model(torch.zeros(1, 9, dtype=torch.long), past_key_values=cache, use_cache=True)


def test_recurrent_models_keep_their_state_and_pure_ones_are_refused() -> None:
    from attnlab.models.layout import LayerSpec
    from attnlab.models.recurrent import MambaLM
    from attnlab.models.recurrent_config import MambaConfig

    mamba = MambaLM(MambaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1))
    with pytest.raises(ValueError, match="no attention layers"):
        sink_cache(mamba, window=4)
    torch.manual_seed(0)
    hybrid = DecoderLM(
        DecoderConfig.llama(
            **(TINY | {"num_hidden_layers": 2}),
            layers=(LayerSpec(mixer="mamba"), LayerSpec()),
        )
    ).eval()
    cache = sink_cache(hybrid, window=6, sinks=2)
    assert not isinstance(cache.layers[0], SinkKVCache)
    assert isinstance(cache.layers[1], SinkKVCache)
    ids = torch.randint(0, 50, (1, 5))
    assert torch.equal(generate(hybrid, ids, 4, cache=cache), generate(hybrid, ids, 4))
