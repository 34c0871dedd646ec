"""The long-text view: pooling with a known answer, and a real decoder's sink column."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from attnlab.viz.long_text import long_text_html, pool_attention


def _causal(h: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(h, n, n, generator=g)
    scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    return scores.softmax(-1)


def test_pooling_with_one_bin_per_token_is_the_identity() -> None:
    w = _causal(2, 10, 0)
    pooled, queries, keys = pool_attention(w, sinks=3, columns=7, rows=10)
    torch.testing.assert_close(pooled, w)
    assert queries == [(i, i + 1) for i in range(10)] and keys == queries


def test_pooling_keeps_the_sinks_and_the_row_sums() -> None:
    w = _causal(3, 50, 1)[None]  # [1, H, L, L] as a model returns it
    pooled, queries, keys = pool_attention(w, sinks=4, columns=5, rows=5)
    assert pooled.shape == (3, 5, 9)
    assert keys[:4] == [(0, 1), (1, 2), (2, 3), (3, 4)] and keys[-1] == (40, 50)
    assert queries == [(0, 10), (10, 20), (20, 30), (30, 40), (40, 50)]
    torch.testing.assert_close(pooled.sum(-1), torch.ones(3, 5))
    # a sink column is the mean over the bin's queries of the weight on that token
    torch.testing.assert_close(pooled[:, 2, 1], w[0, :, 20:30, 1].mean(-1))
    with pytest.raises(ValueError, match=r"\[H, L, L\]"):
        pool_attention(torch.ones(2, 3, 4))
    with pytest.raises(ValueError, match="columns"):
        pool_attention(w, columns=0)


def test_long_text_page_labels_sinks_and_spans() -> None:
    n = 30
    page = long_text_html([_causal(2, n, 2), _causal(2, n, 3)], [f"t{i}" for i in range(n)],
                          sinks=2, columns=4, rows=3)  # fmt: skip
    data = json.loads(re.search(r'type="application/json">(.*?)</script>', page, re.S)[1])
    assert data["keys"] == ["0:t0", "1:t1", "2-8", "9-15", "16-22", "23-29"]
    assert data["tokens"] == ["0-9", "10-19", "20-29"]
    assert len(data["weights"]) == 2
    with pytest.raises(ValueError, match="30 tokens"):
        long_text_html([_causal(1, n, 4)], ["x"] * 29)


def test_visualize_long_text_shows_smollm2s_sink_column(
    smollm2: torch.nn.Module,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from attnlab.cli.main import main
    from attnlab.experiments import _real

    monkeypatch.setattr(_real, "load_smollm2", lambda: smollm2)
    out = tmp_path / "long"
    assert main(["visualize", "--long-text", "256", "--out", str(out), "--json"]) == 0
    files = json.loads(capsys.readouterr().out)["files"]
    assert {Path(f).name for f in files} == {"index.html", "long_text.html", "sinks.png"}
    page = (out / "long_text.html").read_text()
    data = json.loads(re.search(r'type="application/json">(.*?)</script>', page, re.S)[1])
    w = torch.tensor(data["weights"])  # [layers, H, rows, columns]
    # past the first layers, the first token's column outweighs any whole bin of others
    late = w[4:, :, 1:]  # [layers, H, rows, columns], queries after the first bin
    assert float(late[..., 0].mean()) > float(late[..., 4:].mean(dim=(0, 1, 2)).max())
    assert main(["visualize", "--long-text", "1", "--out", str(out)]) == 2
