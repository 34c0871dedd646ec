"""Training configs: files, overrides and bad input rejected with the value named."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnlab.train import TrainConfig, load_config, lr_multiplier
from attnlab.train.config import apply_overrides
from attnlab.train.presets import PRESETS, preset


def test_toml_and_json_files_with_overrides(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(
        'steps = 7\nbatch_size = 4\n[model]\nkind = "decoder"\narch = "gpt2"\n'
        'hidden_size = 32\n[optim]\nlr = 1e-3\n[data]\nsource = "synthetic"\n'
    )
    cfg = load_config(toml, ["optim.lr=3e-4", "steps=9", "data.task=induction", "dtype=bfloat16"])
    assert cfg.steps == 9 and cfg.optim.lr == 3e-4 and cfg.data.task == "induction"
    assert cfg.model == {"kind": "decoder", "arch": "gpt2", "hidden_size": 32}
    assert cfg.dtype == "bfloat16"
    js = tmp_path / "run.json"
    cfg.save(js)
    assert load_config(js) == cfg


def test_overrides_parse_toml_literals() -> None:
    out = apply_overrides({}, ["a.b=true", "c=[1, 2]", 'd="x y"', "e=word", "f=1e-3"])
    assert out == {"a": {"b": True}, "c": [1, 2], "d": "x y", "e": "word", "f": 1e-3}


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"stepz": 3}, r"unknown training config keys \['stepz'\]"),
        ({"optim": {"lr": -1}}, r"optim.lr must be > 0, got -1"),
        ({"optim": {"learning_rate": 1}}, r"unknown keys in \[optim\]: \['learning_rate'\]"),
        ({"data": {"source": "web"}}, r"data.source must be one of .*got 'web'"),
        ({"data": {"source": "files"}}, r"needs data.paths"),
        ({"dtype": "float16"}, r"dtype must be one of \['float32', 'bfloat16'\], got 'float16'"),
        ({"batch_size": 6, "micro_batch_size": 4}, r"batch_size \(6\) must be a multiple"),
        ({"model": {"kind": "rnn"}}, r"model.kind must be one of .*got 'rnn'"),
        ({"steps": 0}, r"steps"),
        ({"parallel": {"strategy": "zero3"}}, r"parallel.strategy must be one of"),
    ],
)
def test_bad_values_are_named(data: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_dict(data)


def test_bad_files_and_overrides(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "run.yaml"
    bad.write_text("steps: 3")
    with pytest.raises(ValueError, match=r"expected a .toml or .json file, got '.yaml'"):
        load_config(bad)
    broken = tmp_path / "run.toml"
    broken.write_text("steps = = 3")
    with pytest.raises(ValueError, match="is not valid"):
        load_config(broken)
    with pytest.raises(ValueError, match="--set expects key=value"):
        load_config(None, ["steps"])
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        preset("nope")


def test_presets_are_valid_configs() -> None:
    for name in PRESETS:
        TrainConfig.from_dict(preset(name))


def test_warmup_then_cosine() -> None:
    lr = [lr_multiplier(s, steps=20, warmup=4, min_ratio=0.1) for s in range(21)]
    assert lr[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lr[4] == 1.0 and abs(lr[20] - 0.1) < 1e-12
    assert all(lr[i] >= lr[i + 1] for i in range(4, 20))
    assert abs(lr[12] - 0.55) < 1e-12  # half way down the cosine
