"""Induction heads in a trained decoder (Olsson et al., 2022), found in SmolLM2-135M-Instruct.

Rows of ``m`` random tokens repeated once. For every head:

* prefix matching: the attention from each token of the repeat to the token that followed
  its first occurrence (the score :func:`attnlab.experiments.induction.prefix_matching_scores`
  computes for the trained-from-scratch experiment: one implementation for both);
* copying: whether the head's OV circuit raises the logit of the token it attends to,
  ``sum(Re λ) / sum(|λ|)`` over the eigenvalues ``λ`` of ``W_U W_O W_V W_E`` (Elhage et al.,
  2021, "A Mathematical Framework for Transformer Circuits"; +1 is a pure copier), with the
  layer's input norm and the final norm's weights folded in (their positive per-token
  scales do not change the sign).

Induction heads are the heads with prefix matching >= 0.3 and copying > 0. Ablation
zeroes their outputs (the head's slice of the output projection's input) and measures the
repeat's loss, against zeroing as many heads drawn at random from the others.

Verdict rule (written before the run): the claim holds here when at least one induction
head exists outside the first layer, and ablating them raises the repeat's loss by at
least twice the mean rise of the random draws and by more than the largest random draw.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.experiments import _real
from attnlab.experiments._common import ExperimentResult
from attnlab.experiments.induction import half_losses, prefix_matching_scores

NAME = "induction-real"
TITLE = "Induction heads in a trained decoder: where they are and what ablating them costs"
PAPER = 'Olsson et al., 2022, "In-context Learning and Induction Heads" (arXiv:2209.11895)'
PUBLISHED = (
    "Every trained multi-layer transformer studied has induction heads (prefix matching "
    "and copying on repeated random tokens), from the second layer on; ablating them "
    "removes most of the in-context loss drop on repeated sequences, far more than "
    "ablating other heads (Arguments 2-4, as transcribed)."
)

PREFIX_THRESHOLD = 0.3


def _settings(quick: bool, smoke: bool) -> dict[str, Any]:
    if smoke:
        return {"rows": 2, "period": 12, "random_draws": 2, "max_heads": 4}
    if quick:
        return {"rows": 8, "period": 48, "random_draws": 6, "max_heads": 12}
    return {"rows": 32, "period": 128, "random_draws": 30, "max_heads": 12}


def repeated_rows(rows: int, period: int, *, low: int, high: int, seed: int) -> Tensor:
    """``[rows, 2 * period]`` long: ``period`` tokens drawn from ``[low, high)``, twice."""
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(low, high, (rows, period), generator=g)
    return torch.cat((first, first), dim=1)


def _attention_modules(model: Any) -> list[Any]:
    return [layer.self_attention for layer in model.layers]


@torch.no_grad()
def copying_scores(model: Any) -> Tensor:
    """``[layers, heads]``: ``sum(Re λ) / sum(|λ|)`` of each head's OV circuit (see the module
    docstring), computed through the ``head_dim x head_dim`` matrix with the same nonzero
    eigenvalues."""
    embed = model.embed_tokens.weight.double()  # [V, D]
    head = model.lm_head  # None when tied to the embedding
    unembed = embed if head is None else head.weight.double()
    gram = embed.T @ unembed  # [D, D]: sum over the vocabulary of e_v u_v^T
    final = getattr(model.norm, "weight", None)
    out = []
    for layer, attn in zip(model.layers, _attention_modules(model)):
        norm = getattr(layer.self_attn_norm, "weight", None)
        g = gram
        if norm is not None:
            g = norm.double()[:, None] * g
        if final is not None:
            g = g * final.double()[None]
        heads, kv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
        wv = attn.v_proj.weight.double()  # [kv * hd, D]
        wo = attn.out_proj.weight.double()  # [D, heads * hd]
        row = []
        for h in range(heads):
            v = wv[(h // (heads // kv)) * hd : (h // (heads // kv) + 1) * hd]  # [hd, D]
            o = wo[:, h * hd : (h + 1) * hd]  # [D, hd]
            lam = torch.linalg.eigvals(v @ g @ o)  # [hd]: nonzero eigenvalues of U O V E^T
            row.append(float(lam.real.sum() / lam.abs().sum().clamp_min(1e-30)))
        out.append(torch.tensor(row))
    return torch.stack(out)


@contextmanager
def ablated(model: Any, heads: list[tuple[int, int]]) -> Iterator[None]:
    """Zero the outputs of ``heads`` (``(layer, head)`` pairs) inside the block."""
    by_layer: dict[int, list[int]] = {}
    for li, hi in heads:
        by_layer.setdefault(li, []).append(hi)
    handles = []
    attns = _attention_modules(model)
    for li, hs in by_layer.items():
        hd = attns[li].head_dim

        def zero(_: nn.Module, args: tuple[Tensor, ...], hs: list[int] = hs, hd: int = hd) -> Any:
            x = args[0].clone()  # [B, L, heads * hd]
            for h in hs:
                x[..., h * hd : (h + 1) * hd] = 0
            return (x, *args[1:])

        handles.append(attns[li].out_proj.register_forward_pre_hook(zero))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def run(*, quick: bool, smoke: bool, out: Path, seed: int, progress: bool) -> ExperimentResult:
    """Find SmolLM2's induction heads and ablate them against random heads."""
    del out, progress
    s = _settings(quick, smoke)
    t0 = time.perf_counter()
    model = _real.load_smollm2()
    vocab = model.config.vocab_size
    ids = repeated_rows(s["rows"], s["period"], low=256, high=vocab - 256, seed=seed)
    period = torch.full((s["rows"],), s["period"])
    prefix = prefix_matching_scores(model, ids, period)  # [layers, heads]
    copying = copying_scores(model)
    layers, heads = prefix.shape
    found = [
        (li, hi)
        for li in range(layers)
        for hi in range(heads)
        if prefix[li, hi] >= PREFIX_THRESHOLD and copying[li, hi] > 0
    ]
    found.sort(key=lambda lh: -float(prefix[lh]))
    ablate = found[: s["max_heads"]]
    _, base = half_losses(model, ids, period)
    with ablated(model, ablate):
        _, loss_ind = half_losses(model, ids, period)
    others = [(li, hi) for li in range(layers) for hi in range(heads) if (li, hi) not in found]
    g = torch.Generator().manual_seed(seed + 1)
    rises = []
    for _ in range(s["random_draws"]):
        pick = torch.randperm(len(others), generator=g)[: len(ablate)].tolist()
        with ablated(model, [others[i] for i in pick]):
            rises.append(half_losses(model, ids, period)[1] - base)
    rise_ind = loss_ind - base
    mean_rand = sum(rises) / max(len(rises), 1)
    agrees = (
        any(li > 0 for li, _ in found)
        and rise_ind >= 2 * mean_rand
        and rise_ind > max(rises, default=0.0)
    )
    rows = [
        {
            "layer": li,
            "head": hi,
            "prefix_matching": float(prefix[li, hi]),
            "copying": float(copying[li, hi]),
            "ablated": (li, hi) in ablate,
        }
        for li, hi in found
    ]
    verdict = (
        f"{'agrees' if agrees else 'does not agree'}: {len(found)} induction heads "
        f"(prefix matching >= {PREFIX_THRESHOLD}, copying > 0) in layers "
        f"{sorted({li for li, _ in found})}; the repeat's loss is {base:.3f} nats, "
        f"{loss_ind:.3f} with the top {len(ablate)} ablated (+{rise_ind:.3f}) against "
        f"+{mean_rand:.3f} on average (max +{max(rises, default=0.0):.3f}) for "
        f"{len(rises)} draws of as many random heads"
    )
    settings = dict(s) | {"model": "SmolLM2-135M-Instruct", "threshold": PREFIX_THRESHOLD}
    return ExperimentResult(
        name=NAME,
        title=TITLE,
        paper=PAPER,
        published=PUBLISHED,
        columns=["layer", "head", "prefix_matching", "copying", "ablated"],
        rows=rows,
        verdict=verdict,
        agrees=agrees,
        quick=quick,
        seed=seed,
        seconds=time.perf_counter() - t0,
        settings=settings | {"loss_repeat": base, "loss_ablated": loss_ind, "random_rises": rises},
        plotter=lambda result, path: _plot(prefix, copying, path),
    )


def _plot(prefix: Tensor, copying: Tensor, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2))
    for ax, data, title in (
        (axes[0], prefix, "prefix matching"),
        (axes[1], copying, "copying (OV eigenvalues)"),
    ):
        im = ax.imshow(data.T.numpy(), aspect="auto", cmap="viridis" if ax is axes[0] else "RdBu")
        ax.set_xlabel("layer")
        ax.set_ylabel("head")
        ax.set_title(title)
        fig.colorbar(im, ax=ax)
    fig.suptitle("SmolLM2-135M-Instruct: heads on repeated random tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
