"""The cost model on layouts that mix windows across layers (Gemma 2/3, ModernBERT).

A mixed layout is costed group by group; these tests check it against the uniform
estimates it is made of (work and KV cache add up by layer), a brute-force count of the
two-sided window, the per-group backend choice, and the memory against a dense mask.
"""

from __future__ import annotations

import pytest

from attnlab.analysis.arch import describe
from attnlab.analysis.cost import estimate
from attnlab.analysis.cost_layers import LayerShape, tile_pairs
from attnlab.models.config import EncoderConfig
from attnlab.models.decoder_config import DecoderConfig

LAYER_PARTS = ("projections", "attention_scores", "softmax", "attention_v", "feed_forward")


def _gemma2(window: int = 1024) -> DecoderConfig:
    return DecoderConfig.gemma2(
        window=window,
        num_hidden_layers=8,
        hidden_size=512,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1024,
        vocab_size=1000,
    )


def _modernbert() -> EncoderConfig:
    return EncoderConfig(
        num_hidden_layers=6,
        hidden_size=384,
        num_attention_heads=6,
        intermediate_size=576,
        position_embedding_type="rope",
        mlp="gated",
        local_attention=(None, 128, 128, None, 128, 128),
    )


def test_describe_keeps_each_layers_window() -> None:
    spec = describe(_gemma2())
    assert spec.layer_windows == (1024, None) * 4 and spec.window is None
    assert spec.window_groups == [(1024, 4), (None, 4)]
    enc = describe(_modernbert())
    assert enc.layer_windows == (None, 128, 128, None, 128, 128) and not enc.causal
    assert enc.position == "rope" and not enc.learned_positions
    with pytest.raises(ValueError, match="layer_windows"):
        spec.with_(layer_windows=(1024, None))  # one per layer
    with pytest.raises(ValueError, match="do not combine"):
        spec.with_(window=512)


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_mixed_work_is_the_sum_of_its_groups(mode: str) -> None:
    spec = describe(_gemma2())
    mixed = estimate(spec, seq_len=8192, mode=mode, backend="tiled")
    local = estimate(
        spec.with_(layer_windows=None, window=1024), seq_len=8192, mode=mode, backend="tiled"
    )
    glob = estimate(spec.with_(layer_windows=None), seq_len=8192, mode=mode, backend="tiled")
    for part in LAYER_PARTS:
        want = (local.by_component[part].flops + glob.by_component[part].flops) / 2
        assert mixed.by_component[part].flops == pytest.approx(want, rel=1e-12), part
    assert mixed.parameter_count == glob.parameter_count
    assert local.flops < mixed.flops < glob.flops
    assert mixed.attention_density == pytest.approx(
        (local.attention_density + glob.attention_density) / 2
    )
    assert "4 local layers (window 1024)" in " ".join(mixed.notes)


def test_decode_keeps_a_rolling_cache_on_local_layers_only() -> None:
    spec = describe(_gemma2())
    rep = estimate(spec, seq_len=8192, mode="decode", backend="tiled")
    per_slot = 2 * spec.kv_dim * 4  # K and V, float32, per layer
    # 4 local layers: the last 1024 keys and the new one; 4 global ones: all 8193
    assert rep.kv_cache_bytes == 4 * per_slot * (1024 + 1) + 4 * per_slot * 8193
    with pytest.raises(ValueError, match="needs a window"):
        estimate(spec.with_(layer_windows=None), seq_len=64, mode="decode", cache="sliding")


def test_auto_chooses_per_group() -> None:
    rep = estimate(describe(_gemma2()), seq_len=8192)
    assert set(rep.layer_backends) == {"local layers (window 1024)", "global layers"}
    assert rep.backend == "+".join(dict.fromkeys(rep.layer_backends.values()))


def test_two_sided_window_density_counts_every_pair() -> None:
    enc = describe(_modernbert())
    n = 300
    rep = estimate(enc.with_(layer_windows=(128,) * 6), seq_len=n, backend="reference")
    pairs = sum(1 for i in range(n) for j in range(n) if abs(i - j) <= 64)
    assert rep.attention_density == pytest.approx(pairs / n**2, rel=1e-12)
    # a tiled kernel computes whole 64 x 64 tiles around the band: for 1024 tokens and
    # 64 keys on each side, 3 key tiles per query tile (2 at the ends), not all 16
    sh = LayerShape(b=1, lq=1024, s=1024, density=0.0, window=128, two_sided=True)
    assert tile_pairs(sh, 64, 64) == (16 * 3 - 2) * 64 * 64


def test_mixed_layout_memory_at_8192_is_below_the_dense_mask() -> None:
    # the dense-mask figure: every layer's scores materialised over all 8192 x 8192 pairs
    for spec in (describe(_gemma2()), describe(_modernbert())):
        rep = estimate(spec, seq_len=8192)
        dense = estimate(spec, seq_len=8192, backend="reference")
        assert rep.activation_bytes < dense.activation_bytes / 4, spec.name
        assert rep.activation_variants["materialised"] == dense.activation_bytes


def test_uniform_layer_windows_are_one_group() -> None:
    spec = describe(_gemma2()).with_(layer_windows=None)
    one = estimate(spec.with_(window=32), seq_len=256, mode="training", backend="tiled")
    same = estimate(
        spec.with_(layer_windows=(32,) * 8), seq_len=256, mode="training", backend="tiled"
    )
    assert not one.layer_backends and not same.layer_backends
    assert same.flops == one.flops and same.activation_bytes == one.activation_bytes


def test_advise_costs_a_local_global_layout_as_it_is() -> None:
    from attnlab.analysis.advisor import advise
    from attnlab.analysis.arch import preset

    advice = advise("generation", seq_len=8192, memory_gb=24, base=preset("gemma-2-2b"))
    recs = {r.topic: r for r in advice.recommendations}
    assert "local/global layers (13 of 26 local)" in recs["attention"].choice
    assert recs["window"].choice == "4096 on local layers"
    assert advice.arch.layer_windows is not None


def test_every_decoder_family_is_estimated() -> None:
    size = dict(
        num_hidden_layers=6,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=100,
    )
    gemma3 = describe(DecoderConfig.gemma3(window=32, **size))
    assert gemma3.window_groups == [(32, 5), (None, 1)]
    for make in (
        DecoderConfig.qwen2,
        DecoderConfig.qwen3,
        DecoderConfig.qwen3_moe,
        DecoderConfig.gemma2,
        DecoderConfig.gemma3,
        DecoderConfig.phi3,
        DecoderConfig.smollm3,
    ):
        rep = estimate(make(**size), seq_len=256, mode="decode", backend="tiled")
        per_slot = 2 * rep.arch.kv_dim * 4
        want = sum(
            count * per_slot * (257 if w is None else min(256, w) + 1)
            for w, count in rep.arch.window_groups
        )
        assert rep.kv_cache_bytes == want, make.__name__
