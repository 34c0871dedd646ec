"""What every experiment shares: its result record, the files it writes, and training.

An experiment trains small models with :class:`attnlab.train.Trainer`, measures them, and
returns an :class:`ExperimentResult`: a table of our figures, the published result it
reproduces (transcribed from the paper, with the table or figure it comes from), and a
verdict computed from our figures (does the published shape hold here?).
:func:`write_result` turns it into ``results.md``, ``results.json`` and ``plot.png``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["CONSTANT_LR", "ExperimentResult", "train_model", "write_result"]

#: ``optim`` overrides for :func:`train_model` that train at a constant learning rate
#: without weight decay (the synthetic tasks' recipe: recall, selective copying, induction).
CONSTANT_LR: dict[str, Any] = {"weight_decay": 0.0, "min_lr_ratio": 1.0}


@dataclass
class ExperimentResult:
    """The outcome of one experiment run.

    Attributes:
        name: the experiment's name (``attnlab experiment NAME``).
        title: one line.
        paper: the paper reproduced, with the table or figure compared.
        published: the published result, as transcribed (prose or numbers with source).
        columns: the table's column names.
        rows: one dict per row (keys = columns).
        verdict: whether our figures show the published shape, and where they do not.
        agrees: the verdict as a boolean (None when there is nothing to compare).
        quick: whether this was the ``--quick`` run.
        seed: the seed.
        seconds: wall time.
        settings: sizes, steps and lengths used.
        plot: the plot's file name, once written.
    """

    name: str
    title: str
    paper: str
    published: str
    columns: list[str]
    rows: list[dict[str, Any]]
    verdict: str
    agrees: bool | None
    quick: bool
    seed: int
    seconds: float = 0.0
    settings: dict[str, Any] = field(default_factory=dict)
    plot: str | None = None
    plotter: Callable[[ExperimentResult, Path], None] | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("plotter")
        return _finite(d)

    def markdown(self) -> str:
        head = "| " + " | ".join(self.columns) + " |"
        sep = "|" + "---|" * len(self.columns)
        body = ["| " + " | ".join(_fmt(r.get(c)) for c in self.columns) + " |" for r in self.rows]
        mode = "quick" if self.quick else "full"
        lines = [
            f"# {self.title}",
            "",
            f"Reproduces: {self.paper}",
            "",
            f"Run: `attnlab experiment {self.name}{' --quick' if self.quick else ''}` "
            f"({mode}, seed {self.seed}, {self.seconds:.0f} s)",
            "",
            "Settings: " + ", ".join(f"{k} = {v}" for k, v in self.settings.items()),
            "",
            head,
            sep,
            *body,
            "",
            f"Published: {self.published}",
            "",
            f"Here: {self.verdict}",
        ]
        if self.plot:
            lines += ["", f"![{self.title}]({self.plot})"]
        return "\n".join(lines) + "\n"


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "—"
        return f"{v:.4g}"
    return str(v)


def _finite(x: Any) -> Any:
    """``x`` with non-finite floats replaced by None (strict JSON)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def write_result(result: ExperimentResult, out: Path) -> Path:
    """Write ``results.md``, ``results.json`` and (with matplotlib) ``plot.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    if result.plotter is not None:
        try:
            result.plotter(result, out / "plot.png")
            result.plot = "plot.png"
        except ImportError:  # the viz extra is missing: tables only
            result.plot = None
    (out / "results.json").write_text(
        json.dumps(result.to_dict(), indent=2, allow_nan=False) + "\n"
    )
    (out / "results.md").write_text(result.markdown())
    return out


def train_model(
    model: nn.Module,
    data: dict[str, Any],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    out: Path,
    progress: bool,
    warmup: int | None = None,
    data_obj: Any = None,
    initialise: bool = True,
    optim: dict[str, Any] | None = None,
    stop_when: Any = None,
) -> tuple[Any, Any]:
    """Train ``model`` with attnlab's trainer on the data section ``data``.

    Args:
        optim: further :class:`attnlab.train.config.OptimConfig` fields (weight decay,
            the cosine's floor), over the trainer's defaults.
        stop_when: passed to :meth:`attnlab.train.Trainer.train` (end early).

    Returns:
        ``(trainer, TrainResult)``; the trainer keeps the data (``trainer.data``).
    """
    from attnlab.train import TrainConfig, Trainer

    cfg = TrainConfig.from_dict(
        {
            "model": {"kind": "decoder"},
            "data": data,
            "optim": {
                "lr": lr,
                "warmup_steps": warmup if warmup is not None else steps // 10,
                **(optim or {}),
            },
            "steps": steps,
            "batch_size": batch_size,
            "seed": seed,
            "eval_batches": 4,
            "log_every": max(1, steps // 20),
            "out_dir": str(out),
            "progress": progress,
            "export": False,
        }
    )
    if initialise:
        _initialise(model, seed)
    trainer = Trainer(cfg, model=model, data=data_obj)
    t0 = time.perf_counter()
    result = trainer.train(stop_when=stop_when)
    trainer.close()
    trainer.seconds = time.perf_counter() - t0  # type: ignore[attr-defined]
    return trainer, result


def new_axes() -> tuple[Any, Any]:
    """A 6 x 4 in figure and its axes, without pyplot's global state (as :mod:`attnlab.viz` does)."""
    from attnlab.viz.heatmap import _require_matplotlib

    fig = _require_matplotlib()(figsize=(6, 4), layout="tight")
    return fig, fig.add_subplot()


def save_figure(fig: Any, path: Path) -> None:
    from attnlab.viz.heatmap import save_png

    save_png(fig, path, dpi=120)


def plot_loss_curves(curves: dict[str, list[tuple[int, float]]], path: Path, title: str) -> None:
    """Training loss against step, one labelled line per run."""
    fig, ax = new_axes()
    for label, pts in curves.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats)")
    ax.set_title(title)
    ax.legend()
    save_figure(fig, path)


@torch.no_grad()
def _initialise(model: nn.Module, seed: int) -> None:
    """GPT-2's initialisation for attention decoders (what ``attnlab train`` builds with);
    for other models only the embeddings, keeping their mixers' own initialisation
    (Mamba's ``dt`` bias and ``A``, RWKV's decays)."""
    from attnlab.models import DecoderConfig, DecoderLM
    from attnlab.train.build import init_weights

    torch.manual_seed(seed)
    if isinstance(model, DecoderLM) and isinstance(model.config, DecoderConfig):
        init_weights(model, 0.02)  # not the recurrent presets (MambaLM...): their own
        return
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)


def model_device(model: nn.Module) -> torch.device:
    """Where ``model``'s parameters live (the trainer moves a model to CUDA when it can)."""
    params = getattr(model, "parameters", None)
    p = next(params(), None) if callable(params) else None
    return p.device if p is not None else torch.device("cpu")


@torch.no_grad()
def mean_loss(model: nn.Module, ids: torch.Tensor, *, batch: int = 8) -> float:
    """Mean next-token loss (nats) of a decoder over rows ``ids [N, L]``."""
    model.eval()
    ids = ids.to(model_device(model))
    total, count = 0.0, 0
    for s in range(0, len(ids), batch):
        x = ids[s : s + batch]
        out = model(input_ids=x, labels=x)
        n = x.shape[0] * (x.shape[1] - 1)
        total += float(out.loss) * n
        count += n
    return total / max(count, 1)
