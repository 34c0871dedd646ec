"""Context extension without fine-tuning: RoPE scalings past SmolLM2's trained context.

Chen et al., 2023 (position interpolation, arXiv:2306.15595); bloc97, 2023 (NTK-aware
scaling, its dynamic form in transformers); Peng et al., 2023 (YaRN, arXiv:2309.00071).

One long stretch of Python's documentation, longer than the model's trained context
``L`` (SmolLM2-135M: 8192 tokens), is scored at every position with four rotary
embeddings swapped into every attention layer, the weights unchanged:

* ``none``: the trained RoPE (``rope_theta`` 100 000), read past ``L``;
* ``linear``: position interpolation, every frequency divided by ``factor``;
* ``dynamic``: dynamic NTK, the base raised with the current length beyond ``L``;
* ``yarn``: YaRN with ``original_max_position_embeddings = L`` (its ramp and attention
  factor ``0.1 ln(factor) + 1``).

The frequencies are :func:`attnlab.functional.positions.rope_inv_freq`'s, checked against
transformers' ``ROPE_INIT_FUNCTIONS`` in the tests with these parameters. The text is fed
in chunks through a KV cache (as a long prompt is prefilled); for dynamic NTK each chunk's
frequencies come from its last position and the cached keys keep theirs, which is what
transformers does while it generates.

Verdict rule (written before the run): ``past`` is the perplexity over positions
``L .. T-1``, ``before`` the unscaled model's over ``L/2 .. L-1`` (the same document, in the
trained range). The claim holds here when ``none``'s ``past`` is at least twice
``before``, each scaled variant's ``past`` is at most 1.25 x ``before``, and YaRN's
``past`` is the lowest of the three scaled variants.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.experiments import _real
from attnlab.experiments._common import ExperimentResult
from attnlab.experiments._real import doc_tokens, next_token_nll

NAME = "context"
TITLE = "Context extension: RoPE read past its trained length, and three scalings"
PAPER = (
    'Chen et al., 2023, "Extending Context Window of Large Language Models via Positional '
    'Interpolation" (arXiv:2306.15595); bloc97, 2023, NTK-aware scaled RoPE; Peng et al., '
    '2023, "YaRN: Efficient Context Window Extension of Large Language Models" '
    "(arXiv:2309.00071), Table 1"
)
PUBLISHED = (
    "Llama 2 7B (trained at 4096) on Proof-pile without fine-tuning: unscaled RoPE's "
    "perplexity explodes past the trained length; position interpolation and NTK-aware "
    "scaling degrade gracefully; YaRN without fine-tuning gives the lowest perplexity "
    "past it of the three (Peng et al., Figure 1 and section 3, as transcribed)."
)

VARIANTS = ("none", "linear", "dynamic", "yarn")


def _settings(quick: bool, smoke: bool) -> dict[str, Any]:
    if smoke:  # a pipeline check on a pretend trained length (results mean nothing)
        return {"tokens": 96, "trained": 64, "factor": 2.0, "chunk": 32, "bucket": 16}
    if quick:  # 1.25x the trained context
        return {"tokens": 10240, "trained": 8192, "factor": 2.0, "chunk": 512, "bucket": 512}
    return {"tokens": 16384, "trained": 8192, "factor": 2.0, "chunk": 512, "bucket": 1024}


def scaling_for(variant: str, *, factor: float, trained: int) -> dict[str, Any] | None:
    """transformers-style ``rope_parameters`` of ``variant`` (None: the trained RoPE).

    Raises:
        ValueError: an unknown variant.
    """
    if variant == "none":
        return None
    if variant in ("linear", "dynamic"):
        return {"rope_type": variant, "factor": factor}
    if variant == "yarn":
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": trained}
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


@contextmanager
def swapped_rope(
    model: nn.Module, scaling: Mapping[str, Any] | None, *, trained: int
) -> Iterator[nn.Module]:
    """Give every attention layer of ``model`` a RotaryEmbedding with ``scaling`` (same
    dim, base and convention, ``max_position_embeddings = trained``); restore on exit."""
    from attnlab.modules.positions import RotaryEmbedding

    saved: list[tuple[nn.Module, nn.Module]] = []
    new: dict[int, nn.Module] = {}  # one replacement per shared original
    try:
        for layer in model.layers:  # type: ignore[union-attr]
            attn = getattr(layer, "self_attention", None)
            old = getattr(attn, "rotary", None)
            if not isinstance(old, RotaryEmbedding):
                continue
            if id(old) not in new:
                new[id(old)] = RotaryEmbedding(
                    dim=old.dim,
                    base=old.base,
                    scaling=scaling,
                    max_position_embeddings=trained,
                    convention=old.convention,
                ).to(old.inv_freq.device)
            saved.append((attn, old))  # type: ignore[arg-type]
            attn.rotary = new[id(old)]  # type: ignore[union-attr]
        if not saved:
            raise ValueError("swapped_rope needs a model whose attention layers use RoPE")
        yield model
    finally:
        for attn, old in saved:
            attn.rotary = old  # type: ignore[assignment]


@torch.no_grad()
def chunked_nll(model: nn.Module, ids: Tensor, *, chunk: int, progress: bool = False) -> Tensor:
    """NLL (nats, float64) of tokens ``1 .. T-1`` of ``ids [1, T]``, the text fed ``chunk``
    tokens at a time through one KV cache (``[T - 1]``)."""
    from tqdm import tqdm

    t = ids.shape[1]
    cache = model.new_cache()  # type: ignore[operator]
    out = torch.empty(t - 1, dtype=torch.float64)
    for a in tqdm(range(0, t - 1, chunk), disable=not progress, leave=False):
        b = min(a + chunk, t - 1)
        logits = model(ids[:, a:b], past_key_values=cache, use_cache=True).logits
        out[a:b] = next_token_nll(logits, ids[:, a + 1 : b + 1])[0]
    return out


def _ppl(nll: Tensor) -> float:
    return float(nll.mean().exp())


def run(*, quick: bool, smoke: bool, out: Path, seed: int, progress: bool) -> ExperimentResult:
    """Score the text with each variant and return the result (``seed`` is unused)."""
    del out, seed
    s = _settings(quick, smoke)
    t0 = time.perf_counter()
    model = _real.load_smollm2()
    ids = doc_tokens(model.tokenizer, s["tokens"])
    trained, factor = s["trained"], s["factor"]
    curves: dict[str, Tensor] = {}
    seconds: dict[str, float] = {}
    for v in VARIANTS:
        start = time.perf_counter()
        with swapped_rope(model, scaling_for(v, factor=factor, trained=trained), trained=trained):
            curves[v] = chunked_nll(model, ids, chunk=s["chunk"], progress=progress)
        seconds[v] = time.perf_counter() - start
    # the NLL at index i is that of token i + 1, at position i + 1
    past = slice(trained - 1, None)
    before_range = slice(trained // 2 - 1, trained - 1)
    before = _ppl(curves["none"][before_range])
    rows: list[dict[str, Any]] = [
        {
            "rope": v,
            "ppl_before": _ppl(curves[v][before_range]),
            "ppl_past": _ppl(curves[v][past]),
            "past_over_before": _ppl(curves[v][past]) / before,
            "seconds": seconds[v],
        }
        for v in VARIANTS
    ]
    past_ppl = {v: _ppl(curves[v][past]) for v in VARIANTS}
    scaled = ("linear", "dynamic", "yarn")
    blows = past_ppl["none"] >= 2 * before
    graceful = all(past_ppl[v] <= 1.25 * before for v in scaled)
    yarn_best = min(scaled, key=lambda v: past_ppl[v]) == "yarn"
    agrees = blows and graceful and yarn_best
    ratios = ", ".join(f"{v} {past_ppl[v] / before:.2f}x" for v in VARIANTS)
    verdict = (
        f"{'agrees' if agrees else 'does not agree'}: past the trained {trained} tokens "
        f"(to {s['tokens']}, factor {factor:g}), perplexity over the unscaled model's "
        f"{before:.2f} at {trained // 2}-{trained}: {ratios} (the rule asks none >= 2x, "
        f"every scaled variant <= 1.25x, YaRN lowest of the scaled; "
        f"{'met' if blows else 'not met'}, {'met' if graceful else 'not met'}, "
        f"{'met' if yarn_best else 'not met'})"
    )
    settings = dict(s) | {"model": "SmolLM2-135M-Instruct", "text": "pydoc_data.topics"}
    settings["ppl_before_unscaled"] = before
    return ExperimentResult(
        name=NAME,
        title=TITLE,
        paper=PAPER,
        published=PUBLISHED,
        columns=["rope", "ppl_before", "ppl_past", "past_over_before", "seconds"],
        rows=rows,
        verdict=verdict,
        agrees=agrees,
        quick=quick,
        seed=0,
        seconds=time.perf_counter() - t0,
        settings=settings,
        plotter=lambda result, path: _plot(curves, s, path),
    )


def _plot(curves: dict[str, Tensor], s: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bucket = s["bucket"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for v, c in curves.items():
        n = len(c) // bucket
        ppl = c[: n * bucket].view(n, bucket).mean(1).exp()
        centres = [(i + 0.5) * bucket for i in range(n)]
        ax.plot(centres, ppl.numpy(), marker=".", label=v)
    ax.axvline(s["trained"], ls=":", c="grey")
    ax.set_xlabel(f"token position (trained context {s['trained']} at the dotted line)")
    ax.set_ylabel(f"perplexity per {bucket} tokens")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(f"SmolLM2-135M on Python's docs: RoPE scalings, factor {s['factor']:g}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
