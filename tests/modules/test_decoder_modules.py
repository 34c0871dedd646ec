"""Decoder building blocks: position components in the attention module, norms, gated MLP."""

from __future__ import annotations

import pytest
import torch

from attnlab.cache import DynamicKVCache
from attnlab.functional.attention import sdpa_reference
from attnlab.functional.masks import causal
from attnlab.functional.positions import alibi_slopes
from attnlab.functional.score_mods import alibi
from attnlab.modules.attention import MultiHeadAttention
from attnlab.modules.mlp import GatedFeedForward
from attnlab.modules.norms import RMSNorm
from attnlab.modules.positions import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEmbedding,
    T5RelativePositionBias,
)


def _heads(x: torch.Tensor, h: int) -> torch.Tensor:
    b, s, _ = x.shape
    return x.view(b, s, h, -1).transpose(1, 2)  # [b, h, s, h_d]


def test_rotary_component_equals_manual_rotation() -> None:
    torch.manual_seed(0)
    rope = RotaryEmbedding(dim=8)
    mha = MultiHeadAttention(embed_dim=16, num_heads=2, rotary=rope, bias=False)
    x = torch.randn(2, 5, 16)
    pos = torch.arange(5)
    out, _ = mha(x, is_causal=True, positions=pos)
    q = rope(_heads(mha.q_proj(x), 2), pos)
    k = rope(_heads(mha.k_proj(x), 2), pos)
    ref, _ = sdpa_reference(q, k, _heads(mha.v_proj(x), 2), is_causal=True)
    torch.testing.assert_close(out, mha.out_proj(ref.transpose(1, 2).reshape(2, 5, 16)))


@pytest.mark.parametrize("backend", ["auto", "tiled", "reference"])
def test_alibi_score_modifier_on_the_pattern_is_added_to_the_scores(backend: str) -> None:
    torch.manual_seed(0)
    mha = MultiHeadAttention(embed_dim=16, num_heads=4, scale=1.0, backend=backend)
    x = torch.randn(1, 6, 16)
    _, w = mha(x, attn_mask=causal().with_scores(alibi(4)), need_weights=True)
    q, k = _heads(mha.q_proj(x), 4), _heads(mha.k_proj(x), 4)
    i = torch.arange(6)
    bias = -alibi_slopes(4).view(4, 1, 1) * (i[:, None] - i[None, :])
    scores = (q @ k.transpose(-1, -2) + bias).masked_fill(~torch.ones(6, 6).bool().tril(), -1e9)
    torch.testing.assert_close(w, scores.softmax(-1))


def test_attention_with_a_cache_equals_attention_over_the_whole_sequence() -> None:
    torch.manual_seed(0)
    mha = MultiHeadAttention(
        embed_dim=16, num_heads=4, num_kv_heads=2, rotary=RotaryEmbedding(dim=4)
    ).eval()
    x = torch.randn(2, 7, 16)
    full, _ = mha(x, is_causal=True)
    cache = DynamicKVCache()
    first, _ = mha(x[:, :4], is_causal=True, cache=cache, cache_start=0)
    steps = [first] + [mha(x[:, t : t + 1], cache=cache, cache_start=t)[0] for t in range(4, 7)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-6, rtol=1e-5)


def test_t5_bias_module_gives_a_score_modifier_over_its_table() -> None:
    bias = T5RelativePositionBias(num_heads=3, num_buckets=8, max_distance=16, bidirectional=True)
    mod = bias.score_mod()
    assert mod.table is bias.relative_attention_bias.weight  # by reference: trains
    h = torch.arange(3).view(-1, 1, 1)
    q, k = torch.arange(4).view(1, 1, -1, 1), torch.arange(6).view(1, 1, 1, -1)
    out = mod(torch.zeros(1, 3, 4, 6), torch.zeros((), dtype=torch.long), h, q, k)
    assert out.shape == (1, 3, 4, 6)
    # equal relative positions share a value
    torch.testing.assert_close(out[0, :, 0, 1], out[0, :, 2, 3])


def test_rmsnorm_matches_its_formula_and_norms_in_float32() -> None:
    norm = RMSNorm(6, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 6)
    ref = norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), ref)
    assert norm(x.bfloat16()).dtype == torch.float32  # weight (fp32) * bf16 -> promotes
    assert norm.to(torch.bfloat16)(x.bfloat16()).dtype == torch.bfloat16


def test_swiglu_is_down_of_silu_gate_times_up() -> None:
    ff = GatedFeedForward(embed_dim=8, hidden_dim=12)
    x = torch.randn(2, 3, 8)
    ref = ff.down_proj(torch.nn.functional.silu(ff.gate_proj(x)) * ff.up_proj(x))
    torch.testing.assert_close(ff(x), ref)


def test_absolute_position_modules() -> None:
    sin = SinusoidalPositionalEmbedding(num_positions=10, embed_dim=4)
    assert sin(torch.tensor([[0, 3]])).shape == (1, 2, 4)
    learned = LearnedPositionalEmbedding(num_positions=10, embed_dim=4)
    with pytest.raises(ValueError, match=r"\[0, 10\).*\[0, 10\]"):
        learned(torch.tensor([[0, 10]]))


def test_rotary_rejects_unknown_scaling_and_keeps_float32_frequencies() -> None:
    with pytest.raises(ValueError, match="unknown RoPE scaling type 'su'"):
        RotaryEmbedding(dim=8, scaling={"rope_type": "su", "factor": 2.0})
    rope = RotaryEmbedding(dim=8).to(torch.bfloat16)
    assert rope.inv_freq.dtype == torch.float32
