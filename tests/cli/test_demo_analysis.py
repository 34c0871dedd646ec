"""What issue 5 adds to `attnlab demo`: the explorer, the cost table and an index page."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnlab.cli.main import main


def test_demo_adds_explorer_cost_table_and_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--no-compare", "--no-decoder"]) == 0
    text = capsys.readouterr().out
    assert "7. Explore it yourself" in text and "8. What attention costs" in text
    assert "  32768  824,633,720,832" in text  # the tutorial's n²·d, extended to 32768
    assert f"{out / 'index.html'}  (start here)" in text
    page = (out / "index.html").read_text()
    assert 'href="explorer.html"' in page and 'src="layer5_heads.png"' in page
    assert "824,633,720,832" in page  # the cost table, on the index page too
    explorer = (out / "explorer.html").read_text()
    assert '"tokens":["[CLS]","time","flies","like","an","arrow","[SEP]"]' in explorer


def test_demo_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert main(["demo", "--out", str(tmp_path), "--no-compare", "--no-decoder", "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["tokens"][:2] == ["[CLS]", "time"]
    assert data["index"].endswith("index.html") and "824,633,720,832" in data["cost_table"]
    assert "1. Tokens" in data["walkthrough"]
    assert "[4/4] done" in captured.err
