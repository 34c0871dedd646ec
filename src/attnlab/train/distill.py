"""Distil a sentence-embedding encoder into fewer layers, and measure what it kept.

The real case of the tutorial's advice (section 10.1: distilled models for constrained
hardware): all-MiniLM-L6-v2, the model the demo walks through, becomes a student with half
its layers, initialised from the teacher's own layers (as DistilBERT initialises from every
other layer of BERT; Sanh et al., 2019), and trained on sentences that exist offline (the
docstrings of the Python standard library) to reproduce the teacher's embeddings:

* the loss is the mean squared error between the student's and the teacher's normalised
  mean-pooled embeddings (Reimers & Gurevych, 2020, "Making Monolingual Sentence
  Embeddings Multilingual using Knowledge Distillation", use the same MSE on embeddings),
  the difference of their in-batch cosine-similarity matrices
  (:func:`~attnlab.functional.distill.similarity_relation_loss`), and optionally the token
  states of the last layer and MiniLM's attention-distribution transfer on the last layer
  (Wang et al., 2020), each with its weight;
* when only sentence-level terms are on, the teacher's embedding of each training sentence
  is computed once, on its first use, and reused on later epochs;
* quality is the Spearman correlation between the student's and the teacher's pairwise
  cosine similarities on held-out sentences (from standard-library files never trained on);
* speed is sentences per second of each, encoding the same held-out sentences.

The student is saved as a folder that ``attnlab.from_hf``, transformers and
sentence-transformers load as they load the teacher (config, safetensors, tokenizer files,
``modules.json``, ``1_Pooling/config.json``, ``sentence_bert_config.json``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnlab._files import atomic_folder, writable_dir
from attnlab._validate import check_seed
from attnlab.functional._checks import check_int, check_positive_int, check_real
from attnlab.functional.distill import (
    attention_kl,
    hidden_state_loss,
    similarity_relation_loss,
)
from attnlab.train.distill_data import HELD_OUT_PERCENT, spearman, stdlib_sentences
from attnlab.train.distill_data import length_grouped_batches as _length_grouped_batches
from attnlab.train.distill_data import pairwise_cosines as _pairwise_cos
from attnlab.train.distill_data import trim as _trim
from attnlab.train.guard import check_step_finite
from attnlab.train.trainer import lr_multiplier

logger = logging.getLogger(__name__)

__all__ = [
    "HELD_OUT_PERCENT",
    "DistillConfig",
    "DistillResult",
    "distill_sentence_encoder",
    "spearman",
    "stdlib_sentences",
]

#: Files of the sentence-transformers folder layout copied from the teacher unchanged.
_ST_FILES = (
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "1_Pooling/config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)


@dataclass
class DistillConfig:
    """What :func:`distill_sentence_encoder` does.

    Attributes:
        layers: teacher layers the student starts from, in order (default ``(0, 3, 5)`` of
            6: keeping the first layer starts the student at Spearman 0.632 against 0.436
            for every other layer ``(1, 3, 5)``; see docs/experiments.md).
        steps: optimiser steps.
        batch_size: sentences per step.
        lr: AdamW learning rate (linear warm-up over the first 10 % of steps, then cosine).
        embedding_weight: weight of the embedding MSE term.
        similarity_weight: weight of the in-batch cosine-similarity term.
        attention_weight: weight of the attention-transfer term (0 = off).
        hidden_weight: weight of the last-layer token-state term (0 = off). With both of
            these off, each teacher embedding is computed once and cached.
        max_length: tokens per sentence (longer ones are truncated).
        train_sentences: sentences drawn from the training files.
        eval_sentences: held-out sentences for Spearman and speed.
        seed: seeds data order and initialisation.
        device: where the student trains and the embeddings for Spearman are computed:
            ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. Encode
            speed is always measured on the CPU (the constrained hardware the student is for).
    """

    layers: tuple[int, ...] = (0, 3, 5)
    steps: int = 1500
    batch_size: int = 32
    lr: float = 5e-4
    embedding_weight: float = 1.0
    similarity_weight: float = 1.0
    attention_weight: float = 0.0
    hidden_weight: float = 0.0
    max_length: int = 128
    train_sentences: int = 20000
    eval_sentences: int = 500
    seed: int = 0
    device: str = "auto"

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "max_length", "train_sentences", "eval_sentences"):
            check_positive_int(f"DistillConfig.{name}", getattr(self, name))
        if not self.layers:
            raise ValueError("DistillConfig.layers must name at least one teacher layer, got ()")
        for i in self.layers:
            check_int("DistillConfig.layers[i]", i, min_value=0)
        check_real("DistillConfig.lr", self.lr, gt=0.0)
        check_seed("DistillConfig.seed", self.seed)
        weights = ("embedding_weight", "similarity_weight", "attention_weight", "hidden_weight")
        for name in weights:
            check_real(f"DistillConfig.{name}", getattr(self, name), ge=0.0)
        if not any(getattr(self, name) > 0 for name in weights):
            raise ValueError(
                "DistillConfig: every loss weight is 0; set at least one of "
                + ", ".join(weights)
                + " above 0"
            )
        if not isinstance(self.device, str) or not (
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")
        ):
            raise ValueError(
                f"DistillConfig.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', "
                f"got {self.device!r}"
            )


@dataclass
class DistillResult:
    """Figures of one distillation run.

    Attributes:
        spearman: Spearman correlation of pairwise cosine similarities, student vs teacher,
            on held-out sentences.
        spearman_at_init: the same for the student before training.
        teacher_sentences_per_s, student_sentences_per_s: encode speed on held-out
            sentences, on the CPU with torch's current thread count.
        speedup: student over teacher.
        teacher_layers, student_layers: depth of each.
        steps: optimiser steps run.
        final_loss: training loss of the last step.
        seconds: wall time of the training loop.
        out: the saved student folder (or None).
        device: where the student trained.
        threads: torch's CPU threads during the speed measurement.
    """

    spearman: float
    spearman_at_init: float
    teacher_sentences_per_s: float
    student_sentences_per_s: float
    speedup: float
    teacher_layers: int
    student_layers: int
    steps: int
    final_loss: float
    seconds: float
    out: str | None
    device: str = "cpu"
    threads: int = 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------- model pieces


def _mean_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    """Masked mean over tokens, ``[B, L, D] -> [B, D]`` (sentence-transformers' "mean")."""
    m = mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)


