"""Attention maps for chosen heads and rows equal slices of the reference's weights."""

from __future__ import annotations

import pytest
import torch

from attnlab.backends import attention_weights
from attnlab.functional import masks as M
from attnlab.functional import sdpa_reference
from attnlab.functional.score_mods import alibi


@pytest.mark.parametrize(
    "mask",
    [None, M.sliding_window(3), M.document([0, 0, 0, 1, 1, 1, 1, 2, 2, 2]).with_scores(alibi(4))],
)
def test_chosen_heads_and_rows(mask: M.MaskPattern | None) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 10, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 10, 8, generator=g, dtype=torch.float64)
    heads, rows = [3, 0], [9, 2, 5]
    w = attention_weights(q, k, mask, is_causal=True, enable_gqa=True, heads=heads, rows=rows)
    dense = mask.to_dense(10, 10) if mask is not None else None
    mods = mask.score_mods if mask is not None else ()
    _, ref = sdpa_reference(
        q, k, k, dense, is_causal=True, enable_gqa=True, return_weights=True, score_mods=mods
    )
    assert ref is not None
    torch.testing.assert_close(w, ref[:, heads][:, :, rows])


def test_out_of_range_rows_name_the_range() -> None:
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 5\)"):
        attention_weights(q, q, rows=[7])
