"""Plots of head statistics and of cost against length."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnlab.analysis.attention_stats import attention_head_stats
from attnlab.analysis.expert_stats import expert_load
from attnlab.analysis.scaling import scaling_table
from attnlab.viz.experts import expert_load_figure
from attnlab.viz.heatmap import save_png
from attnlab.viz.plots import cost_vs_length_figure, head_stat_figure


def test_head_stat_and_cost_figures(tmp_path: Path) -> None:
    stats = []
    for layer in range(3):
        stats += attention_head_stats(torch.rand(4, 6, 6).softmax(-1), layer=layer)
    for stat in ("entropy", "mean_distance", "first_token_share"):
        fig = head_stat_figure(stats, stat)
        assert len(fig.axes[0].texts) == 12  # every cell annotated
        assert save_png(fig, tmp_path / f"{stat}.png").stat().st_size > 5000
    rows = scaling_table(seq_lens=[128, 1024, 8192])
    fig = cost_vs_length_figure(rows, title="cost")
    assert fig.axes[0].get_xscale() == "log" and len(fig.axes[0].lines) == 7
    with pytest.raises(ValueError, match="unknown statistic 'bogus'"):
        head_stat_figure(stats, "bogus")
    with pytest.raises(ValueError, match="no rows"):
        cost_vs_length_figure([])


def test_scaling_rows_follow_the_formulas() -> None:
    rows = {(r.variant, r.seq_len): r for r in scaling_table(seq_lens=[1024, 4096])}
    dense, gqa, sliding = rows["dense", 4096], rows["gqa", 4096], rows["sliding", 4096]
    assert dense.attention_flops_per_layer == 4 * 4096**2 * 768
    assert gqa.attention_flops_per_layer == dense.attention_flops_per_layer
    assert dense.kv_cache_bytes == 3 * gqa.kv_cache_bytes
    # the tiled backend computes whole 256 x 256 tiles: query block i meets key blocks
    # i-2 .. i of a 512-key window (1 and 2 blocks for the first two query blocks)
    assert sliding.attention_flops_per_layer == 4 * 12 * 64 * 256 * (256 + 512 + 14 * 768)
    assert sliding.kv_cache_bytes == rows["sliding", 1024].kv_cache_bytes  # capped by the window
    assert dense.score_matrix_bytes == 12 * 4096**2 * 4


def test_expert_load_figure(tmp_path: Path) -> None:
    loads = [
        expert_load(torch.randn(20, 4, generator=torch.Generator().manual_seed(i)), 2, layer=i)
        for i in range(3)
    ]
    loads.append(expert_load(torch.zeros(20, 4), 2, layer=3))
    assert loads[-1].collapsed
    fig = expert_load_figure(loads)
    fig.savefig(tmp_path / "load.png")
    assert (tmp_path / "load.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="no expert loads"):
        expert_load_figure([])
