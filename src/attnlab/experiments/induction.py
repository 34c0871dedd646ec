"""Induction heads in a two-layer attention-only model (Olsson et al., 2022).

A decoder with two attention-only layers (no feed-forward) is trained on sequences of
random tokens repeated twice, ``x_1..x_n x_1..x_n``. Loss on the second half can only drop
below chance by copying: the token after the earlier occurrence of the current token. The
run records the loss of each half over training (the drop is the phase change the paper
describes) and finds the induction head automatically by its prefix-matching score: the
attention a query at ``n + i`` pays to key ``i + 1`` (the token that followed the current
token's first occurrence), averaged over positions and sequences (the paper's Figure 7
head detection, "prefix matching"). The best head's attention map is drawn with
:func:`attnlab.viz.heatmap.heatmap_figure`, the function ``attnlab visualize`` draws with.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.experiments._common import (
    ExperimentResult,
    model_device,
    plot_loss_curves,
    train_model,
)

NAME = "induction"
TITLE = "Induction heads: a two-layer attention-only model on repeated random tokens"
PAPER = (
    "Olsson et al. (2022), In-context Learning and Induction Heads, Transformer Circuits "
    "Thread; the two-layer attention-only models of Elhage et al. (2021)"
)
PUBLISHED = (
    "Two-layer attention-only models form induction heads in the second layer (a head "
    "attending from a token to the token after its previous occurrence, with a previous-"
    "token head in layer 1 composing into it); their formation is an abrupt phase change "
    "visible as a bump in the training loss, after which loss on repeated tokens falls far "
    "below chance. One-layer models cannot form them."
)


class NoFeedForward(nn.Module):
    """The feed-forward slot of an attention-only layer: adds nothing to the residual."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.zeros_like(x)


class RepeatedTokens:
    """Data for the trainer: ``n`` random tokens then the same ``n`` again.

    Implements the dataset interface :class:`attnlab.train.Trainer` reads (``train_batch``,
    ``eval_batches``, ``vocab_size``, ``max_length``).
    """

    def __init__(self, *, vocab_size: int, half: int, seed: int) -> None:
        self.vocab_size, self.half, self.seed = vocab_size, half, seed
        self.max_length = 2 * half
        self.token_bytes = None
        self.tokenizer = None

    def _draw(self, count: int, salt: int) -> Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + salt)
        x = torch.randint(0, self.vocab_size, (count, self.half), generator=g)
        return torch.cat([x, x], 1)

    def _batch(self, ids: Tensor) -> Any:
        from attnlab.train.data import Batch, _counted

        return _counted(Batch(input_ids=ids, labels=ids.clone()), None, "decoder")

    def train_batch(self, start: int, count: int) -> Any:
        return self._batch(self._draw(count, start))

    def eval_batches(self, count: int, batch_size: int) -> list[Any]:
        return [self._batch(self._draw(batch_size, (1 << 40) + i)) for i in range(count)]


def _settings(quick: bool, smoke: bool) -> dict[str, Any]:
    if smoke:
        return dict(vocab=16, half=8, hidden=32, heads=2, steps=2, batch=4, probes=4)
    if quick:
        return dict(vocab=64, half=32, hidden=64, heads=4, steps=300, batch=32, probes=64)
    return dict(vocab=256, half=64, hidden=128, heads=8, steps=1500, batch=32, probes=128)


@torch.no_grad()
def half_losses(model: nn.Module, ids: Tensor) -> tuple[float, float]:
    """Mean next-token loss on the first half and on the repeated half (nats)."""
    model.eval()
    n = ids.shape[1] // 2
    ids = ids.to(model_device(model))
    logits = model(input_ids=ids).logits[:, :-1]
    tgt = ids[:, 1:]
    per = nn.functional.cross_entropy(logits.transpose(1, 2), tgt, reduction="none")  # [B, L-1]
    return float(per[:, : n - 1].mean()), float(per[:, n:].mean())


@torch.no_grad()
def prefix_matching_scores(model: nn.Module, ids: Tensor) -> Tensor:
    """``[layers, heads]``: mean attention from query ``n + i`` to key ``i + 1``."""
    model.eval()
    n = ids.shape[1] // 2
    att = model(input_ids=ids.to(model_device(model)), output_attentions=True).attentions
    # layers x [B, H, L, L]
    q = torch.arange(n, 2 * n - 1)
    k = q - n + 1
    return torch.stack([a[:, :, q, k].float().mean(dim=(0, 2)).cpu() for a in att])


