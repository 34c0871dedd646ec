"""Class C of issue 22: nothing the user gave is lost, and non-finite training stops.

Each fault is injected: a SIGKILL in the middle of writing a checkpoint (a subprocess
whose writer kills itself half-way), truncated and corrupt checkpoint files, a stray
folder beside the checkpoints, a resume into another configuration, a NaN weight and a
learning rate of 1e6.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from attnlab.errors import ModelFileError, NonFiniteError
from attnlab.train import TrainConfig, Trainer
from attnlab.train.checkpoint import latest_checkpoint

SRC = Path(__file__).resolve().parents[2] / "src"
TINY = {
    "kind": "decoder",
    "arch": "llama",
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 32,
}


def _base(tmp: Path, **kw: Any) -> dict[str, Any]:
    return {
        "model": TINY,
        "data": {"source": "synthetic", "task": "copy", "task_length": 4, "num_symbols": 6},
        "steps": 4,
        "batch_size": 2,
        "save_every": 2,
        "progress": False,
        "export": False,
        "eval_batches": 1,
        "out_dir": str(tmp),
        "optim": {"lr": 3e-3, "warmup_steps": 1},
    } | kw


def _config(tmp: Path, **kw: Any) -> TrainConfig:
    return TrainConfig.from_dict(_base(tmp, **kw))


# A training run whose checkpoint writer kills the process half-way through writing
# step 4's trainer.json: the kill comes from inside the write, as a power cut would.
KILLED_RUN = """
import json, os, signal, sys
from pathlib import Path
from attnlab.train import TrainConfig, Trainer

