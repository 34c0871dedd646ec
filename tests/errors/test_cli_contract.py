"""Class D of issue 22: the contracts the docs state hold for every subcommand, those added
later included (the checks read :data:`SUBCOMMANDS` and the parsers, not a fixed list).

* every subcommand has ``--json``, and every option has help text;
* a missing model folder exits 1 with one line, whatever the command;
* with ``--json`` a failure still prints one JSON document on stdout;
* a non-zero status always comes with a line on stderr saying why.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from attnlab.cli.main import SUBCOMMANDS, build_parser, main


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_subcommand_has_json_and_every_option_has_help() -> None:
    parsers = _subparsers()
    assert set(SUBCOMMANDS) <= set(parsers)
    for name in SUBCOMMANDS:
        p = parsers[name]
        flags = {s for a in p._actions for s in a.option_strings}
        assert "--json" in flags, f"attnlab {name} has no --json"
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            assert a.help and a.help != argparse.SUPPRESS, (
                f"attnlab {name} {a.option_strings or a.dest}: no help"
            )


# the argument that names a model folder, per subcommand (None: the command takes none)
MODEL_ARGS = {"model", "model_dir", "teacher", "model_path", "input"}


def _model_argument(p: argparse.ArgumentParser) -> argparse.Action | None:
    return next((a for a in p._actions if a.dest in MODEL_ARGS), None)


# the rest of a minimal command line for the commands that take a model folder
REST: dict[str, list[str]] = {
    "generate": ["--prompt", "hi"],
    "diagnose": [],
    "visualize": ["--out", "{tmp}/viz"],
    "embed": ["{tmp}/notes.txt"],
    "serve": [],
    "distill": ["--out", "{tmp}/student"],
    "chat": ["--prompt", "hi"],
    "perplexity": ["{tmp}/notes.txt"],
    "convert": ["{tmp}/out.gguf"],
    "finetune": ["{tmp}/notes.txt", "--out", "{tmp}/ft"],
}


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_a_missing_model_folder_exits_1_for_every_command(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arg = _model_argument(_subparsers()[name])
    if arg is None:
        pytest.skip(f"attnlab {name} takes no model folder")
    assert name in REST, f"add attnlab {name} to REST: it takes a model folder ({arg.dest})"
    (tmp_path / "notes.txt").write_text("one line\n")
    missing = str(tmp_path / "no-such-model")
    rest = [a.format(tmp=tmp_path) for a in REST[name]]
    if arg.option_strings:  # --model PATH after the rest
        argv = [name, *rest, arg.option_strings[-1], missing]
    else:  # a positional model comes first
        argv = [name, missing, *rest]
    assert main(argv) == 1, argv
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith(f"attnlab {name}: error: "), err
    assert "no-such-model does not exist" in err[-1], err


def test_with_json_a_failure_is_one_json_document(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", "--model", str(tmp_path / "none"), "--prompt", "x", "--json"]) == 1
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert doc["status"] == 1 and "does not exist" in doc["error"] and doc["command"] == "generate"
    assert "attnlab generate: error:" in out.err


def test_advice_that_does_not_fit_says_so_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["advise", "--task", "generation", "--seq-len", "100000000", "--memory-gb", "1"]
    assert main(argv) == 1
    out = capsys.readouterr()
    assert "none fits" in out.out
    assert out.err.strip().startswith("attnlab advise: error: no setting fits"), out.err


def test_sampling_flags_without_sample_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--random", "gpt2", "--ids", "1", "--top-k", "3"]) == 2
    assert "--top-k apply to sampling only: add --sample" in capsys.readouterr().err


def test_a_random_model_is_said_to_be_untrained(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--random", "gpt2", "--ids", "1", "--max-new-tokens", "1"]) == 0
    assert "untrained model with random weights" in capsys.readouterr().err


def test_train_lists_presets_with_descriptions_and_prints_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from attnlab.train.presets import PRESETS

    assert main(["train", "--list-presets", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert set(listed) == set(PRESETS) and all(listed.values())
    argv = ["train", "--preset", "copy", "--set", "steps=2", "--set", "progress=false"]
    argv += ["--set", "export=false", "--set", "eval_every=0", "--out", str(tmp_path), "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["steps"] == 2 and result["out_dir"] == str(tmp_path)
