"""The training loop: exact resume, accumulation, every model kind, bfloat16."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from attnlab.train import TrainConfig, Trainer

TINY = {
    "kind": "decoder",
    "arch": "llama",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
}


def _config(tmp: Path, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = {
        "model": TINY,
        "data": {"source": "synthetic", "task": "copy", "task_length": 6, "num_symbols": 8},
        "steps": 6,
        "batch_size": 4,
        "progress": False,
        "export": False,
        "eval_batches": 1,
        "out_dir": str(tmp),
        "optim": {"lr": 3e-3, "warmup_steps": 2},
    }
    return TrainConfig.from_dict(base | kw)


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_resume_is_bit_identical(tmp_path: Path) -> None:
    """N steps, save, resume in a new trainer, M steps == N + M steps straight through;
    with dropout (the RNG is restored) and accumulation."""
    model = TINY | {"hidden_dropout": 0.1}
    kw: dict[str, Any] = {"model": model, "micro_batch_size": 2}
    straight = Trainer(_config(tmp_path / "a", **kw))
    straight.train()
    first = Trainer(_config(tmp_path / "b", **kw))
    first.train(until=3)
    again = Trainer(_config(tmp_path / "b", **kw))
    again.train(resume="latest")
    assert again.step == 6 and again.samples == 24
    a, b = _params(straight), _params(again)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa = straight.optimizer.state_dict()["state"]
    sb = again.optimizer.state_dict()["state"]
    for i in sa:
        assert torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"])
    losses = [r["loss"] for r in straight.history if "loss" in r]
    resumed = [r["loss"] for r in first.history + again.history if "loss" in r]
    assert losses == resumed


def test_accumulation_equals_one_big_batch(tmp_path: Path) -> None:
    one = Trainer(_config(tmp_path / "a", steps=2))
    acc = Trainer(_config(tmp_path / "b", steps=2, micro_batch_size=1))
    r1, r2 = one.train_step(), acc.train_step()
    assert abs(r1["loss"] - r2["loss"]) < 1e-6
    for (k, p), q in zip(one.model.named_parameters(), acc.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=k)


@pytest.mark.parametrize(
    "model",
    [
        {"kind": "encoder", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 64, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
        {"kind": "seq2seq", "arch": "t5", "d_model": 32, "d_ff": 64, "num_layers": 2,
         "num_heads": 4, "relative_attention_num_buckets": 8},
        TINY | {"arch": "gpt2", "gradient_checkpointing": True},
    ],
    ids=["encoder", "seq2seq", "gpt2-checkpointed"],
)  # fmt: skip
def test_every_model_kind_learns(tmp_path: Path, model: dict[str, Any]) -> None:
    optim = {"lr": 1e-2, "warmup_steps": 2}
    cfg = _config(tmp_path, model=model, steps=40, batch_size=16, eval_batches=2, optim=optim)
    trainer = Trainer(cfg)
    before = trainer.evaluate()["eval_loss"]
    result = trainer.train()
    assert result.eval["eval_loss"] < before - 0.2
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 41  # 40 steps + the final evaluation
    assert (tmp_path / "loss_curve.png").stat().st_size > 1000


def test_bfloat16_autocast_trains(tmp_path: Path) -> None:
    trainer = Trainer(_config(tmp_path, dtype="bfloat16", steps=3))
    result = trainer.train()
    assert result.steps == 3 and torch.isfinite(torch.tensor(result.train_loss))
    assert next(trainer.model.parameters()).dtype == torch.float32  # master weights


def test_bad_resume_is_rejected(tmp_path: Path) -> None:
    trainer = Trainer(_config(tmp_path / "empty"))
    with pytest.raises(ValueError, match=r"no checkpoint to resume"):
        trainer.train(resume="latest")
    with pytest.raises(ValueError, match=r"until must be in \[1, steps=6\], got 9"):
        trainer.train(until=9)
    with pytest.raises(ValueError, match="is not a training checkpoint"):
        trainer.train(resume=tmp_path)
