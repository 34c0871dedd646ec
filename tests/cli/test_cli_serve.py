"""``attnlab serve``: user errors are one line on stderr, never a traceback: exit 2 for a
malformed argument, 1 for a folder that holds no model (as for every command)."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnlab.cli.main import main


def test_serve_rejects_a_folder_without_a_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no config.json" in err


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--port", "-1"),
        ("--port", "0"),
        ("--port", "65536"),
        ("--port", "http"),
        ("--threads", "0"),
    ],
)
def test_serve_rejects_a_bad_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    assert main(["serve", str(tmp_path), flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and flag in err and value in err
    if flag == "--port" and value != "http":
        assert "[1, 65535]" in err
