from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnlab.viz.heatmap import heads_grid_figure, heatmap_figure, save_png


def test_heatmaps_are_written(tmp_path: Path) -> None:
    w = torch.softmax(torch.randn(3, 4, 4), -1)
    tokens = ["a", "b", "c", "d"]
    p1 = save_png(heatmap_figure(w[0], tokens, title="t"), tmp_path / "one.png")
    p2 = save_png(heads_grid_figure(w, tokens, cols=2), tmp_path / "sub" / "grid.png")
    for p in (p1, p2):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_heatmap_shape_errors() -> None:
    with pytest.raises(ValueError, match=r"\[2, 2\].*\(3, 3\)"):
        heatmap_figure(torch.rand(3, 3), ["a", "b"])
    with pytest.raises(ValueError, match="heads, L, L"):
        heads_grid_figure(torch.rand(3, 3), ["a", "b", "c"])
