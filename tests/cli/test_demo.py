"""The README's main job, `attnlab demo`, end to end on the real model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from attnlab.cli.main import main


def test_demo_writes_heatmaps_and_reports_parity(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    smollm2: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import attnlab

    monkeypatch.setattr(attnlab, "from_gguf", lambda *a, **k: smollm2)  # the session's copy
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "7 tokens" in text and "'time', 'flies', 'like', 'an', 'arrow'" in text
    assert "22,713,216 parameters" in text
    diffs = [
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("max |difference|")
    ]
    assert len(diffs) == 3 and max(diffs) <= 1e-5
    names = sorted(p.name for p in out.glob("*.png"))
    assert names == sorted(
        [
            "simple_attention.png",
            "last_layer_mean.png",
            "similarity.png",
            *[f"layer{i}_heads.png" for i in range(6)],
            "decoder_layers.png",
            "decoder_sinks.png",
        ]
    )
    # the decoder section: two answers from SmolLM2, and its attention sinks
    assert "6. A real decoder: SmolLM2-135M-Instruct" in text
    assert "A: The capital of France is Paris." in text
    assert (out / "decoder_explorer.html").stat().st_size > 10000
    assert "decoder_sinks.png" in (out / "index.html").read_text()
    assert all(p.stat().st_size > 5000 for p in out.glob("*.png"))
    assert "5. Sentence embeddings" in text
    st_diff = [line for line in text.splitlines() if line.startswith("sentence-transformers on")]
    assert len(st_diff) == 1 and float(st_diff[0].split()[-1]) <= 1e-5


def test_demo_other_text_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "demo",
                "--text",
                "attention is all you need",
                "--out",
                str(tmp_path),
                "--no-compare",
                "--no-decoder",
            ]
        )
        == 0
    )
    assert "'attention', 'is', 'all', 'you', 'need'" in capsys.readouterr().out
    args = ["demo", "--text", "word " * 600, "--out", str(tmp_path), "--no-compare", "--no-decoder"]
    assert main(args) == 2
    assert "at most 512" in capsys.readouterr().err


def test_help_lists_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out
