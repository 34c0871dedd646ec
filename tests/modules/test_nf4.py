"""NF4 (QLoRA's 4-bit NormalFloat): the paper's levels, the stated error, gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnlab.modules.lora import LoRALinear
from attnlab.modules.nf4 import NF4Linear, nf4_dequantize, nf4_levels, nf4_quantize

# the NF4 table as published with the paper (bitsandbytes' `NF4` data type)
PUBLISHED = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]  # fmt: skip


def test_levels_are_the_papers():
    torch.testing.assert_close(nf4_levels(), torch.tensor(PUBLISHED), atol=1e-6, rtol=0)


def test_each_weight_is_its_nearest_level_within_the_stated_bound():
    torch.manual_seed(0)
    w = torch.randn(37, 29)  # 1073 weights: a partial last block, an odd count
    codes, absmax = nf4_quantize(w)
    assert codes.dtype == torch.uint8 and codes.numel() == (w.numel() + 1) // 2
    deq = nf4_dequantize(codes, absmax, tuple(w.shape))
    layer = NF4Linear.from_linear(nn.Linear(29, 37, bias=False))
    layer.codes.copy_(codes)
    layer.absmax.copy_(absmax)
    bound = layer.error_bound(w)
    assert ((w - deq).abs() <= bound + 1e-6).all()
    # nearest level: no other level is closer (float64 recomputation)
    scale = absmax.double().repeat_interleave(64)[: w.numel()].view_as(w)
    cand = torch.tensor(PUBLISHED, dtype=torch.float64)[None, None] * scale[..., None]
    best = (cand - w.double()[..., None]).abs().min(-1).values
    torch.testing.assert_close((deq.double() - w.double()).abs(), best, atol=1e-6, rtol=0)
    # normal weights: the mean error is a small share of the spread
    assert (w - deq).abs().mean() < 0.1 * w.abs().mean()


def test_forward_within_bound_and_gradient_of_the_input():
    torch.manual_seed(0)
    lin = nn.Linear(96, 40)
    q = NF4Linear.from_linear(lin)
    x = torch.randn(3, 5, 96, requires_grad=True)
    y = q(x)
    ref = lin(x)
    limit = x.abs() @ q.error_bound(lin.weight.detach()).T
    assert ((y - ref).abs() <= limit + 1e-4).all()
    y.sum().backward()
    want = torch.ones(3, 5, 40) @ q.dequantize()
    torch.testing.assert_close(x.grad, want)
    assert not any(p.requires_grad for p in q.parameters())
    assert q.codes.numel() + 4 * q.absmax.numel() < 0.15 * 4 * lin.weight.numel()


def test_lora_wraps_nf4_and_merges_by_dequantizing():
    torch.manual_seed(0)
    base = NF4Linear.from_linear(nn.Linear(64, 32))
    m = LoRALinear(base_layer=base, rank=4, alpha=4)
    assert m.lora_A.weight.dtype == torch.float32
    nn.init.normal_(m.lora_B.weight)
    x = torch.randn(2, 64)
    with pytest.raises(TypeError, match="merge_and_unload"):
        m.merge()
    torch.testing.assert_close(m.merged_linear()(x), m(x), atol=1e-5, rtol=1e-5)
    m(x).sum().backward()
    assert m.lora_A.weight.grad is not None and m.lora_B.weight.grad is not None


def test_bad_input():
    with pytest.raises(ValueError, match="2-d float weight"):
        nf4_quantize(torch.zeros(4))
    with pytest.raises(ValueError, match="block_size must be a positive even integer, got 3"):
        nf4_quantize(torch.zeros(4, 4), 3)
