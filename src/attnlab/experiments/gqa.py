"""Uptraining a multi-head model into grouped-query attention (Ainslie et al., 2023).

A byte-level decoder with multi-head attention (MHA) is trained on the standard library's
source. Its key and value projections are then mean-pooled into ``G`` groups (GQA-G; the
paper's conversion, section 2.1: "the projection matrices of each group are mean-pooled"),
for G = heads/2, heads/4, 2 and 1 (MQA), and each converted model is uptrained for a small
share of the original steps (the paper uses 5 %). Quality (held-out bits per byte) is
plotted against the KV-cache bytes per token each layout needs.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import torch

from attnlab.experiments._common import (
    ExperimentResult,
    mean_loss,
    new_axes,
    save_figure,
    train_model,
)

NAME = "gqa"
TITLE = "GQA: mean-pooled key/value heads, uptrained, against KV-cache bytes"
PAPER = (
    "Ainslie et al. (2023), GQA: Training Generalized Multi-Query Transformer Models from "
    "Multi-Head Checkpoints, EMNLP; section 2.1 (conversion), Figure 3 and Table 1"
)
PUBLISHED = (
    "T5-XXL uptrained with 5 % of pre-training compute: GQA-8 comes close to MHA quality "
    "at close to MQA speed, MQA loses more quality; mean-pooling is the best conversion "
    "(Figure 4), and quality recovers quickly with uptraining (Figure 5)."
)


def _settings(quick: bool, smoke: bool) -> dict[str, Any]:
    if smoke:
        return dict(
            layers=1,
            hidden=32,
            heads=4,
            seq=32,
            steps=2,
            batch=4,
            uptrain=1,
            train_bytes=200_000,
            eval_rows=4,
        )
    if quick:
        return dict(
            layers=2,
            hidden=64,
            heads=8,
            seq=64,
            steps=200,
            batch=16,
            uptrain=10,
            train_bytes=1_000_000,
            eval_rows=32,
        )
    return dict(
        layers=4,
        hidden=128,
        heads=8,
        seq=128,
        steps=1500,
        batch=16,
        uptrain=75,
        train_bytes=8_000_000,
        eval_rows=128,
    )


def mean_pool_kv(model: torch.nn.Module, groups: int) -> torch.nn.Module:
    """A copy of ``model`` whose key/value heads are mean-pooled into ``groups`` heads.

    Args:
        model: a :class:`~attnlab.models.DecoderLM` whose query heads divide by ``groups``.
        groups: key/value heads after conversion (1 = MQA).
    """
    from attnlab.models import DecoderLM

    cfg: Any = model.config
    heads = cfg.num_attention_heads
    kv = cfg.num_key_value_heads or heads
    if heads % groups or groups > kv or kv % groups:
        raise ValueError(
            f"groups ({groups}) must divide the model's key/value heads ({kv}) and query "
            f"heads ({heads})"
        )
    new = DecoderLM(dataclasses.replace(cfg, num_key_value_heads=groups))
    state = copy.deepcopy(model.state_dict())
    e = cfg.head_dim or cfg.hidden_size // heads
    for name in list(state):
        if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            w = state[name]
            rest = w.shape[1:]
            # [kv * E, ...] -> [groups, kv / groups, E, ...] -> mean over each group's heads
            state[name] = (
                w.reshape(groups, kv // groups, e, *rest).mean(1).reshape(groups * e, *rest)
            )
    new.load_state_dict(state)
    return new


def run(
    *, quick: bool = False, smoke: bool = False, out: Path, seed: int = 0, progress: bool = True
) -> ExperimentResult:
    from attnlab.models import DecoderConfig, DecoderLM
    from attnlab.train import DataConfig
    from attnlab.train.data import build_data

    s = _settings(quick, smoke)
    t0 = time.perf_counter()
    data = {
        "source": "stdlib",
        "tokenizer": "bytes",
        "seq_len": s["seq"],
        "document_mask": False,
        "max_train_bytes": s["train_bytes"],
        "max_eval_bytes": s["eval_rows"] * s["seq"] * 2,
    }
    held = build_data(DataConfig.from_dict(data, "data"), kind="decoder", seed=seed)
    eval_ids = held.eval_ids[: s["eval_rows"]]  # type: ignore[union-attr]
    torch.manual_seed(seed)
    cfg = DecoderConfig(
        vocab_size=256,
        hidden_size=s["hidden"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        intermediate_size=4 * s["hidden"],
        max_position_embeddings=max(2048, s["seq"]),
    )
    mha = DecoderLM(cfg)
    train_model(
        mha,
        data,
        steps=s["steps"],
        batch_size=s["batch"],
        lr=3e-3,
        seed=seed,
        out=out / "runs" / "mha",
        progress=progress,
    )
    e = s["hidden"] // s["heads"]
    bpt = lambda g: 2 * s["layers"] * g * e * 4  # noqa: E731 - KV bytes per token, float32
    base = mean_loss(mha, eval_ids) / math.log(2)
    rows: list[dict[str, Any]] = [
        {
            "layout": f"MHA ({s['heads']} kv heads)",
            "kv_heads": s["heads"],
            "kv_bytes_per_token": bpt(s["heads"]),
            "converted_bpb": base,
            "uptrained_bpb": base,
        }
    ]
    for g in sorted({s["heads"] // 2, s["heads"] // 4, 2, 1}, reverse=True):
        if g < 1 or g >= s["heads"]:
            continue
        model = mean_pool_kv(mha, g)
        converted = mean_loss(model, eval_ids) / math.log(2)
        train_model(
            model,
            data,
            steps=s["uptrain"],
            batch_size=s["batch"],
            lr=1e-3,
            seed=seed + 1,
            out=out / "runs" / f"gqa{g}",
            progress=progress,
            warmup=0,
            initialise=False,  # uptrain the converted weights, never a fresh draw
        )
        uptrained = mean_loss(model, eval_ids) / math.log(2)
        label = "MQA" if g == 1 else f"GQA-{g}"
        rows.append(
            {
                "layout": label,
                "kv_heads": g,
                "kv_bytes_per_token": bpt(g),
                "converted_bpb": converted,
                "uptrained_bpb": uptrained,
            }
        )

    mqa = rows[-1]
    mid = [r for r in rows[1:-1]]
    gap_mid = max((r["uptrained_bpb"] - base) / base for r in mid) if mid else 0.0
    gap_mqa = (mqa["uptrained_bpb"] - base) / base
    recovered = all(r["uptrained_bpb"] <= r["converted_bpb"] + 1e-9 for r in rows[1:])
    agrees = recovered and gap_mid <= gap_mqa + 0.01
    verdict = (
        f"uptraining on {s['uptrain']} steps ({s['uptrain'] / s['steps']:.0%} of the "
        f"{s['steps']} MHA steps) {'recovered' if recovered else 'did not always recover'} "
        f"quality after mean-pooling; the worst GQA is {gap_mid:+.1%} from MHA in bits per "
        f"byte, MQA {gap_mqa:+.1%}, for {rows[0]['kv_bytes_per_token'] // mqa['kv_bytes_per_token']}x "
        "less KV cache. "
        + (
            "As published: GQA sits between MHA and MQA."
            if agrees
            else "Not the published ordering on this run."
        )
    )
    return ExperimentResult(
        name=NAME,
        title=TITLE,
        paper=PAPER,
        published=PUBLISHED,
        columns=["layout", "kv_heads", "kv_bytes_per_token", "converted_bpb", "uptrained_bpb"],
        rows=rows,
        verdict=verdict,
        agrees=agrees,
        quick=quick,
        seed=seed,
        seconds=time.perf_counter() - t0,
        settings=dict(s),
        plotter=lambda r, p: _plot(rows, p),
    )


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    fig, ax = new_axes()
    xs = [r["kv_bytes_per_token"] for r in rows]
    ax.plot(xs, [r["converted_bpb"] for r in rows], "o--", label="mean-pooled, no uptraining")
    ax.plot(xs, [r["uptrained_bpb"] for r in rows], "o-", label="uptrained")
    for r in rows:
        ax.annotate(
            r["layout"].split(" ")[0],
            (r["kv_bytes_per_token"], r["uptrained_bpb"]),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=8,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV-cache bytes per token (float32)")
    ax.set_ylabel("held-out bits per byte")
    ax.legend()
    save_figure(fig, path)