def _embed(model: Any, batch: dict[str, Tensor], **kw: Any) -> tuple[Tensor, Any]:
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        token_type_ids=batch.get("token_type_ids"),
        **kw,
    )
    emb = torch.nn.functional.normalize(
        _mean_pool(out.last_hidden_state, batch["attention_mask"]), dim=-1
    )
    return emb, out


def make_student(teacher: torch.nn.Module, layers: Sequence[int]) -> torch.nn.Module:
    """A copy of ``teacher`` keeping only ``layers`` (embeddings and the rest copied)."""
    n = len(teacher.layers)  # type: ignore[arg-type]
    bad = [i for i in layers if i >= n]
    if bad:
        raise ValueError(f"layers {bad} do not exist: the teacher has {n} layers (0..{n - 1})")
    student = copy.deepcopy(teacher)
    student.layers = torch.nn.ModuleList(copy.deepcopy(teacher.layers[i]) for i in layers)  # type: ignore[index, misc]
    student.config = dataclasses.replace(teacher.config, num_hidden_layers=len(layers))  # type: ignore[type-var, arg-type]
    return student


@torch.no_grad()
def _encode_all(
    model: Any, tokenize: Callable[[list[str]], dict[str, Tensor]], sents: list[str], bs: int
) -> tuple[Tensor, float]:
    """Embeddings of ``sents`` (on the CPU) and the seconds it took (length-sorted batches,
    on the model's device)."""
    order = sorted(range(len(sents)), key=lambda i: len(sents[i]))
    device = next(model.parameters()).device
    parts: dict[int, Tensor] = {}
    t0 = time.perf_counter()
    for s in range(0, len(order), bs):
        idx = order[s : s + bs]
        batch = {k: v.to(device) for k, v in tokenize([sents[i] for i in idx]).items()}
        emb, _ = _embed(model, batch)
        for j, i in enumerate(idx):
            parts[i] = emb[j]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    out = torch.stack([parts[i] for i in range(len(sents))]).cpu()
    return out, seconds


# ---------------------------------------------------------------------------- the run


