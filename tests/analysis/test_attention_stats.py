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
