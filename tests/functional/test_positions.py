"""Positional encodings: the formulas and properties the papers state, and transformers' values."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.functional.masks import padding, sliding_window
from attnlab.functional.positions import (
    alibi_slopes,
    apply_rope,
    positions_from_mask,
    rope_angles,
    rope_inv_freq,
    sinusoidal_table,
    t5_relative_position_bucket,
)


def test_sinusoidal_matches_the_formula() -> None:
    # Vaswani et al. 2017, sec. 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...)
    d = 16
    table = sinusoidal_table(50, d)
    for pos in (0, 1, 7, 49):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_sinusoidal_rejects_odd_dim() -> None:
    with pytest.raises(ValueError, match="even"):
        sinusoidal_table(4, 5)


def _rope(x: torch.Tensor, pos: torch.Tensor, convention: str) -> torch.Tensor:
    inv = rope_inv_freq(x.shape[-1])[0]
    cos, sin = rope_angles(pos[None], inv)
    return apply_rope(x, cos, sin, convention=convention)  # type: ignore[arg-type]


@settings(max_examples=15, deadline=None)
@given(
    m=st.integers(0, 500),
    n=st.integers(0, 500),
    shift=st.integers(-200, 200),
    convention=st.sampled_from(["half", "interleaved"]),
)
def test_rope_scores_depend_only_on_relative_position(
    m: int, n: int, shift: int, convention: str
) -> None:
    # Su et al. 2021: <R(m) q, R(n) k> is a function of n - m.
    g = torch.Generator().manual_seed(m * 1000 + n)
    q = torch.randn(1, 1, 1, 32, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 1, 32, generator=g, dtype=torch.float64)
    if min(m, n) + shift < 0:
        shift = -min(m, n)

    def score(a: int, b: int) -> float:
        qa = _rope(q, torch.tensor([a]), convention)
        kb = _rope(k, torch.tensor([b]), convention)
        return float((qa * kb).sum())

    assert score(m, n) == pytest.approx(score(m + shift, n + shift), rel=1e-4, abs=1e-4)


def test_rope_preserves_norm_and_position_zero_is_identity() -> None:
    x = torch.randn(2, 3, 5, 8)
    pos = torch.arange(5)
    for convention in ("half", "interleaved"):
        y = _rope(x, pos, convention)
        torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
        torch.testing.assert_close(y[:, :, 0], x[:, :, 0])


def test_rope_conventions_are_a_permutation_of_each_other() -> None:
    x = torch.randn(1, 2, 6, 8)
    pos = torch.arange(6)
    perm = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # interleaved pairs -> halves
    half = _rope(x[..., perm], pos, "half")
    inter = _rope(x, pos, "interleaved")
    torch.testing.assert_close(inter[..., perm], half)


def test_rope_matches_transformers_rotate_half() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = torch.randn(2, 4, 7, 16), torch.randn(2, 2, 7, 16)
    pos = torch.arange(3, 10)[None].expand(2, -1)
    inv = rope_inv_freq(16)[0]
    cos, sin = rope_angles(pos, inv)
    emb_cos, emb_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    hq, hk = apply_rotary_pos_emb(q, k, emb_cos, emb_sin)
    torch.testing.assert_close(apply_rope(q, cos, sin), hq)
    torch.testing.assert_close(apply_rope(k, cos, sin), hk)


ROPE_CASES = [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16, "beta_slow": 2, "mscale": 1.0,
     "mscale_all_dim": 0.5, "original_max_position_embeddings": 32},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
]  # fmt: skip


@pytest.mark.parametrize("params", ROPE_CASES, ids=lambda p: p["rope_type"])
@pytest.mark.parametrize("seq_len", [None, 200])
def test_rope_scaling_matches_transformers(params: dict, seq_len: int | None) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        max_position_embeddings=128,
        rope_parameters={**params, "rope_theta": 10000.0},
    )
    rope_type = params["rope_type"]
    if rope_type == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        ref = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        ref = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", seq_len=seq_len)
    ours = rope_inv_freq(
        64,
        base=10000.0,
        scaling=None if rope_type == "default" else params,
        max_position_embeddings=128,
        seq_len=seq_len,
    )
    torch.testing.assert_close(ours[0], ref[0].float(), rtol=1e-6, atol=0)
    assert ours[1] == pytest.approx(ref[1])


def test_unknown_rope_type_is_named() -> None:
    with pytest.raises(ValueError, match="'longshot'"):
        rope_inv_freq(8, scaling={"rope_type": "longshot", "factor": 2.0})
    with pytest.raises(ValueError, match="factor"):
        rope_inv_freq(8, scaling={"rope_type": "linear"})


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32])
def test_alibi_slopes_power_of_two_are_the_papers_geometric_sequence(n: int) -> None:
    # Press et al. 2022, sec. 3: 2^(-8/n), 2^(-16/n), ..., 2^(-8)
    expected = torch.tensor([2 ** (-8 * (i + 1) / n) for i in range(n)])
    torch.testing.assert_close(alibi_slopes(n), expected)


@pytest.mark.parametrize("n", [3, 5, 6, 7, 12, 20, 24])
def test_alibi_slopes_other_head_counts(n: int) -> None:
    m = 2 ** math.floor(math.log2(n))
    base = [2 ** (-8 * (i + 1) / m) for i in range(m)]
    extra = [2 ** (-8 * (i + 1) / (2 * m)) for i in range(0, 2 * m, 2)][: n - m]
    torch.testing.assert_close(alibi_slopes(n), torch.tensor(base + extra))
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    ref = build_alibi_tensor(torch.ones(1, 2), n, torch.float32).view(n, 2)[:, 1]  # slope * 1
    torch.testing.assert_close(alibi_slopes(n), ref)


def test_t5_buckets_match_transformers() -> None:
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = torch.arange(-300, 301)[None]
    for bidirectional in (True, False):
        for nb, md in ((32, 128), (8, 20)):
            ref = T5Attention._relative_position_bucket(
                rel, bidirectional=bidirectional, num_buckets=nb, max_distance=md
            )
            ours = t5_relative_position_bucket(
                rel, bidirectional=bidirectional, num_buckets=nb, max_distance=md
            )
            assert torch.equal(ours, ref)


def test_t5_buckets_small_distances_are_exact() -> None:
    rel = torch.arange(-7, 8)
    b = t5_relative_position_bucket(rel, bidirectional=True, num_buckets=32, max_distance=128)
    assert b[7:].tolist() == [0] + [16 + d for d in range(1, 8)]
    assert b[:7].tolist() == list(range(7, 0, -1))


def test_positions_from_left_padded_mask() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert positions_from_mask(mask).tolist() == [[1, 1, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_the_decoders_pattern_on_slots_is_bottom_right_with_window_and_padding() -> None:
    """What ``slot_mask`` built densely, the pattern evaluates on the call's slots."""
    q = torch.tensor([[3, 4]])
    k = torch.tensor([[-1, 0, 1, 2, 3, 4]])
    mask = torch.tensor([[0, 1, 1, 1, 1]])
    got = (sliding_window(2) & padding(mask)).evaluate(q, k)[0, 0]
    assert got.tolist() == [
        [False, False, True, True, True, False],
        [False, False, False, True, True, True],
    ]