def distill_sentence_encoder(
    teacher_dir: str | Path | None = None,
    *,
    config: DistillConfig | None = None,
    out: str | Path | None = None,
    progress: bool = True,
) -> DistillResult:
    """Distil a sentence-embedding BERT into ``len(config.layers)`` of its layers.

    Args:
        teacher_dir: a sentence-transformers model folder (default all-MiniLM-L6-v2 from
            its PyPI package).
        config: :class:`DistillConfig`.
        out: save the student there (a folder ``from_hf``, transformers and
            sentence-transformers load).
        progress: show a progress bar with the loss.

    Returns:
        :class:`DistillResult`.
    """
    cfg = config or DistillConfig()
    if out is not None:  # before the work: an unwritable out fails at once, not after training
        _check_out(Path(out))
    run = _setup(teacher_dir, cfg)
    teacher, student, tokenize = run.teacher, run.student, run.tokenize
    train = stdlib_sentences(held_out=False, limit=cfg.train_sentences, seed=cfg.seed)
    held = stdlib_sentences(held_out=True, limit=cfg.eval_sentences, seed=cfg.seed)
    if len(train) < cfg.batch_size or len(held) < 10:
        raise ValueError(
            f"too few sentences found in the standard library ({len(train)} train, "
            f"{len(held)} held out)"
        )

    teacher_emb, _ = _encode_all(teacher, tokenize, held, cfg.batch_size)
    target = _pairwise_cos(teacher_emb)
    student.eval()
    init_emb, _ = _encode_all(student, tokenize, held, cfg.batch_size)
    rho0 = spearman(_pairwise_cos(init_emb), target)
    student.train()

    t0 = time.perf_counter()
    loss_val = _train(run, cfg, train, progress)
    seconds = time.perf_counter() - t0
    student.eval()

    s_emb, _ = _encode_all(student, tokenize, held, cfg.batch_size)
    rho = spearman(_pairwise_cos(s_emb), target)

    # speed on the CPU: alternate teacher and student on the same batches, best of each
    teacher.cpu()
    student.cpu()
    t_teacher = t_student = float("inf")
    for _ in range(3):
        t_teacher = min(t_teacher, _encode_all(teacher, tokenize, held, cfg.batch_size)[1])
        t_student = min(t_student, _encode_all(student, tokenize, held, cfg.batch_size)[1])

    saved = None
    if out is not None:
        saved = str(save_student(student, run.teacher_dir, Path(out)))
    return DistillResult(
        spearman=rho,
        spearman_at_init=rho0,
        teacher_sentences_per_s=len(held) / t_teacher,
        student_sentences_per_s=len(held) / t_student,
        speedup=t_teacher / t_student,
        teacher_layers=len(teacher.layers),  # type: ignore[arg-type]
        student_layers=len(student.layers),  # type: ignore[arg-type]
        steps=cfg.steps,
        final_loss=loss_val,
        seconds=seconds,
        out=saved,
        device=str(run.device),
        threads=torch.get_num_threads(),
    )


@dataclass
class _Run:
    """The teacher, the student, the tokenizer and the device of one distillation."""

    teacher_dir: Path
    teacher: Any
    student: Any
    tokenize: Callable[[list[str]], dict[str, Tensor]]
    device: torch.device


def _setup(teacher_dir: str | Path | None, cfg: DistillConfig) -> _Run:
    """Load the teacher and its tokenizer, make the student, put both on the device."""
    import attnlab
    from attnlab.interop.hf import require_transformers

    if teacher_dir is None:
        from attnlab.interop.pretrained import minilm_path

        teacher_dir = minilm_path()
    from attnlab.interop.checkpoints import check_model_folder

    folder = check_model_folder(teacher_dir)
    tf = require_transformers()
    tf.utils.logging.disable_progress_bar()
    tokenizer = tf.AutoTokenizer.from_pretrained(folder)
    max_len = cfg.max_length
    st_cfg = folder / "sentence_bert_config.json"
    if st_cfg.is_file():
        max_len = min(max_len, int(json.loads(st_cfg.read_text())["max_seq_length"]))

    def tokenize(texts: list[str]) -> dict[str, Tensor]:
        enc = tokenizer(
            texts, padding=True, truncation=True, max_length=max_len, return_tensors="pt"
        )
        return dict(enc)

    name = cfg.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: CUDA is not available here; use 'cpu'")
    device = torch.device(name)
    torch.manual_seed(cfg.seed)
    teacher = attnlab.from_hf(folder).eval()
    student = make_student(teacher, cfg.layers).train()
    for p in teacher.parameters():
        p.requires_grad_(False)
    teacher.to(device)
    student.to(device)
    return _Run(folder, teacher, student, tokenize, device)


