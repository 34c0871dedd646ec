"""``attnlab embed``: .npy and JSON-lines output, --query/--top, and user errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.cli.main import main

pytest.importorskip("tokenizers")

LINES = [
    "The cat sat on the mat.",
    "",
    "Packing puts many sentences in one row.",
    "A kitten rested on the rug.",
]


def _no_constant(name: str) -> None:
    raise ValueError(f"not strict JSON: {name}")


@pytest.fixture
def notes(tmp_path: Path) -> Path:
    path = tmp_path / "notes.txt"
    path.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    return path


def test_npy_rows_equal_the_library(notes: Path, tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    out = tmp_path / "vectors.npy"
    assert main(["embed", str(notes), "--out", str(out)]) == 0
    got = torch.from_numpy(np.load(out))
    want = attnlab.embed(LINES)
    assert got.shape == (4, 384)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_jsonl_on_stdout(notes: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["embed", str(notes), "--explain"]) == 0
    captured = capsys.readouterr()
    rows = [  # strict JSON lines: NaN / Infinity would raise
        json.loads(line, parse_constant=_no_constant) for line in captured.out.splitlines()
    ]
    assert [r["line"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["text"] == LINES[2] and len(rows[2]["embedding"]) == 384
    assert "pooling: mean, normalised" in captured.err


def test_query_ranks_lines(notes: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["embed", str(notes), "--query", "a cat on a rug", "--top", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2
    assert {line.split(None, 2)[1] for line in out} == {"1", "4"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["embed", "missing.txt"], "does not exist"),
        (["embed", "NOTES", "--out", "x.csv"], "cannot tell the format"),
        (["embed", "NOTES", "--format", "npy"], "needs --out"),
        (["embed", "NOTES", "--query", "q", "--top", "0"], "--top: must be a positive int"),
        (["embed", "NOTES", "--batch-size", "-1"], "--batch-size: must be a positive int"),
    ],
)
def test_user_errors_exit_2(
    notes: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(notes) if a == "NOTES" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_missing_model_folder_exits_1_as_for_every_command(
    notes: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["embed", str(notes), "--model", "no-such-dir"]) == 1
    assert "no-such-dir does not exist" in capsys.readouterr().err
