"""Context extension without fine-tuning: RoPE scalings past SmolLM2's trained context.

Chen et al., 2023 (position interpolation, arXiv:2306.15595); bloc97, 2023 (NTK-aware
scaling, its dynamic form in transformers); Peng et al., 2023 (YaRN, arXiv:2309.00071).

One long stretch of Python's documentation, longer than the model's trained context
``L`` (SmolLM2-135M: 8192 tokens), is scored at every position with four rotary
embeddings swapped into every attention layer, the weights unchanged:

* ``none``: the trained RoPE (``rope_theta`` 100 000), read past ``L``;
* ``linear``: position interpolation, every frequency divided by ``factor``;
* ``dynamic``: dynamic NTK, the base raised with the length of the sequence beyond ``L``;
* ``yarn``: YaRN with ``original_max_position_embeddings = L`` (its ramp and attention
  factor ``0.1 ln(factor) + 1``).

The frequencies are :func:`attnlab.functional.positions.rope_inv_freq`'s, checked against
transformers' ``ROPE_INIT_FUNCTIONS`` in the tests with these parameters. The static
scalings feed the text in chunks through one KV cache (as a long prompt is prefilled).
Dynamic NTK has no single set of frequencies for a long text: a forward over ``n`` tokens
rotates every query and key with the base for ``n`` (transformers' dynamic rotary, one
forward of that length). So it is scored span by span: the tokens of each span of
``span`` positions past ``L`` come from a forward over the whole prefix up to the span's
end, every key rotated with that length's base (:func:`dynamic_nll`); within ``L`` it is
the trained RoPE. (Feeding the text through one cache while the base changes chunk by
chunk, as transformers does while it generates, leaves the cached keys rotated with older
bases than the queries: the first full run did that and measured the mismatch, 18x.)

Full run: ``2 L`` contiguous tokens. Quick run (a long text costs a long forward, which
two minutes do not allow): the text's first ``S`` tokens at positions ``0 .. S-1`` and the
next ``S`` placed so that they end at position ``2 L`` (the full run's last position),
the positions in between left empty, so that the second segment's queries see keys as
far back as in the full run (RoPE depends on the distance only); the same segment placed
to end at ``L`` is the reference inside the trained range (:func:`gapped_nll`).

Verdict rule (written before the runs; the quick run's before its first run): ``past`` is
the perplexity over positions ``L .. T-1`` (quick: the second segment placed past ``L``),
``before`` the unscaled model's over ``L/2 .. L-1`` (quick: the second segment placed to
end at ``L``). The claim holds here when ``none``'s ``past`` is at least twice ``before``,
each scaled variant's ``past`` is at most 1.25 x ``before``, and YaRN's ``past`` is the
lowest of the three scaled variants.
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
    base = {"trained": 8192, "factor": 2.0}
    if smoke:  # a pipeline check on a pretend trained length (results mean nothing)
        base = {"trained": 64, "factor": 2.0}
        if quick:
            return base | {"mode": "gapped", "segment": 16, "bucket": 4}
        return base | {"mode": "contiguous", "tokens": 96, "chunk": 32, "span": 16, "bucket": 16}
    if quick:  # two segments of 1024 tokens, the second ending at 2 L
        return base | {"mode": "gapped", "segment": 1024, "bucket": 64}
    return base | {
        "mode": "contiguous",
        "tokens": 16384,
        "chunk": 512,
        "span": 2048,
        "bucket": 1024,
    }


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
    model: nn.Module,
    scaling: Mapping[str, Any] | None,
    *,
    trained: int,
    length: int | None = None,
) -> Iterator[nn.Module]:
    """Give every attention layer of ``model`` a RotaryEmbedding with ``scaling`` (same
    dim, base and convention, ``max_position_embeddings = trained``); restore on exit.

    ``length`` (dynamic NTK only) fixes the frequencies to those of a ``length``-token
    sequence for every position and call, as transformers' dynamic rotary rotates one
    forward of that length; without it each call takes its own last position's.

    Raises:
        ValueError: a model without RoPE layers; ``length`` with another scaling.
    """
    from attnlab.functional.positions import dynamic_ntk_base
    from attnlab.modules.positions import RotaryEmbedding

    if length is not None and (scaling or {}).get("rope_type") != "dynamic":
        raise ValueError(f"length fixes dynamic NTK's frequencies only, got scaling {scaling}")

    def replacement(old: RotaryEmbedding) -> RotaryEmbedding:
        if length is None:
            return RotaryEmbedding(
                dim=old.dim,
                base=old.base,
                scaling=scaling,
                max_position_embeddings=trained,
                convention=old.convention,
            )
        factor = float((scaling or {})["factor"])
        base = dynamic_ntk_base(old.dim, old.base, factor, trained, length)
        # one fixed base: the plain RoPE with it (no per-call recomputation)
        return RotaryEmbedding(dim=old.dim, base=base, convention=old.convention)

    saved: list[tuple[nn.Module, nn.Module]] = []
    new: dict[int, nn.Module] = {}  # one replacement per shared original
    try:
        for layer in model.layers:  # type: ignore[union-attr]
            attn = getattr(layer, "self_attention", None)
            old = getattr(attn, "rotary", None)
            if not isinstance(old, RotaryEmbedding):
                continue
            if id(old) not in new:
                new[id(old)] = replacement(old).to(old.inv_freq.device)
            saved.append((attn, old))  # type: ignore[arg-type]
            attn.rotary = new[id(old)]  # type: ignore[union-attr]
        if not saved:
            raise ValueError("swapped_rope needs a model whose attention layers use RoPE")
        yield model
    finally:
        for attn, old in saved:
            attn.rotary = old  # type: ignore[assignment]


@torch.no_grad()
def chunked_nll(
    model: nn.Module, ids: Tensor, *, chunk: int, start: int = 0, progress: bool = False
) -> Tensor:
    """NLL (nats, float64) of tokens ``start + 1 .. T-1`` of ``ids [1, T]``, the text fed
    ``chunk`` tokens at a time through one KV cache (``[T - 1 - start]``); the first
    ``start`` tokens are read without their logits."""
    from tqdm import tqdm

    t = ids.shape[1]
    cache = model.new_cache()  # type: ignore[operator]
    for a in range(0, start, chunk):
        model(
            ids[:, a : min(a + chunk, start)],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
    out = torch.empty(t - 1 - start, dtype=torch.float64)
    for a in tqdm(range(start, t - 1, chunk), disable=not progress, leave=False):
        b = min(a + chunk, t - 1)
        logits = model(ids[:, a:b], past_key_values=cache, use_cache=True).logits
        out[a - start : b - start] = next_token_nll(logits, ids[:, a + 1 : b + 1])[0]
    return out


@torch.no_grad()
def dynamic_nll(
    model: nn.Module,
    ids: Tensor,
    trained_nll: Tensor,
    *,
    factor: float,
    trained: int,
    chunk: int,
    span: int,
    progress: bool = False,
) -> Tensor:
    """Dynamic NTK's NLL of tokens ``1 .. T-1`` of ``ids [1, T]`` (``[T - 1]``, float64).

    Within ``trained`` positions dynamic NTK is the trained RoPE, whose NLL
    ``trained_nll [T - 1]`` is taken as it is. Past it, the inputs at positions
    ``a .. b-1`` of each span (``a = trained, trained + span, ...``) are scored by a
    forward over positions ``0 .. b-1`` whose every query and key is rotated with the base
    for ``b`` tokens (:func:`swapped_rope` with ``length=b``): what transformers' dynamic
    rotary computes for one forward of ``b`` tokens.
    """
    from tqdm import tqdm

    t = ids.shape[1]
    out = trained_nll.clone()
    scaling = scaling_for("dynamic", factor=factor, trained=trained)
    for a in tqdm(range(trained, t - 1, span), disable=not progress, leave=False):
        b = min(a + span, t - 1)  # inputs a .. b-1 predict tokens a+1 .. b
        with swapped_rope(model, scaling, trained=trained, length=b):
            out[a:b] = chunked_nll(model, ids[:, : b + 1], chunk=chunk, start=a)
    return out


@torch.no_grad()
def gapped_nll(model: nn.Module, ids: Tensor, *, at: int) -> Tensor:
    """NLL (nats, float64) of the second half of ``ids [1, 2 S]`` given the first: the
    first ``S`` tokens at positions ``0 .. S-1``, the next ``S`` at ``at .. at+S-1`` (one
    forward, positions between them left empty). Returns ``[S - 1]``: tokens ``S+1 ..
    2S-1``, each predicted within the second segment and after the first.

    Raises:
        ValueError: an odd length, or ``at`` that overlaps the first segment.
    """
    n = ids.shape[1]
    if n % 2 or n < 4:
        raise ValueError(f"gapped_nll needs an even length of at least 4, got {n}")
    seg = n // 2
    if at < seg:
        raise ValueError(f"at must be at least the segment length {seg}, got {at}")
    pos = torch.cat((torch.arange(seg), torch.arange(at, at + seg)))[None]
    logits = model(ids, position_ids=pos, logits_to_keep=seg).logits  # inputs S .. 2S-1
    return next_token_nll(logits[:, :-1], ids[:, seg + 1 :])[0]


def _ppl(nll: Tensor) -> float:
    return float(nll.mean().exp())


def _measure(
    model: nn.Module, ids: Tensor, s: dict[str, Any], progress: bool
) -> tuple[dict[str, Tensor], dict[str, float], dict[str, float], dict[str, float], float]:
    """Per variant: the NLL curve, perplexity before and past ``L``, seconds; and the
    unscaled model's ``before``."""
    trained, factor = s["trained"], s["factor"]
    curves: dict[str, Tensor] = {}
    before: dict[str, float] = {}
    past: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for v in VARIANTS:
        start = time.perf_counter()
        scaling = scaling_for(v, factor=factor, trained=trained)
        if s["mode"] == "gapped":
            seg = s["segment"]
            with swapped_rope(model, scaling, trained=trained):
                curves[v] = gapped_nll(model, ids, at=2 * trained - seg)
                # dynamic NTK is the trained RoPE within L: the same figure, not rerun
                inside = (
                    curves["none_inside"]
                    if v == "dynamic"
                    else gapped_nll(model, ids, at=trained - seg)
                )
            curves[f"{v}_inside"] = inside
            before[v], past[v] = _ppl(inside), _ppl(curves[v])
        else:
            if v == "dynamic":
                curves[v] = dynamic_nll(
                    model,
                    ids,
                    curves["none"],
                    factor=factor,
                    trained=trained,
                    chunk=s["chunk"],
                    span=s["span"],
                    progress=progress,
                )
            else:
                with swapped_rope(model, scaling, trained=trained):
                    curves[v] = chunked_nll(model, ids, chunk=s["chunk"], progress=progress)
            # the NLL at index i is that of token i + 1, at position i + 1
            before[v] = _ppl(curves[v][trained // 2 - 1 : trained - 1])
            past[v] = _ppl(curves[v][trained - 1 :])
        seconds[v] = time.perf_counter() - start
    return curves, before, past, seconds, before["none"]


def run(*, quick: bool, smoke: bool, out: Path, seed: int, progress: bool) -> ExperimentResult:
    """Score the text with each variant and return the result (``seed`` is unused)."""
    del out, seed
    s = _settings(quick, smoke)
    t0 = time.perf_counter()
    model = _real.load_smollm2()
    trained, factor = s["trained"], s["factor"]
    count = 2 * s["segment"] if s["mode"] == "gapped" else s["tokens"]
    ids = doc_tokens(model.tokenizer, count)
    curves, before_v, past_ppl, seconds, before = _measure(model, ids, s, progress)
    rows: list[dict[str, Any]] = [
        {
            "rope": v,
            "ppl_before": before_v[v],
            "ppl_past": past_ppl[v],
            "past_over_before": past_ppl[v] / before,
            "seconds": seconds[v],
        }
        for v in VARIANTS
    ]
    scaled = ("linear", "dynamic", "yarn")
    blows = past_ppl["none"] >= 2 * before
    graceful = all(past_ppl[v] <= 1.25 * before for v in scaled)
    yarn_best = min(scaled, key=lambda v: past_ppl[v]) == "yarn"
    agrees = blows and graceful and yarn_best
    ratios = ", ".join(f"{v} {past_ppl[v] / before:.2f}x" for v in VARIANTS)
    if s["mode"] == "gapped":
        seg = s["segment"]
        where = (
            f"{seg} tokens at positions {2 * trained - seg}-{2 * trained - 1} after {seg} at "
            f"0-{seg - 1} (factor {factor:g}), perplexity over the unscaled model's "
            f"{before:.2f} with them at {trained - seg}-{trained - 1}"
        )
    else:
        where = (
            f"past the trained {trained} tokens (to {s['tokens']}, factor {factor:g}), "
            f"perplexity over the unscaled model's {before:.2f} at {trained // 2}-{trained}"
        )
    verdict = (
        f"{'agrees' if agrees else 'does not agree'}: {where}: {ratios} (the rule asks "
        f"none >= 2x, every scaled variant <= 1.25x, YaRN lowest of the scaled; "
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
    gapped = s["mode"] == "gapped"
    first = 2 * s["trained"] - s["segment"] if gapped else 0
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for v in (*VARIANTS, "none_inside") if gapped else VARIANTS:
        c = curves[v]
        n = len(c) // bucket
        ppl = c[: n * bucket].view(n, bucket).mean(1).exp()
        centres = [first + (i + 0.5) * bucket for i in range(n)]
        if v == "none_inside":  # the same tokens inside L, drawn on the same axis
            ax.plot(centres, ppl.numpy(), ls="--", c="grey", label="none, placed to end at L")
        else:
            ax.plot(centres, ppl.numpy(), marker=".", label=v)
    if gapped:
        ax.set_xlabel(
            f"position of the second segment (the first at 0-{s['segment'] - 1}; "
            f"trained context {s['trained']})"
        )
    else:
        ax.axvline(s["trained"], ls=":", c="grey")
        ax.set_xlabel(f"token position (trained context {s['trained']} at the dotted line)")
    ax.set_ylabel(f"perplexity per {bucket} tokens")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(f"SmolLM2-135M on Python's docs: RoPE scalings, factor {s['factor']:g}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
