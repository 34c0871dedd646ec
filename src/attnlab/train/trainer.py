"""The training loop, the same for every attnlab model and for 1 or N processes.

AdamW (Loshchilov & Hutter, 2019) with linear warmup and cosine decay (Loshchilov &
Hutter, 2017, "SGDR"), global-norm gradient clipping, gradient accumulation over micro
batches, optional bfloat16 autocast and ``torch.compile``; held-out evaluation, metrics
as JSON lines, a loss-curve PNG and checkpoints that resume bit-identically.

The loss of a step is the mean over every counted target of the global batch: each micro
batch's mean loss is weighted by its share of the targets, so one process with
accumulation and N processes without it compute the same number (and the same gradient,
up to the order of floating-point sums).
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from attnlab.functional.masks import document
from attnlab.train.build import build_model
from attnlab.train.checkpoint import (
    check_same_model,
    latest_checkpoint,
    load_checkpoint,
    read_trainer_state,
    save_checkpoint,
)
from attnlab.train.config import TrainConfig
from attnlab.train.data import Batch, SyntheticData, TextData, bits_per_byte, build_data
from attnlab.train.distributed import DistContext, setup_distributed, wrap_model
from attnlab.train.guard import check_step_finite, check_weights_finite

__all__ = ["TrainResult", "Trainer", "lr_multiplier"]

log = logging.getLogger(__name__)


def lr_multiplier(step: int, *, steps: int, warmup: int, min_ratio: float) -> float:
    """Learning-rate factor at ``step`` (0-based): linear warmup, then cosine to ``min_ratio``."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class TrainResult:
    """What a run did: steps, last train loss, the last evaluation, where it wrote."""

    steps: int
    train_loss: float
    eval: dict[str, float] = field(default_factory=dict)
    out_dir: Path | None = None
    tokens_per_s: float = 0.0


def model_inputs(batch: Batch, kind: str) -> dict[str, Any]:
    """The keyword arguments of the model's forward for ``batch``."""
    kw: dict[str, Any] = {"input_ids": batch.input_ids, "labels": batch.labels}
    if kind == "decoder" and batch.doc_ids is not None:
        kw["attention_mask"] = document(batch.doc_ids)
        kw["position_ids"] = batch.position_ids
    elif batch.attention_mask is not None:
        kw["attention_mask"] = batch.attention_mask
    return kw


