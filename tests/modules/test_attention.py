"""MultiHeadAttention: independent references, layouts and GQA/MQA invariants."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlab.modules import MultiHeadAttention


class TutorialAttentionHead(nn.Module):
    """The tutorial's per-head layout: one q/k/v Linear per head (with its softmax bug-free)."""

    def __init__(self, embed_dim: int, head_dim: int) -> None:
        super().__init__()
        self.q = nn.Linear(embed_dim, head_dim)
        self.k = nn.Linear(embed_dim, head_dim)
        self.v = nn.Linear(embed_dim, head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        w = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(k.shape[-1]), dim=-1)
        return w @ v


class TutorialMultiHead(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        self.heads = nn.ModuleList(
            TutorialAttentionHead(embed_dim, embed_dim // num_heads) for _ in range(num_heads)
        )
        self.output_linear = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_linear(torch.cat([h(x) for h in self.heads], dim=-1))


def test_matches_torch_multihead_attention_via_packed_layout() -> None:
    ref = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    ours = MultiHeadAttention(embed_dim=32, num_heads=4).eval()
    ours.load_layout(ref.state_dict(), layout="packed")
    x = torch.randn(2, 7, 32)
    pad = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    want, want_w = ref(x, x, x, key_padding_mask=pad == 0, average_attn_weights=False)
    got, got_w = ours(x, attention_mask=pad, need_weights=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)


def test_cross_attention_with_other_lengths_and_widths_matches_torch() -> None:
    ref = nn.MultiheadAttention(16, 2, kdim=24, vdim=24, batch_first=True).eval()
    ours = MultiHeadAttention(embed_dim=16, num_heads=2, kv_embed_dim=24).eval()
    sd = ref.state_dict()
    ours.load_state_dict(
        {
            "q_proj.weight": sd["q_proj_weight"],
            "k_proj.weight": sd["k_proj_weight"],
            "v_proj.weight": sd["v_proj_weight"],
            "q_proj.bias": sd["in_proj_bias"][:16],
            "k_proj.bias": sd["in_proj_bias"][16:32],
            "v_proj.bias": sd["in_proj_bias"][32:],
            "out_proj.weight": sd["out_proj.weight"],
            "out_proj.bias": sd["out_proj.bias"],
        }
    )
    x, ctx = torch.randn(3, 5, 16), torch.randn(3, 11, 24)
    want, _ = ref(x, ctx, ctx)
    got, w = ours(x, context=ctx, need_weights=True)
    assert got.shape == (3, 5, 16) and w is not None and w.shape == (3, 2, 5, 11)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_per_head_layout_equals_fused_layout() -> None:
    tut = TutorialMultiHead(24, 3).eval()
    ours = MultiHeadAttention(embed_dim=24, num_heads=3).eval()
    ours.load_layout(tut.state_dict(), layout="per_head")
    x = torch.randn(2, 6, 24)
    torch.testing.assert_close(ours(x)[0], tut(x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_gqa_equals_mha_with_repeated_key_value_heads(num_kv_heads: int) -> None:
    gqa = MultiHeadAttention(embed_dim=32, num_heads=8, num_kv_heads=num_kv_heads).eval()
    mha = MultiHeadAttention(embed_dim=32, num_heads=8).eval()
    rep, hd = 8 // num_kv_heads, 4
    sd = dict(gqa.state_dict())
    for name in ("k_proj", "v_proj"):
        w = sd[f"{name}.weight"].view(num_kv_heads, hd, 32).repeat_interleave(rep, 0)
        b = sd[f"{name}.bias"].view(num_kv_heads, hd).repeat_interleave(rep, 0)
        sd[f"{name}.weight"], sd[f"{name}.bias"] = w.reshape(32, 32), b.reshape(32)
    mha.load_state_dict(sd)
    x = torch.randn(2, 9, 32)
    out, w = gqa(x, need_weights=True)
    assert out.shape == (2, 9, 32) and w is not None and w.shape == (2, 8, 9, 9)
    torch.testing.assert_close(out, mha(x)[0], atol=1e-6, rtol=1e-5)
    assert gqa.k_proj.weight.shape == (num_kv_heads * hd, 32)


def test_gqa_with_all_kv_heads_is_mha() -> None:
    a = MultiHeadAttention(embed_dim=16, num_heads=4, num_kv_heads=4).eval()
    b = MultiHeadAttention(embed_dim=16, num_heads=4).eval()
    b.load_state_dict(a.state_dict())
    x = torch.randn(1, 5, 16)
    torch.testing.assert_close(a(x)[0], b(x)[0])


def test_causal_self_attention_ignores_the_future() -> None:
    m = MultiHeadAttention(embed_dim=16, num_heads=2).eval()
    x = torch.randn(1, 6, 16)
    y = x.clone()
    y[:, 4:] = torch.randn(1, 2, 16)
    a, _ = m(x, is_causal=True)
    b, _ = m(y, is_causal=True)
    torch.testing.assert_close(a[:, :4], b[:, :4])


def test_key_padding_matches_dropping_the_padding() -> None:
    m = MultiHeadAttention(embed_dim=16, num_heads=4, num_kv_heads=2).eval()
    x = torch.randn(1, 7, 16)
    pad = torch.tensor([[1, 1, 1, 1, 0, 0, 0]])
    full, _ = m(x, attention_mask=pad)
    short, _ = m(x[:, :4])
    torch.testing.assert_close(full[:, :4], short, atol=1e-6, rtol=1e-5)


def test_dropout_only_in_training() -> None:
    m = MultiHeadAttention(embed_dim=16, num_heads=2, dropout=0.5)
    x = torch.randn(1, 5, 16)
    m.eval()
    torch.testing.assert_close(m(x)[0], m(x)[0])
    m.train()
    assert not torch.allclose(m(x)[0], m.eval()(x)[0])


def test_backend_choice_does_not_change_the_result() -> None:
    ref = MultiHeadAttention(embed_dim=16, num_heads=2, backend="reference").eval()
    fast = MultiHeadAttention(embed_dim=16, num_heads=2, backend="sdpa").eval()
    fast.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(ref(x)[0], fast(x)[0], atol=1e-6, rtol=1e-5)
    # issue 4: sdpa returns weights too, recomputed from a log-sum-exp
    torch.testing.assert_close(
        ref(x, need_weights=True)[1], fast(x, need_weights=True)[1], atol=1e-6, rtol=1e-5
    )


def test_scaled_dot_product_reference_inside_the_module() -> None:
    m = MultiHeadAttention(embed_dim=8, num_heads=1, bias=False).eval()
    x = torch.randn(1, 3, 8)
    q, k, v = m.q_proj(x), m.k_proj(x), m.v_proj(x)
    want = m.out_proj(F.softmax(q @ k.transpose(1, 2) / math.sqrt(8), -1) @ v)
    torch.testing.assert_close(m(x)[0], want, atol=1e-6, rtol=1e-5)
