"""``attnlab backends``: the list and ``--explain``."""

from __future__ import annotations

import pytest

from attnlab.cli.main import main


def test_lists_backends(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "tiled" in out and "approximate" in out


def test_explain_long_window(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--explain", "--seq-len", "16384", "--mask", "window:512"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("backend: ")
    assert "sdpa: cannot skip the empty blocks" in out
    assert "flex: not compiled for this shape yet, first call costs ~15 s" in out


def test_bad_mask_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--explain", "--mask", "window:x"]) == 2
    assert "--mask must be" in capsys.readouterr().err
