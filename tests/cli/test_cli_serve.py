"""``attnlab serve``: user errors are one line on stderr, never a traceback: exit 2 for a
malformed argument, 1 for a folder that holds no model (as for every command)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from attnlab.cli.main import main


def test_serve_rejects_a_folder_without_a_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as s:  # a free port: serve binds it before loading the model
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["serve", str(tmp_path), "--port", str(port)]) == 1  # ModelFileError
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("loading ") and len(lines) == 2  # what it loads, then one error
    assert lines[1].startswith("attnlab serve: error:") and "no config.json" in lines[1]


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


def test_serve_embeddings_needs_a_sentence_transformers_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", str(tmp_path), "--embeddings", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("attnlab serve: error: --embeddings") and "modules.json" in err[-1]


def test_serve_refuses_a_sink_cache_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # refused before the model loads or the port is bound: the paged engine cannot honour it
    assert main(["serve", str(tmp_path), "--sink-window", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert "--sink-window" in err and "paged engine cannot honour" in err
    assert "attnlab generate --sink-window" in err


@pytest.mark.parametrize("value", ["x", "0-", "99999", ""])
def test_serve_rejects_a_bad_engine_cpu_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    assert main(["serve", str(tmp_path), "--engine-cpus", value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--engine-cpus" in err and "Traceback" not in err


def test_auto_engine_cpus_leaves_a_cpu_to_http() -> None:
    import os

    from attnlab.cli.serve import auto_engine_cpus, cpu_list

    have = sorted(os.sched_getaffinity(0))
    assert auto_engine_cpus(len(have)) is None  # nothing would be left: no pinning
    if len(have) > 1:
        assert auto_engine_cpus(1) == have[:1]
    assert cpu_list("none") is None and cpu_list("auto") == "auto"
    assert cpu_list(f"{have[0]}") == [have[0]]


def test_serve_refuses_engine_cpus_without_the_engine_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # checked with the other flags: one line, before "loading ..." (tmp_path holds no model)
    assert main(["serve", str(tmp_path), "--engine-cpus", "0", "--no-engine-process"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and not err.startswith("loading") and "Traceback" not in err
    assert "--engine-cpus 0 needs --engine-process" in err