def run(
    *, quick: bool = False, smoke: bool = False, out: Path, seed: int = 0, progress: bool = True
) -> ExperimentResult:
    from attnlab.models import DecoderConfig, DecoderLM

    s = _settings(quick, smoke)
    t0 = time.perf_counter()
    data = RepeatedTokens(vocab_size=s["vocab"], half=s["half"], seed=seed)
    probe = data._draw(s["probes"], 1 << 41)
    rows: list[dict[str, Any]] = []
    curves: dict[str, list[tuple[int, float]]] = {}
    best: dict[str, Any] = {}
    for layers in (1, 2):
        torch.manual_seed(seed)
        cfg = DecoderConfig(
            vocab_size=s["vocab"],
            hidden_size=s["hidden"],
            num_hidden_layers=layers,
            num_attention_heads=s["heads"],
            intermediate_size=s["hidden"],
            max_position_embeddings=max(2048, 2 * s["half"]),
            position_embedding="rope",
        )
        model = DecoderLM(cfg)
        for layer in model.layers:
            layer.feed_forward = NoFeedForward()  # attention-only (Elhage et al., 2021)
        before = half_losses(model, probe)
        trainer, _ = train_model(
            model,
            {"source": "synthetic"},
            steps=s["steps"],
            batch_size=s["batch"],
            lr=3e-3,
            seed=seed,
            out=out / "runs" / f"{layers}-layer",
            progress=progress,
            data_obj=data,
        )
        curves[f"{layers} layer(s)"] = [
            (h["step"], h["loss"]) for h in trainer.history if "loss" in h
        ]
        first, second = half_losses(model, probe)
        scores = prefix_matching_scores(model, probe)
        li, hi = divmod(int(scores.argmax()), scores.shape[1])
        rows.append(
            {
                "layers": layers,
                "loss_first_half": first,
                "loss_repeated_half": second,
                "repeated_half_at_init": before[1],
                "chance": math.log(s["vocab"]),
                "best_head": f"L{li}H{hi}",
                "prefix_matching": float(scores.max()),
            }
        )
        if layers == 2:
            best = {"model": model, "layer": li, "head": hi, "scores": scores}
    two, one = rows[1], rows[0]
    agrees = (
        two["loss_repeated_half"] < 0.5 * two["chance"]
        and two["prefix_matching"] > 0.3
        and two["prefix_matching"] > one["prefix_matching"]
    )
    verdict = (
        f"two layers: repeated-half loss {two['loss_repeated_half']:.2f} nats against chance "
        f"{two['chance']:.2f} (first half {two['loss_first_half']:.2f}); the induction head "
        f"found is {two['best_head']} with prefix-matching score {two['prefix_matching']:.2f}; "
        f"one layer: {one['loss_repeated_half']:.2f} nats, best score "
        f"{one['prefix_matching']:.2f}. "
        + (
            "As published: induction heads form with two layers, not with one."
            if agrees
            else "Not the published outcome on this run."
        )
    )
    return ExperimentResult(
        name=NAME,
        title=TITLE,
        paper=PAPER,
        published=PUBLISHED,
        columns=[
            "layers",
            "loss_first_half",
            "loss_repeated_half",
            "repeated_half_at_init",
            "chance",
            "best_head",
            "prefix_matching",
        ],
        rows=rows,
        verdict=verdict,
        agrees=agrees,
        quick=quick,
        seed=seed,
        seconds=time.perf_counter() - t0,
        settings=dict(s),
        plotter=lambda r, p: _plot(curves, best, probe, p),
    )


def _plot(
    curves: dict[str, list[tuple[int, float]]], best: dict[str, Any], probe: Tensor, path: Path
) -> None:
    from attnlab.viz.heatmap import heatmap_figure, save_png

    plot_loss_curves(curves, path, "Attention-only models on repeated random tokens")
    # the detected induction head's attention on one repeated sequence
    model, li, hi = best["model"], best["layer"], best["head"]
    ids = probe[:1, : min(probe.shape[1], 32)]
    half = ids.shape[1] // 2
    ids = torch.cat([ids[:, :half], ids[:, :half]], 1)
    with torch.no_grad():
        w = model(input_ids=ids.to(model_device(model)), output_attentions=True)
        w = w.attentions[li][0, hi].cpu()
    toks = [str(int(t)) for t in ids[0]]
    hm = heatmap_figure(w, toks, title=f"induction head L{li}H{hi} (prefix matching)")
    save_png(hm, path.with_name("induction_head.png"))
