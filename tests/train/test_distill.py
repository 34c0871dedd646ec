"""Distillation of all-MiniLM-L6-v2: the student, its measurement, and its folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnlab.train.distill import (
    DistillConfig,
    _length_grouped_batches,
    distill_sentence_encoder,
    make_student,
    spearman,
    stdlib_sentences,
)


def test_spearman_equals_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(0)
    a = torch.randn(200, generator=g)
    b = a + torch.randn(200, generator=g)
    b[:10] = b[0]  # ties
    assert spearman(a, b) == pytest.approx(stats.spearmanr(a.numpy(), b.numpy())[0], abs=1e-10)


def test_student_keeps_the_chosen_layers(minilm_path: Path) -> None:
    import attnlab

    teacher = attnlab.from_hf(minilm_path)
    student = make_student(teacher, (1, 3, 5))
    assert len(student.layers) == 3 and student.config.num_hidden_layers == 3
    for s_layer, t_i in zip(student.layers, (1, 3, 5)):
        for (n1, p1), (_, p2) in zip(
            s_layer.named_parameters(), teacher.layers[t_i].named_parameters()
        ):
            assert torch.equal(p1, p2), n1
    with pytest.raises(ValueError, match="do not exist"):
        make_student(teacher, (0, 9))


def test_held_out_sentences_come_from_other_files() -> None:
    train = set(stdlib_sentences(held_out=False, limit=100000))
    held = stdlib_sentences(held_out=True, limit=200)
    assert len(held) == 200 and len(train) > 5000
    assert sum(s in train for s in held) < 10  # only boilerplate repeats across files


def test_tiny_distillation_saves_a_folder_others_load(minilm_path: Path, tmp_path: Path) -> None:
    import attnlab

    cfg = DistillConfig(steps=2, batch_size=4, train_sentences=64, eval_sentences=24)
    r = distill_sentence_encoder(minilm_path, config=cfg, out=tmp_path / "s", progress=False)
    assert r.student_layers == 3 and r.teacher_layers == 6 and -1 <= r.spearman <= 1
    json.dumps(r.to_dict(), allow_nan=False)
    folder = tmp_path / "s"
    for name in (
        "config.json",
        "model.safetensors",
        "modules.json",
        "1_Pooling/config.json",
        "sentence_bert_config.json",
        "tokenizer.json",
    ):
        assert (folder / name).is_file(), name
    student = attnlab.from_hf(folder).eval()
    assert len(student.layers) == 3
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(folder), device="cpu")
    text = ["attention is all you need", "a docstring of the standard library"]
    theirs = torch.as_tensor(model.encode(text))
    tf = attnlab.interop.hf.require_transformers()
    tok = tf.AutoTokenizer.from_pretrained(folder)
    enc = tok(text, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = student(**enc).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).float()
    ours = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


def test_bad_config() -> None:
    with pytest.raises(ValueError, match="steps"):
        DistillConfig(steps=0)
    with pytest.raises(ValueError, match="layers"):
        DistillConfig(layers=(-1,))
    with pytest.raises(ValueError, match="lr"):
        DistillConfig(lr=float("nan"))
    with pytest.raises(ValueError, match="device.*'tpu'"):
        DistillConfig(device="tpu")


def test_length_grouped_batches_cover_the_epoch_once_with_similar_lengths() -> None:
    g = torch.Generator().manual_seed(0)
    sents = ["x" * int(n) for n in torch.randint(20, 400, (1000,), generator=g)]
    batches = _length_grouped_batches(sents, 8, g, group=8)
    flat = [i for b in batches for i in b]
    assert len(flat) == len(set(flat)) == 1000 and all(len(b) == 8 for b in batches)
    # padding: each batch is padded to its longest sentence
    padded = sum(max(len(sents[i]) for i in b) * len(b) for b in batches)
    shuffled = torch.randperm(1000, generator=g).tolist()
    random_padded = sum(
        max(len(sents[i]) for i in shuffled[s : s + 8]) * 8 for s in range(0, 1000, 8)
    )
    assert padded < 0.7 * random_padded


def test_sentence_level_distillation_caches_the_teacher(
    minilm_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the token-level terms off, the teacher embeds each training sentence once: two
    epochs over 8 sentences send it 8 rows, not 16."""
    import attnlab.train.distill as distill

    rows: list[int] = []
    real = distill._trim

    def counting(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rows.append(len(batch["input_ids"]))
        return real(batch)

    monkeypatch.setattr(distill, "_trim", counting)
    cfg = DistillConfig(
        steps=4,
        batch_size=4,
        train_sentences=8,
        eval_sentences=12,
        attention_weight=0.0,
        hidden_weight=0.0,
    )
    r = distill_sentence_encoder(minilm_path, config=cfg, progress=False)
    assert sum(rows) == 8 and r.steps == 4 and r.final_loss == r.final_loss  # not NaN


def test_every_loss_weight_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="every loss weight is 0"):
        DistillConfig(
            embedding_weight=0.0, similarity_weight=0.0, attention_weight=0.0, hidden_weight=0.0
        )
