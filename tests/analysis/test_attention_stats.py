from __future__ import annotations

import math

import pytest
import torch

from attnlab.analysis.attention_stats import diagonal_share, entropy, summarize_heads


def test_entropy_of_one_hot_and_uniform() -> None:
    w = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    torch.testing.assert_close(entropy(w), torch.tensor([0.0, math.log(4)]))


def test_summary_and_diagonal() -> None:
    w = torch.eye(3).expand(2, 3, 3).clone()
    w[1] = torch.tensor([[1.0, 0, 0], [1.0, 0, 0], [0.5, 0.5, 0]])
    heads = summarize_heads(w, ["x", "y", "z"], layer=4)
    assert heads[0].targets == ["x", "y", "z"] and heads[0].mean_entropy == 0.0
    assert heads[1].targets[:2] == ["x", "x"] and heads[1].layer == 4
    assert diagonal_share(torch.eye(3)) == 1.0
    with pytest.raises(ValueError, match="heads, 2, 2"):
        summarize_heads(w, ["x", "y"])


def test_distance_sink_and_head_statistics() -> None:
    from attnlab.analysis.attention_stats import (
        attention_distance,
        attention_head_stats,
        first_token_share,
    )

    prev = torch.zeros(4, 4)
    prev[0, 0] = 1.0
    prev[torch.arange(1, 4), torch.arange(0, 3)] = 1.0  # each token looks one back
    torch.testing.assert_close(attention_distance(prev), torch.tensor([0.0, 1.0, 1.0, 1.0]))
    torch.testing.assert_close(first_token_share(prev), torch.tensor([1.0, 1.0, 0.0, 0.0]))
    # one query over four cached keys: aligned to the last key
    torch.testing.assert_close(
        attention_distance(torch.tensor([[1.0, 0, 0, 0]])), torch.tensor([3.0])
    )
    w = torch.stack([prev, torch.zeros(4, 4)])  # head 1: every row fully masked
    s0, s1 = attention_head_stats(w, layer=2, module="layers.2.attention")
    assert (s0.layer, s0.head, s0.module) == (2, 0, "layers.2.attention")
    assert s0.mean_distance == 0.75 and s0.first_token_share == 0.5 and s0.entropy == 0.0
    assert s1.fully_masked_rows == 4 and s1.row_sum_error == 0.0