real = Path.write_text
def write_text(self, text, *a, **kw):
    if self.name == "trainer.json" and '"step": 4' in text:
        with open(self, "w") as f:
            f.write(text[: len(text) // 2])
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, text, *a, **kw)
Path.write_text = write_text
Trainer(TrainConfig.from_dict(json.loads(sys.argv[1]))).train()
"""


def test_sigkill_while_saving_keeps_the_last_whole_checkpoint(tmp_path: Path) -> None:
    cfg = _base(tmp_path, steps=6)
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, json.dumps(cfg)], env=env, capture_output=True
    )
    assert run.returncode == -signal.SIGKILL, run.stderr.decode()
    ckpts = tmp_path / "checkpoints"
    assert not (ckpts / "step-4").exists()  # the half-written one never got its name
    assert latest_checkpoint(tmp_path) == ckpts / "step-2"
    (ckpts / "step-3.bak").mkdir()  # a stray folder a user left: ignored
    trainer = Trainer(_config(tmp_path, steps=6))
    trainer.train(resume="latest")
    assert trainer.step == 6 and latest_checkpoint(tmp_path) == ckpts / "step-6"
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".")]  # leftovers removed


def test_latest_skips_a_checkpoint_damaged_by_an_older_writer(tmp_path: Path) -> None:
    Trainer(_config(tmp_path)).train()
    ckpts = tmp_path / "checkpoints"
    text = (ckpts / "step-4" / "trainer.json").read_text()
    (ckpts / "step-4" / "trainer.json").write_text(text[:20])  # truncated in place
    assert latest_checkpoint(tmp_path) == ckpts / "step-2"
    (ckpts / "step-2" / "optimizer.pt").unlink()
    assert latest_checkpoint(tmp_path) is None


def test_resuming_a_finished_run_leaves_its_checkpoint_alone(tmp_path: Path) -> None:
    Trainer(_config(tmp_path)).train()
    final = tmp_path / "checkpoints" / "step-4"
    before = {p.name: p.stat().st_mtime_ns for p in final.iterdir()}
    inode = final.stat().st_ino
    again = Trainer(_config(tmp_path))
    again.train(resume="latest")
    assert again.step == 4
    assert final.stat().st_ino == inode
    assert {p.name: p.stat().st_mtime_ns for p in final.iterdir()} == before


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    ("name", "damage", "needle"),
    [
        ("model.safetensors", _truncate, "cannot be read as safetensors"),
        (
            "model.safetensors",
            lambda p: p.write_bytes(b"\x00" * 7),
            "cannot be read as safetensors",
        ),
        ("optimizer.pt", _truncate, "cannot be read"),
        ("optimizer.pt", lambda p: p.write_bytes(b"garbage, not a zip"), "cannot be read"),
        ("trainer.json", _truncate, "not valid JSON"),
        ("trainer.json", lambda p: p.write_text("[1, 2]"), "holds a JSON list"),
        ("rng.safetensors", _truncate, "cannot be read"),
        ("model.safetensors", lambda p: p.unlink(), "missing"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_damaged_checkpoint_file_is_named(
    tmp_path: Path, name: str, damage: Any, needle: str
) -> None:
    Trainer(_config(tmp_path, steps=2)).train()
    folder = tmp_path / "checkpoints" / "step-2"
    damage(folder / name)
    with pytest.raises(ModelFileError, match=needle) as e:
        Trainer(_config(tmp_path, steps=2)).train(resume=folder)
    assert name in str(e.value)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (
            {"num_attention_heads": 4},
            "num_attention_heads: checkpoint 2, this run 4",
        ),  # same shapes
        ({"hidden_size": 32}, "hidden_size"),
        ({"arch": "gpt2"}, "arch"),
    ],
)
def test_resuming_into_another_configuration_names_the_difference(
    tmp_path: Path, change: dict[str, Any], needle: str
) -> None:
    Trainer(_config(tmp_path, steps=2)).train()
    other = _config(tmp_path, steps=2, model=TINY | change)
    with pytest.raises(ValueError, match=needle):
        Trainer(other).train(resume="latest")


def test_a_nan_weight_stops_training_naming_the_step_and_module(tmp_path: Path) -> None:
    trainer = Trainer(_config(tmp_path, steps=4))
    name, weight = next(
        (n, p)
        for n, p in trainer.model.named_parameters()
        if n.startswith("layers.0.") and p.dim() == 2
    )
    with torch.no_grad():
        weight[0, 0] = math.nan
    with pytest.raises(NonFiniteError) as e:
        trainer.train()
    msg = str(e.value)
    assert "training stopped at step 1" in msg and "nan" in msg, msg
    assert f"module whose output is not finite: {name.rsplit('.', 1)[0]}" in msg, msg
    assert f"non-finite weights in {name}" in msg, msg
    assert not (tmp_path / "checkpoints").exists()  # nothing saved with NaN weights


def test_a_huge_learning_rate_stops_at_the_first_non_finite_step(tmp_path: Path) -> None:
    trainer = Trainer(_config(tmp_path, steps=40, save_every=1, optim={"lr": 1e6}))
    with pytest.raises(NonFiniteError, match=r"training stopped at step (\d+)") as e:
        trainer.train()
    found = re.search(r"training stopped at step (\d+)", str(e.value))
    assert found is not None
    step = int(found.group(1))
    assert step > 1
    last = latest_checkpoint(tmp_path)
    assert last is not None and last.name == f"step-{step - 1}"
    assert str(last) in str(e.value)
    resumed = Trainer(_config(tmp_path, steps=40, save_every=1, optim={"lr": 1e6}))
    resumed.load(last)
    for n, p in resumed.model.named_parameters():
        assert torch.isfinite(p).all(), n  # the last checkpoint is a good one


def test_a_nan_weight_stops_distillation(
    minilm_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import attnlab.train.distill as distill

    real = distill.make_student

    def poisoned(teacher: Any, layers: Any) -> Any:
        student = real(teacher, layers)
        with torch.no_grad():
            next(p for p in student.layers[-1].parameters() if p.dim() == 2)[0, 0] = math.nan
        return student

    monkeypatch.setattr(distill, "make_student", poisoned)
    cfg = distill.DistillConfig(steps=3, batch_size=4, train_sentences=16, eval_sentences=12)
    with pytest.raises(NonFiniteError, match="distillation stopped at step 1") as e:
        distill.distill_sentence_encoder(minilm_path, config=cfg, progress=False)
    assert "non-finite weights in layers." in str(e.value)


def test_distill_checks_its_output_before_the_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import attnlab
    import attnlab.train.distill as distill

    def no_work(*a: Any, **kw: Any) -> Any:
        raise AssertionError("the work started before the output was checked")

    monkeypatch.setattr(attnlab, "from_hf", no_work)
    with pytest.raises(OSError, match="not a writable folder"):
        distill.distill_sentence_encoder(out="/proc/attnlab-cannot-write", progress=False)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds other files"):
        distill.distill_sentence_encoder(out=tmp_path, progress=False)
    assert (tmp_path / "notes.txt").read_text() == "mine"
