"""``attnlab train``: a tiny end-to-end run whose folder ``attnlab generate`` loads, resume
from the command line, and bad input answered with one line and exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import attnlab
from attnlab.cli.main import main


def test_tiny_preset_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    args = ["train", "--preset", "tiny", "--out", str(out), "--set", "progress=false"]
    assert main([*args, "--until", "2"]) == 0
    assert main([*args, "--resume", "latest"]) == 0
    printed = capsys.readouterr().out
    assert "steps 4;" in printed and "held-out bits per byte" in printed
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "loss" in r] == [1, 2, 3, 4]
    assert (out / "loss_curve.png").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]
    # the saved folder is a transformers folder with a byte tokenizer: generate loads it
    model = attnlab.from_hf(out / "model")
    assert model.config.vocab_size == 256
    assert (
        main(
            ["generate", "--model", str(out / "model"), "--prompt", "def ", "--max-new-tokens", "4"]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("def ")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train"], "pass a training config file"),
        (["train", "--preset", "nope"], "unknown preset 'nope'"),
        (["train", "--preset", "tiny", "--set", "optim.lr=-1"], "optim.lr must be > 0"),
        (["train", "--preset", "tiny", "--set", "steps"], "--set expects key=value"),
        (["train", "missing.toml"], "does not exist"),
        (["train", "--preset", "tiny", "--set", "model.kind=rnn"], "model.kind must be one of"),
    ],
)
def test_bad_input_is_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_list_presets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--list-presets"]) == 0
    names = capsys.readouterr().out.split()
    assert {"stdlib-bytes", "copy", "induction", "tiny"} <= set(names)
