"""``attnlab serve``: user errors are one line on stderr with exit 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnlab.cli.main import main


def test_serve_rejects_a_folder_without_a_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no config.json" in err


def test_serve_rejects_a_bad_port(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", str(tmp_path), "--port", "-1"]) == 2
    assert "--port must be positive, got -1" in capsys.readouterr().err