def _train(run: _Run, cfg: DistillConfig, train: list[str], progress: bool) -> float:
    """``cfg.steps`` optimizer steps of the student on ``train``; the last loss."""
    student = run.student
    opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr, weight_decay=0.01)
    warm = max(1, cfg.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: lr_multiplier(step, steps=cfg.steps, warmup=warm, min_ratio=0.0)
    )
    g = torch.Generator().manual_seed(cfg.seed)
    batches: list[list[int]] = []
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.steps, desc="distil", unit="step")
        except ImportError:  # the `train` extra is not installed: no bar
            bar = None
    loss_val = float("nan")
    cached: dict[int, Tensor] = {}  # teacher embeddings by sentence, when only they are used
    for _ in range(cfg.steps):
        if not batches:
            batches = _length_grouped_batches(train, cfg.batch_size, g)
        idx = batches.pop()
        batch = {k: v.to(run.device) for k, v in run.tokenize([train[i] for i in idx]).items()}
        loss = _loss(run, cfg, batch, idx, cached)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0))
        check_step_finite(
            what="distillation",
            step=sched.last_epoch + 1,
            loss=float(loss.detach()),
            grad_norm=norm,
            model=student,
            rerun=functools.partial(_embed, student, batch),
        )
        opt.step()
        sched.step()
        loss_val = float(loss.detach())
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_val:.4f}")
    if bar is not None:
        bar.close()
    return loss_val


def _loss(
    run: _Run,
    cfg: DistillConfig,
    batch: dict[str, Tensor],
    idx: list[int],
    cached: dict[int, Tensor],
) -> Tensor:
    """The weighted distillation loss of one batch (``idx``: its sentences; ``cached``:
    the teacher's embeddings kept when only sentence-level terms are on)."""
    token_terms = cfg.attention_weight > 0 or cfg.hidden_weight > 0
    want_attn = cfg.attention_weight > 0
    t_out = None
    with torch.no_grad():
        if token_terms:
            t_emb, t_out = _embed(run.teacher, batch, output_attentions=want_attn)
        else:
            new = [j for j, i in enumerate(idx) if i not in cached]
            if new:
                sub = {k: v[new] for k, v in batch.items()}
                fresh, _ = _embed(run.teacher, _trim(sub))
                cached.update({idx[j]: e for j, e in zip(new, fresh, strict=True)})
            t_emb = torch.stack([cached[i] for i in idx])
    s_emb, s_out = _embed(run.student, batch, output_attentions=want_attn)
    mask = batch["attention_mask"]
    loss = cfg.embedding_weight * (s_emb - t_emb).pow(2).sum(-1).mean()
    if cfg.similarity_weight > 0:
        loss = loss + cfg.similarity_weight * similarity_relation_loss(s_emb, t_emb)
    if t_out is not None and cfg.hidden_weight > 0:
        loss = loss + cfg.hidden_weight * hidden_state_loss(
            s_out.last_hidden_state, t_out.last_hidden_state, mask=mask
        )
    if t_out is not None and want_attn:
        loss = loss + cfg.attention_weight * attention_kl(
            s_out.attentions[-1], t_out.attentions[-1], mask=mask
        )
    return loss


def _check_out(out: Path) -> None:
    """``out`` can receive the student: writable, and not a folder of other files."""
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise ValueError(
            f"out {str(out)!r} holds other files and no model (no config.json); the student "
            "replaces the whole folder: give a new or empty one"
        )
    writable_dir("out", out)


def save_student(student: torch.nn.Module, teacher_dir: Path, out: Path) -> Path:
    """Write ``student`` as a sentence-transformers folder beside the teacher's files.

    The folder appears whole or not at all, replacing an existing one
    (:func:`attnlab._files.atomic_folder`).
    """
    with atomic_folder(out) as tmp:
        _write_student(student, teacher_dir, tmp)
    return out


def _write_student(student: torch.nn.Module, teacher_dir: Path, out: Path) -> None:
    import attnlab

    hf = attnlab.to_hf(student)
    hf.save_pretrained(out, safe_serialization=True)
    for name in _ST_FILES:
        src = teacher_dir / name
        if src.is_file():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, out / name)