class Trainer:
    """Trains the model a :class:`TrainConfig` describes.

    Args:
        config: the run.
        data: a dataset to use instead of building one from ``config.data``.
        model: a model to use instead of building one from ``config.model``.

    Under ``torchrun`` the process group is joined here (see
    :mod:`attnlab.train.distributed`); call :meth:`close` (or use the trainer as a
    context manager) to leave it.
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        data: TextData | SyntheticData | None = None,
        model: nn.Module | None = None,
    ) -> None:
        self.config = config
        self.kind = config.model_kind if config.model_kind != "custom" else "decoder"
        self.ctx: DistContext = setup_distributed(config.parallel, config.device)
        w = self.ctx.world_size
        if config.batch_size % w:
            raise ValueError(
                f"batch_size ({config.batch_size}) must be divisible by the number of "
                f"processes ({w})"
            )
        self.local_batch = config.batch_size // w
        self.micro = config.micro_batch_size or self.local_batch
        if self.local_batch % self.micro:
            raise ValueError(
                f"each process's share of the batch ({self.local_batch}) must be a multiple "
                f"of micro_batch_size ({self.micro})"
            )
        self.data = (
            data if data is not None else build_data(config.data, kind=self.kind, seed=config.seed)
        )
        self.model = (
            model
            if model is not None
            else build_model(
                config.model,
                vocab_size=self.data.vocab_size,
                max_length=self.data.max_length,
                seed=config.seed,
            )
        )
        self.wrapped = wrap_model(self.model, self.ctx, config.parallel)
        self.optimizer = self._optimizer()
        o = config.optim
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_multiplier(
                s, steps=config.steps, warmup=o.warmup_steps, min_ratio=o.min_lr_ratio
            ),
        )
        self.step = 0
        self.samples = 0
        self.tokens = 0
        self.out_dir = Path(config.out_dir)
        self.history: list[dict[str, Any]] = []
        self.last_checkpoint: Path | None = None  # the last one written or loaded
        self._forward = self._make_forward()
        torch.manual_seed(config.seed + 1)  # the dropout stream

    # ------------------------------------------------------------------ set-up

    def _optimizer(self) -> torch.optim.Optimizer:
        o = self.config.optim
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        for p in self.model.parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 else no_decay).append(p)
        groups = [
            {"params": decay, "weight_decay": o.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(
            groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False
        )

    def _make_forward(self) -> Callable[..., Tensor]:
        wrapped = self.wrapped
        # a decoder that can computes the loss without holding the [B, L, V] logits
        accepts = inspect.signature(self.model.forward).parameters
        extra = {"return_logits": False} if "return_logits" in accepts else {}

        def forward_loss(**kw: Any) -> Tensor:
            out = wrapped(**kw, **extra)
            loss: Tensor = out.loss
            return loss

        if self.config.compile:
            return torch.compile(forward_loss)  # type: ignore[no-any-return]
        return forward_loss

    def _autocast(self) -> Any:
        if self.config.dtype == "bfloat16":
            return torch.autocast(self.ctx.device.type, dtype=torch.bfloat16)
        return nullcontext()

    # ------------------------------------------------------------------ training

    def train_step(self) -> dict[str, float]:
        """One optimizer step over one global batch; returns its metrics."""
        c, ctx = self.config, self.ctx
        t0 = time.perf_counter()
        batch = self.data.train_batch(self.samples, c.batch_size)
        total = max(1, batch.num_targets)
        lo = ctx.rank * self.local_batch
        self.wrapped.train()
        loss_sum = torch.zeros((), dtype=torch.float64)
        n_micro = self.local_batch // self.micro
        micro: list[Batch] = []  # [the first micro batch, the first with a non-finite loss]
        for j in range(n_micro):
            mb = batch.rows(lo + j * self.micro, lo + (j + 1) * self.micro, None, self.kind)
            last = j == n_micro - 1
            sync = (
                self.wrapped.no_sync()  # type: ignore[operator]
                if ctx.strategy == "ddp" and not last
                else nullcontext()
            )
            with sync:
                with self._autocast():
                    loss = self._forward(**self._to_device(model_inputs(mb, self.kind)))
                if mb.num_targets == 0:
                    loss = loss.nan_to_num(0.0) * 0.0  # keeps the graph (DDP needs grads)
                weight = mb.num_targets / total * ctx.world_size  # DDP/FSDP average over ranks
                (loss * weight).backward()
            loss_sum += loss.detach().double().cpu() * mb.num_targets
            if j == 0 or (len(micro) == 1 and not bool(torch.isfinite(loss.detach()))):
                micro.append(mb)
        if ctx.enabled:
            dist.all_reduce(loss_sum)
        grad_norm = self._clip()
        check_step_finite(
            what="training",
            step=self.step + 1,
            loss=float(loss_sum) / total,
            grad_norm=grad_norm,
            model=self.model,
            rerun=lambda: self._rerun(micro[-1]),
            last_checkpoint=None if self.last_checkpoint is None else str(self.last_checkpoint),
        )
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.samples += c.batch_size
        n_tokens = int(
            batch.input_ids.numel() + (batch.labels.numel() if self.kind == "seq2seq" else 0)
        )
        self.tokens += n_tokens
        dt = time.perf_counter() - t0
        return {
            "step": self.step,
            "loss": float(loss_sum) / total,
            "lr": float(self.scheduler.get_last_lr()[0]),
            "grad_norm": grad_norm,
            "tokens": self.tokens,
            "tokens_per_s": n_tokens / dt,
            "step_time_s": dt,
        }

    def _rerun(self, mb: Batch) -> None:
        """The forward of micro batch ``mb`` again, on the unwrapped model (for the guard)."""
        with self._autocast():
            self.model(**self._to_device(model_inputs(mb, self.kind)))

    def _to_device(self, kw: dict[str, Any]) -> dict[str, Any]:
        dev = self.ctx.device
        if dev.type == "cpu":
            return kw
        return {k: v.to(dev) if isinstance(v, Tensor) else v for k, v in kw.items()}

    def _clip(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.config.optim.grad_clip
        norm: Any = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
            norm = norm.full_tensor()
        return float(norm)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss on the held-out batches; bits per byte for text, accuracy for tasks."""
        c = self.config
        self.wrapped.eval()
        nats, targets, n_bytes, correct = 0.0, 0, 0, 0
        for batch in self.data.eval_batches(c.eval_batches, c.batch_size):
            with self._autocast():
                out = self.wrapped(**self._to_device(model_inputs(batch, self.kind)))
            if batch.num_targets == 0:
                continue
            nats += float(out.loss) * batch.num_targets
            targets += batch.num_targets
            n_bytes += batch.num_bytes
            logits, labels = out.logits, batch.labels.to(out.logits.device)
            if self.kind == "decoder":
                logits, labels = logits[:, :-1], labels[:, 1:]
            keep = labels != -100
            correct += int((logits.argmax(-1)[keep] == labels[keep]).sum())
        self.wrapped.train()
        if not targets:
            return {}
        result = {"eval_loss": nats / targets, "eval_accuracy": correct / targets}
        if n_bytes:
            result["eval_bits_per_byte"] = bits_per_byte(nats, n_bytes)
        return result

    def train(
        self,
        *,
        resume: str | Path | None = None,
        until: int | None = None,
        stop_when: Callable[[Trainer], bool] | None = None,
    ) -> TrainResult:
        """Run to ``config.steps``, evaluating, logging and saving on the way.

        Args:
            resume: a checkpoint folder to continue from, or ``"latest"`` (the newest
                under ``out_dir``).
            until: stop after this step (and save): the schedule stays the one of
                ``config.steps``, so resuming later continues the same run exactly.
            stop_when: called after every step; True ends the run there (evaluated, saved
                and plotted as at the end), e.g. once a probe shows what a run looks for.
        """
        c, ctx = self.config, self.ctx
        if until is not None and not 0 < until <= c.steps:
            raise ValueError(f"until must be in [1, steps={c.steps}], got {until!r}")
        stop = c.steps if until is None else until
        if resume is not None:
            path = latest_checkpoint(self.out_dir) if str(resume) == "latest" else Path(resume)
            if path is None:
                raise ValueError(f"no checkpoint to resume under {self.out_dir / 'checkpoints'}")
            self.load(path)
        resumed_at = self.step if resume is not None else None
        if ctx.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            c.save(self.out_dir / "train_config.json")
        bar = self._progress()
        last: dict[str, float] = {}
        evaluation: dict[str, float] = {}
        rates: list[float] = []
        while self.step < stop:
            last = self.train_step()
            rates.append(last["tokens_per_s"])
            if self.step % c.log_every == 0 or self.step == c.steps:
                self._log(last)
            if c.eval_every and self.step % c.eval_every == 0 and self.step < c.steps:
                evaluation = self.evaluate()
                self._log({"step": self.step, **evaluation})
            if c.save_every and self.step % c.save_every == 0 and self.step < c.steps:
                self.save()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{last['loss']:.4f}", tok_s=f"{last['tokens_per_s']:.0f}")
            if stop_when is not None and stop_when(self):
                if self.step % c.log_every:
                    self._log(last)
                break
        if bar is not None:
            bar.close()
        evaluation = self.evaluate()
        if evaluation:
            self._log({"step": self.step, **evaluation})
        if self.step != resumed_at:  # a finished run resumed: its checkpoint stays as it is
            self.save()
        if c.export and self.step == c.steps:
            self.export()
        if ctx.is_main:
            self.plot()
        steady = rates[len(rates) // 4 :] or rates
        return TrainResult(
            steps=self.step,
            train_loss=last.get("loss", float("nan")),
            eval=evaluation,
            out_dir=self.out_dir,
            tokens_per_s=sum(steady) / len(steady) if steady else 0.0,
        )

    def _progress(self) -> Any:
        if not (self.config.progress and self.ctx.is_main):
            return None
        try:
            from tqdm import tqdm
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "the progress bar needs tqdm: pip install 'attnlab[train]' (or progress = false)"
            ) from e
        return tqdm(total=self.config.steps, initial=self.step, desc="train", unit="step")

    def _log(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        if self.ctx.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with (self.out_dir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")

    # ------------------------------------------------------------------ state

    def state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "samples": self.samples,
            "tokens": self.tokens,
            "scheduler": self.scheduler.state_dict(),
            "world_size": self.ctx.world_size,
            "config": self.config.to_dict(),
        }

    def save(self, folder: Path | None = None) -> Path:
        """Write a checkpoint (default ``out_dir/checkpoints/step-N``)."""
        folder = folder or self.out_dir / "checkpoints" / f"step-{self.step}"
        check_weights_finite(
            self.model,
            what="training",
            step=self.step,
            last_checkpoint=None if self.last_checkpoint is None else str(self.last_checkpoint),
        )
        save_checkpoint(
            folder, model=self.model, optimizer=self.optimizer, state=self.state(), ctx=self.ctx
        )
        self.last_checkpoint = folder
        return folder

    def load(self, folder: Path) -> None:
        """Continue from a checkpoint: weights, optimizer, scheduler, RNG, data position."""
        folder = Path(folder)
        check_same_model(folder, read_trainer_state(folder), self.config.model)
        state = load_checkpoint(folder, model=self.model, optimizer=self.optimizer)
        self.last_checkpoint = folder
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.samples, self.tokens = state["step"], state["samples"], state["tokens"]

    def export(self, folder: Path | None = None) -> Path:
        """Save the model (and tokenizer) for ``attnlab generate`` (default ``out_dir/model``)."""
        from attnlab.train.export import export_model

        folder = folder or self.out_dir / "model"
        model = self.model
        if self.ctx.strategy == "fsdp":  # gather the shards into a plain copy
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            full = get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
            if self.ctx.is_main:
                model = build_model(
                    self.config.model,
                    vocab_size=self.data.vocab_size,
                    max_length=self.data.max_length,
                    seed=self.config.seed,
                )
                model.load_state_dict(full)
        if self.ctx.is_main:
            export_model(model.eval(), folder, tokenizer=self.data.tokenizer)
            self.model.train()
        self.ctx.barrier()
        return folder

    def plot(self) -> Path | None:
        """``loss_curve.png``: training loss per step and held-out loss (needs matplotlib)."""
        try:
            from attnlab.train.plot import plot_history
        except ImportError:  # pragma: no cover - depends on the environment
            log.warning("matplotlib is not installed: no loss curve (pip install 'attnlab[viz]')")
            return None
        return plot_history(self.history, self.out_dir / "loss_curve.png")

    def close(self) -> None:
        self.ctx.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
