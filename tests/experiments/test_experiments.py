"""The experiments: their pieces against independent computations, and each pipeline end
to end in a few steps (smoke runs assert the files, not the science)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from attnlab.experiments import EXPERIMENTS, run_experiment
from attnlab.experiments._common import write_result
from attnlab.experiments.gqa import mean_pool_kv
from attnlab.experiments.induction import RepeatedTokens, prefix_matching_scores
from attnlab.experiments.recall import MQAR
from attnlab.models import DecoderConfig, DecoderLM


def _strict(text: str) -> dict:
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-finite {c} in JSON"))


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_smoke_run_writes_table_json_and_plot(name: str, tmp_path: Path) -> None:
    r = run_experiment(name, smoke=True, out=tmp_path, progress=False)
    data = _strict((tmp_path / "results.json").read_text())
    assert data["name"] == name and data["rows"] and data["published"] and data["paper"]
    md = (tmp_path / "results.md").read_text()
    assert "| " + " | ".join(r.columns) + " |" in md and "Published:" in md
    assert (tmp_path / "plot.png").stat().st_size > 1000


def test_mean_pool_kv_identity_and_means() -> None:
    torch.manual_seed(0)
    cfg = DecoderConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
    )
    mha = DecoderLM(cfg).eval()
    ids = torch.randint(0, 50, (2, 9))
    same = mean_pool_kv(mha, 4).eval()
    torch.testing.assert_close(same(input_ids=ids).logits, mha(input_ids=ids).logits)
    mqa = mean_pool_kv(mha, 1)
    w = mha.layers[0].self_attention.k_proj.weight  # [4 * 8, 32]
    torch.testing.assert_close(
        mqa.layers[0].self_attention.k_proj.weight, w.reshape(4, 8, 32).mean(0)
    )
    assert mqa.config.num_key_value_heads == 1
    with pytest.raises(ValueError, match="groups"):
        mean_pool_kv(mha, 3)


def test_mqar_answers_are_the_stored_values() -> None:
    data = MQAR(keys=16, pairs=5, seed=1)
    ids, labels = data.draw(8, 0)
    assert ids.shape == (8, 20)
    for row, lab in zip(ids, labels):
        store = {int(row[2 * i]): int(row[2 * i + 1]) for i in range(5)}
        assert len(store) == 5  # distinct keys
        answers = [(int(row[t - 1]), int(lab[t])) for t in range(len(lab)) if lab[t] != -100]
        assert len(answers) == 5 and all(store[k] == v for k, v in answers)
    with pytest.raises(ValueError, match="pairs"):
        MQAR(keys=4, pairs=5, seed=0)


def test_prefix_matching_finds_a_perfect_induction_head() -> None:
    half = 6
    data = RepeatedTokens(vocab_size=10, half=half, seed=0)
    ids, period = data.draw(16, 0)
    n = 2 * half
    assert ids.shape == (16, n) and int(period.min()) >= half // 2 and int(period.max()) <= half
    assert len(set(period.tolist())) > 1  # the period varies from row to row
    for row, m in zip(ids, period.tolist()):
        assert torch.equal(row[n - 2 * m : n - m], row[n - m :])
    perfect = torch.zeros(16, 2, n, n)
    perfect[..., 0] = 1.0  # head 0 attends to the first token
    for r, m in enumerate(period.tolist()):
        for q in range(n - m, n - 1):
            perfect[r, 1, q, :] = 0.0
            perfect[r, 1, q, q - m + 1] = 1.0  # head 1: the token after the earlier copy
    uniform = torch.full((16, 2, n, n), 1.0 / n)

    class Fake:
        def eval(self) -> Fake:
            return self

        def __call__(self, **_: object) -> SimpleNamespace:
            return SimpleNamespace(attentions=(uniform, perfect))

    scores = prefix_matching_scores(Fake(), ids, period)  # type: ignore[arg-type]
    assert scores.shape == (2, 2)
    assert scores[1, 1] == pytest.approx(1.0) and scores[0, 0] == pytest.approx(1.0 / n)
    assert scores[1, 0] < 0.5


def test_cli_experiment_rejects_unknown_names_and_bad_out(tmp_path: Path) -> None:
    import subprocess
    import sys

    bad = subprocess.run(
        [sys.executable, "-m", "attnlab.cli", "experiment", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "nope" in bad.stderr
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = subprocess.run(
        [sys.executable, "-m", "attnlab.cli", "experiment", "gqa", "--out", str(blocker / "x")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode != 0 and "Traceback" not in out.stderr and "--out" in out.stderr


def test_recall_runs_split_by_architecture_combine_into_one_table(tmp_path: Path) -> None:
    from attnlab.experiments import recall

    for kind in ("attention", "mamba"):
        r = recall.run(smoke=True, out=tmp_path / kind, kinds=(kind,), progress=False)
        assert [row["model"] for row in r.rows] == [kind]
        write_result(r, tmp_path / kind)
    assert "nothing to compare" in r.verdict and r.agrees is None
    both = recall.combine([tmp_path / "mamba", tmp_path / "attention"], tmp_path / "all")
    assert [row["model"] for row in both.rows] == ["attention", "mamba"]
    # the learning rate chosen on validation rows, per model and width, survives the merge
    assert [row["lr at 32"] for row in both.rows] == [recall.LR, recall.LR]
    assert set(both.settings["sweep"]) == {"attention", "mamba"}
    assert both.agrees is not None and "attention reaches" in both.verdict
    data = _strict((tmp_path / "all" / "results.json").read_text())
    assert data["settings"]["kinds"] == ["attention", "mamba"]
    assert (tmp_path / "all" / "plot.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="kinds"):
        recall.run(smoke=True, out=tmp_path / "x", kinds=("rnn",), progress=False)


def test_gqa_quick_run_orders_layouts_as_published(tmp_path: Path) -> None:
    """The one --quick run of the suite (about 20 CPU seconds): loose, qualitative."""
    r = run_experiment("gqa", quick=True, out=tmp_path, progress=False)
    mha, *grouped = r.rows
    for row in grouped:
        # uptraining improves on the mean-pooled start, and never beats the MHA it came from
        assert row["uptrained_bpb"] < row["converted_bpb"]
        assert row["uptrained_bpb"] > 0.98 * mha["uptrained_bpb"]
    assert grouped[-1]["layout"] == "MQA"
    assert grouped[-1]["uptrained_bpb"] >= grouped[0]["uptrained_bpb"]  # MQA no better than GQA-4


def test_mqar_streams_differ_by_salt() -> None:
    """Train, eval, test and validation rows are different draws (seeds that differ only
    above bit 32 gave torch's generator one stream)."""
    data = MQAR(keys=16, pairs=4, seed=0)
    draws = [data.draw(8, salt)[0] for salt in (0, 32, 1 << 40, 1 << 41, 1 << 42)]
    for i, a in enumerate(draws):
        for b in draws[i + 1 :]:
            assert not torch.equal(a[:, :8], b[:, :8])


def test_recall_builds_the_linear_kinds_and_judges_the_delta_rule_against_mamba() -> None:
    from attnlab.experiments import recall

    ids = torch.randint(0, 32, (2, 16))
    for kind in recall.LINEAR_KINDS:
        model = recall.build(kind, 32, 32, 16)
        assert model(input_ids=ids).logits.shape == (2, 16, 32)
    s = {"widths": (64,), "pairs": 8, "steps": 10}
    ahead = {"attention": {64: 1.0}, "mamba": {64: 0.2}, "deltanet": {64: 0.9}}
    assert recall._verdict(ahead, s)[1] is True
    behind = {**ahead, "gated deltanet": {64: 0.25}}
    verdict, agrees = recall._verdict(behind, s)
    assert agrees is False and "do not all recall" in verdict


def _row(seed: int, layers: int, repeat: float, score: float, steps: int = 100) -> dict:
    return dict(seed=seed, layers=layers, steps=steps, loss_first_half=4.2, chance=4.16,
                loss_repeated_half=repeat, repeated_half_at_init=4.3, best_head="L1H0",
                prefix_matching=score)  # fmt: skip


def test_quick_induction_verdict_tries_further_seeds_and_says_so() -> None:
    from attnlab.experiments.induction import _verdict

    one = _row(0, 1, 3.4, 0.10)
    plateau, formed = _row(0, 2, 3.45, 0.16, 4000), _row(1, 2, 0.6, 0.75, 1800)
    agrees, text = _verdict([one, plateau, formed], quick=True)
    assert agrees and "formed at step 1800 of seed 1 after 1 seed(s) still on the plateau" in text
    agrees, text = _verdict([one, plateau], quick=True)
    assert not agrees and "no head formed in 1 seed(s)" in text
    # the full run pairs seeds and needs each to agree
    agrees, text = _verdict([one, formed, _row(1, 1, 3.3, 0.1), plateau], quick=False)
    assert not agrees and "1 of 2 seeds" in text


def test_training_stops_when_asked(tmp_path: Path) -> None:
    from attnlab.train import TrainConfig, Trainer

    cfg = TrainConfig.from_dict(
        {
            "model": {"kind": "decoder", "hidden_size": 16, "num_hidden_layers": 1,
                      "num_attention_heads": 2, "intermediate_size": 32},
            "data": {"source": "synthetic", "task": "copy", "task_length": 4, "num_symbols": 6},
            "steps": 50, "batch_size": 2, "progress": False, "export": False,
            "eval_batches": 1, "log_every": 10, "out_dir": str(tmp_path),
        }
    )  # fmt: skip
    trainer = Trainer(cfg)
    trainer.train(stop_when=lambda t: t.step >= 7)
    assert trainer.step == 7
    assert (tmp_path / "checkpoints" / "step-7").is_dir()
    assert trainer.history[-2]["step"] == 7  # the last step is logged though 7 % 10 != 0
