"""The new mixers equal transformers' modules of the same layers, weight for weight:
Qwen3-Next's Gated DeltaNet, RecurrentGemma's recurrent block (RG-LRU) and LFM2's gated
short convolution, at lengths around the chunk size and from a prefix state."""

from __future__ import annotations

import pytest
import torch

from attnlab.cache.linear_state import DeltaNetState, RGLRUState, ShortConvState
from attnlab.modules.delta_net import GatedDeltaNet
from attnlab.modules.rglru import GatedShortConv, RecurrentBlock

pytest.importorskip("transformers")

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _randomise(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _load(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    state = {k: v for k, v in theirs.state_dict().items() if "cache" not in k}
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)


@pytest.mark.parametrize("l", [1, 9, 70])
def test_gated_delta_net_equals_qwen3_next(l: int) -> None:
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    cfg = Qwen3NextConfig(
        hidden_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    theirs = Qwen3NextGatedDeltaNet(cfg, 0).eval()
    _randomise(theirs, l)
    ours = GatedDeltaNet(
        hidden_size=32, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6, chunk_size=64
    ).eval()
    _load(ours, theirs)
    x = torch.randn(2, l, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(x)
        torch.testing.assert_close(ours(x), want, **TOL)
        state = DeltaNetState()  # a prefix, then one token at a time
        n = max(1, l // 2)
        parts = [ours(x[:, :n], state=state)]
        parts += [ours(x[:, t : t + 1], state=state) for t in range(n, l)]
        torch.testing.assert_close(torch.cat(parts, 1), want, **TOL)
    assert state.length == l


@pytest.mark.parametrize("l", [1, 5, 40])
def test_recurrent_block_equals_recurrent_gemma(l: int) -> None:
    from transformers import RecurrentGemmaConfig
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import (
        RecurrentGemmaRecurrentBlock,
    )

    cfg = RecurrentGemmaConfig(
        hidden_size=16, lru_width=24, num_attention_heads=4, conv1d_width=4, num_hidden_layers=1
    )
    theirs = RecurrentGemmaRecurrentBlock(cfg, 0).eval()
    _randomise(theirs, l)
    ours = RecurrentBlock(hidden_size=16, lru_width=24, num_blocks=4, chunk_size=8).eval()
    _load(ours, theirs)
    x = torch.randn(2, l, 16, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(l)[None].expand(2, l)
    with torch.no_grad():
        want, _ = theirs(x, pos, None, use_cache=False)
        torch.testing.assert_close(ours(x, positions=pos), want, **TOL)
        state = RGLRUState()
        n = max(1, l // 2)
        parts = [ours(x[:, :n], state=state, positions=pos[:, :n])]
        parts += [
            ours(x[:, t : t + 1], state=state, positions=pos[:, t : t + 1]) for t in range(n, l)
        ]
        torch.testing.assert_close(torch.cat(parts, 1), want, **TOL)


@pytest.mark.parametrize("l", [1, 2, 11])
def test_gated_short_conv_equals_lfm2(l: int) -> None:
    from transformers import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

    cfg = Lfm2Config(hidden_size=16, conv_L_cache=3, conv_bias=True, num_hidden_layers=1)
    theirs = Lfm2ShortConv(cfg, 0).eval()
    _randomise(theirs, l)
    ours = GatedShortConv(hidden_size=16, conv_kernel=3, bias=True).eval()
    _load(ours, theirs)
    x = torch.randn(2, l, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(x)
        torch.testing.assert_close(ours(x), want, **TOL)
        state = ShortConvState()
        parts = [ours(x[:, t : t + 1], state=state) for t in range(l)]
        torch.testing.assert_close(torch.cat(parts, 1), want, **TOL)
    assert state.length == l and state.conv is not None and state.conv.shape == (2, 2, 16)


def test_module_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="num_v_heads"):
        GatedDeltaNet(hidden_size=8, num_k_heads=3, num_v_heads=4, head_k_dim=2, head_v_dim=2)
    with pytest.raises(ValueError, match="width"):
        RecurrentBlock(hidden_size=8, lru_width=10, num_blocks=4)
    with pytest.raises(ValueError, match="conv_kernel"):
        GatedShortConv(hidden_size=8, conv_kernel=0)
