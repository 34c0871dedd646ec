"""attnlab estimate / advise / diagnose / visualize from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab.cli.main import SUBCOMMANDS, main

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.mark.parametrize("name", ["estimate", "advise", "diagnose", "visualize"])
def test_every_subcommand_explains_itself(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert name in SUBCOMMANDS
    assert main([name, "--help"]) == 0
    text = capsys.readouterr().out
    assert "--json" in text and len(text) > 600


def test_estimate_prints_the_tutorial_table_extended(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate"]) == 0
    text = capsys.readouterr().out
    for variant in ("dense", "sliding", "gqa"):
        assert f"\n{variant}\n" in text
    # the tutorial's own figures, n²·d for hidden 768, from 128 to 2048 ... and on to 32768
    for n in (128, 512, 1024, 2048, 32768):
        assert f"{n * n * 768:,}" in text
    assert "50.33 MFLOP" in text  # 4·n²·d at 128 = 4 x the tutorial's 12,582,912


def test_estimate_json_one_shape_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "estimate",
                "--preset",
                "llama-3-8b",
                "--seq-len",
                "8192",
                "--mode",
                "decode",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    # 2 x 32 layers x 8 kv heads x 128 x 8193 tokens x 4 bytes
    assert data["kv_cache_bytes"] == 2 * 32 * 8 * 128 * 8193 * 4
    assert data["parameter_count"] == 8_030_261_248
    assert main(["estimate", "--max-len", "1024", "--json", "--plot", str(tmp_path / "c.png")]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3 * 4 and (tmp_path / "c.png").stat().st_size > 20_000
    assert main(["estimate", "--preset", "nope"]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err


def test_estimate_imports_no_torch() -> None:
    code = "import sys; from attnlab.cli.main import main; main(['estimate']); assert 'torch' not in sys.modules"
    env = dict(os.environ, PYTHONPATH=str(SRC))
    subprocess.run(
        [sys.executable, "-c", code], check=True, env=env, capture_output=True, timeout=60
    )


def test_advise(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["advise", "--task", "long-document", "--seq-len", "8192", "--memory-gb", "4"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "attention" in text and "why:" in text and "GiB" in text
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {r["topic"] for r in data["recommendations"]} >= {"attention", "dtype", "checkpointing"}
    assert main(["advise", "--task", "generation", "--seq-len", "-3", "--memory-gb", "4"]) == 2


def test_diagnose_finds_an_injected_fault(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagnose", "--inject", "nan-weights", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["first_nonfinite_module"] == "layers.1.feed_forward.fc_in"
    assert (
        main(
            [
                "diagnose",
                "--text",
                "time flies",
                "--text",
                "an arrow",
                "--inject",
                "blank-mask",
                "--heads",
            ]
        )
        == 1
    )
    captured = capsys.readouterr()
    assert "attention_mask[1]" in captured.out and "first-token" in captured.out
    assert "[3/3] done" in captured.err  # progress on stderr


def test_visualize_writes_a_folder_with_an_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "vis"
    assert main(["visualize", "--text", "the cat sat on the mat", "--out", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    index = Path(data["index"])
    page = index.read_text()
    assert 'href="explorer.html"' in page and 'src="entropy.png"' in page
    for f in data["files"]:
        assert Path(f).exists()
    names = {p.name for p in out.iterdir()}
    assert {"explorer.html", "entropy.png", "mean_distance.png", "first_token_share.png"} <= names


def test_estimate_from_config_files(
    tmp_path: Path, minilm_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from attnlab.models.decoder_config import DecoderConfig

    # a transformers model folder: the real MiniLM, its pooler found in the weights
    assert main(["estimate", "--config", str(minilm_path), "--seq-len", "128", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameter_count"] == 22_713_216
    cfg = DecoderConfig.mistral(
        sliding_window=16,
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
    )
    (tmp_path / "mistral.json").write_text(json.dumps(cfg.to_dict()))
    args = [
        "estimate",
        "--config",
        str(tmp_path / "mistral.json"),
        "--seq-len",
        "100",
        "--mode",
        "decode",
        "--json",
    ]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["arch"]["window"] == 16
    assert data["kv_cache_bytes"] == 2 * 2 * 2 * 16 * (16 + 1) * 4  # sliding cache, by default
    (tmp_path / "bad.json").write_text('{"hidden_size": "x"}')
    assert main(["estimate", "--config", str(tmp_path / "bad.json"), "--seq-len", "8"]) == 2
    assert "is not a config attnlab reads" in capsys.readouterr().err


def test_advise_from_a_model_folder(minilm_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["advise", "--task", "classification", "--seq-len", "256", "--memory-gb", "1"]
    assert main([*args, "--config", str(minilm_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["arch"]["hidden_size"] == 384 and data["estimate"]["parameter_count"] == 22_713_216
    assert main([*args, "--config", str(minilm_path), "--preset", "gpt2"]) == 2
