"""Find what is wrong with an attention model on an input, and say how to fix it.

Shape notation: ``B`` batch, ``H`` heads, ``L`` queries, ``S`` keys.

:func:`diagnose` runs one forward pass with hooks and returns a
:class:`DiagnosisReport`:

* the first module (in execution order, innermost first) whose output holds NaN or
  Inf, named as in ``model.named_modules()``, with statistics of the inputs it received
  and the parameters in it that are not finite (:class:`NonFiniteWatch`, usable alone);
* checks of the inputs' shapes, dtypes and masks, each issue with its fix spelled out
  (a 1-D ``input_ids``, an ``attention_mask`` of the wrong shape, an additive float mask
  where 1/0 was meant, a 0/1 float ``attn_mask`` where a bool was meant, a sequence whose
  mask blanks every key);
* statistics of every attention layer and head (:class:`HeadStats`): how far rows are
  from summing to one, entropy, largest weight, share of attention on the first token
  (attention sinks, Xiao et al., 2023, "Efficient streaming language models with
  attention sinks"), and rows whose keys are all masked;
* for mixture-of-experts layers (:class:`~attnlab.modules.moe.MoEBlock`), the expert
  load per layer (:class:`ExpertLoad`: tokens per expert, dropped share, router entropy),
  with collapsed routers flagged.

The per-module check is one float32 sum per output tensor (NaN and Inf propagate into
the sum), so the hooks cost little next to the forward pass itself (see
``docs/benchmarks.md``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.analysis.attention_stats import HeadStats, attention_head_stats
from attnlab.analysis.expert_stats import ExpertLoad, expert_load
from attnlab.analysis.input_checks import Issue, check_attn_mask, check_inputs
from attnlab.analysis.nonfinite import NonFiniteWatch, _finite, _tensors

__all__ = [
    "DiagnosisReport",
    "ExpertLoad",
    "HeadStats",
    "Issue",
    "NonFiniteWatch",
    "attention_head_stats",
    "diagnose",
]

logger = logging.getLogger(__name__)

#: Largest |row sum - 1| accepted for a row that is not fully masked.
ROW_SUM_TOL = 1e-3


@dataclass
class DiagnosisReport:
    """What :func:`diagnose` found.

    Attributes:
        ok: no issue found.
        issues: the findings, most important first.
        first_nonfinite_module: name of the first module whose output held NaN/Inf, or None.
        first_nonfinite_inputs: statistics of that module's inputs (per input tensor).
        nonfinite_parameters: parameter name -> number of NaN/Inf entries.
        output_finite: the model's output was finite.
        heads: statistics per layer and head (when attention weights were available).
        backend: the attention backend ``auto`` resolved to during the pass.
        error: the exception the forward raised, if any (``"TypeName: message"``).
        error_module: the innermost module running when it was raised.
        experts: expert load per MoE layer (empty without MoE layers).
    """

    ok: bool
    issues: list[Issue]
    first_nonfinite_module: str | None
    first_nonfinite_inputs: list[dict[str, Any]]
    nonfinite_parameters: dict[str, int]
    output_finite: bool
    heads: list[HeadStats] = field(default_factory=list)
    backend: str = "auto"
    error: str | None = None
    error_module: str | None = None
    experts: list[ExpertLoad] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``json.dumps``."""
        return asdict(self)

    def layer_summary(self) -> list[dict[str, Any]]:
        """Per layer: the worst row-sum error and the means of the head statistics."""
        out: list[dict[str, Any]] = []
        layers = sorted({h.layer for h in self.heads})
        for layer in layers:
            hs = [h for h in self.heads if h.layer == layer]
            out.append(
                {
                    "layer": layer,
                    "module": hs[0].module,
                    "row_sum_error": max(h.row_sum_error for h in hs),
                    "entropy": sum(h.entropy for h in hs) / len(hs),
                    "max_weight": sum(h.max_weight for h in hs) / len(hs),
                    "first_token_share": sum(h.first_token_share for h in hs) / len(hs),
                    "fully_masked_rows": sum(h.fully_masked_rows for h in hs),
                }
            )
        return out

    def summary(self) -> str:
        """A report a person reads."""
        lines = ["no issues found" if self.ok else f"{len(self.issues)} issue(s):"]
        lines += [str(i) for i in self.issues]
        if self.heads:
            lines.append("")
            rows = self.layer_summary()
            width = max(len("module"), *(len(r["module"]) for r in rows))
            lines.append(
                f"layer  {'module':<{width}}  row-sum err  entropy  max weight  "
                "first-token share  fully masked rows"
            )
            for row in rows:
                lines.append(
                    f"{int(row['layer']):>5}  {row['module']:<{width}}  {row['row_sum_error']:11.2e}  "
                    f"{row['entropy']:7.3f}  {row['max_weight']:10.3f}  "
                    f"{row['first_token_share']:17.3f}  {int(row['fully_masked_rows']):>17}"
                )
        if self.experts:
            lines.append("")
            lines.append("MoE layer  module  tokens per expert  max share  router entropy  dropped")
            for x in self.experts:
                flag = "  COLLAPSED" if x.collapsed else ""
                lines.append(
                    f"{x.layer:>9}  {x.module}  {x.tokens_per_expert}  {x.max_share:9.3f}  "
                    f"{x.router_entropy:14.3f}  {x.dropped_share:7.3f}{flag}"
                )
        return "\n".join(lines)


# --------------------------------------------------------------------------- diagnose


def _accepts(module: nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


@contextlib.contextmanager
def _attention_capture(model: nn.Module, found: list[tuple[str, Tensor]]) -> Iterator[None]:
    from attnlab.backends.plan import AttentionPlan
    from attnlab.modules.attention import MultiHeadAttention

    handles = []
    for name, module in model.named_modules():
        if isinstance(module, MultiHeadAttention):

            def pre(mod: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
                plan = args[1] if len(args) > 1 else kwargs.get("plan")
                if isinstance(plan, AttentionPlan):  # a model's layer: the plan says it
                    if len(args) > 1:
                        return (args[0], plan.with_weights(), *args[2:]), kwargs
                    return args, {**kwargs, "plan": plan.with_weights()}
                return args, {**kwargs, "need_weights": True}

            def post(mod: nn.Module, args: Any, kwargs: Any, output: Any, name: str = name) -> None:
                if isinstance(output, tuple) and len(output) > 1 and isinstance(output[1], Tensor):
                    found.append((name, output[1]))

            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _router_hooks(model: nn.Module, found: list[tuple[str, Any, Any]]) -> list[Any]:
    """Record each MoE block's output (router logits, dropped share) as it runs."""
    from attnlab.modules.moe import MoEBlock

    handles = []
    for name, mod in model.named_modules():
        if isinstance(mod, MoEBlock):

            def hook(m: nn.Module, args: Any, out: Any, name: str = name) -> None:
                found.append((name, m, out))

            handles.append(mod.register_forward_hook(hook))
    return handles


def _expert_issues(
    found: list[tuple[str, Any, Any]], mask: Any
) -> tuple[list[ExpertLoad], list[Issue]]:
    loads, issues = [], []
    for layer, (name, block, out) in enumerate(found):
        load = expert_load(
            out.router_logits,
            block.router.top_k,
            layer=layer,
            module=name,
            mask=mask if isinstance(mask, Tensor) else None,
            dropped=out.dropped,
        )
        loads.append(load)
        if load.collapsed:
            k, e = block.router.top_k, block.router.num_experts
            issues.append(
                Issue(
                    "router_collapse",
                    name,
                    f"expert {load.busiest_expert} is chosen by {load.max_share:.0%} of the "
                    f"{load.tokens} tokens (balanced top-{k} of {e}: about {k / e:.0%}); "
                    f"tokens per expert {load.tokens_per_expert}, router entropy "
                    f"{load.router_entropy:.3f} nats",
                    "the router has collapsed: check its weights (reload them), train with the "
                    "load-balancing loss (output_router_logits=True, router_aux_loss_coef) or "
                    "router noise/jitter",
                )
            )
    return loads, issues


def _mask_hooks(model: nn.Module, issues: list[Issue]) -> list[Any]:
    """Pre-hooks on attention modules that check the ``attn_mask`` each one receives."""
    from attnlab.modules.attention import MultiHeadAttention

    seen: set[str] = set()
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, MultiHeadAttention):

            def pre(mod: nn.Module, args: Any, kwargs: dict[str, Any], name: str = name) -> None:
                m = kwargs.get("attn_mask")
                if isinstance(m, Tensor) and name not in seen:
                    seen.add(name)
                    for issue in check_attn_mask(m, f"{name or '<model>'} attn_mask"):
                        if not any(i.message == issue.message for i in issues):
                            issues.append(issue)

            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
    return handles


def diagnose(
    model: nn.Module,
    inputs: Mapping[str, Any] | Tensor,
    *,
    attention_stats: bool = True,
    row_sum_tol: float = ROW_SUM_TOL,
) -> DiagnosisReport:
    """Run ``model(**inputs)`` once with hooks and report what is wrong.

    Args:
        model: any ``nn.Module``; attention statistics need attnlab's
            :class:`~attnlab.modules.attention.MultiHeadAttention` inside it.
        inputs: keyword arguments of the forward (``{"input_ids": ..., "attention_mask": ...}``),
            or one tensor passed positionally.
        attention_stats: capture attention weights and compute per-head statistics (asks
            each attention module for its weights, which runs a backend that returns
            them, normally the reference).
        row_sum_tol: largest accepted ``|row sum - 1|``.

    Returns:
        A :class:`DiagnosisReport`.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``inputs`` neither a mapping nor a tensor.
    """
    from attnlab.backends import current

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    args, kwargs = _call_arguments(inputs)
    issues = check_inputs(model, kwargs)
    bad_params = {
        name: int((~torch.isfinite(p.detach())).sum())
        for name, p in model.named_parameters()
        if p.is_floating_point() and not bool(torch.isfinite(p.detach()).all())
    }
    if (
        attention_stats
        and _accepts(model, "output_attentions")
        and "output_attentions" not in kwargs
    ):
        kwargs["output_attentions"] = True
    found: list[tuple[str, Tensor]] = []
    routed: list[tuple[str, Any, Any]] = []
    watch = NonFiniteWatch(model)
    backend = current()
    output, error = _forward(
        model,
        args,
        kwargs,
        watch=watch,
        issues=issues,
        weights=found if attention_stats else None,
        routed=routed,
    )
    output_finite = error is None and all(_finite(t) for t in _tensors(output))
    _add_nonfinite_issue(issues, watch, bad_params)
    experts, expert_issues = _expert_issues(routed, kwargs.get("attention_mask"))
    issues += expert_issues
    heads = _head_statistics(model, found, backend=backend, row_sum_tol=row_sum_tol, issues=issues)
    return DiagnosisReport(
        ok=not issues,
        issues=issues,
        first_nonfinite_module=watch.first_module,
        first_nonfinite_inputs=watch.first_inputs,
        nonfinite_parameters=bad_params,
        output_finite=output_finite,
        heads=heads,
        backend=backend,
        error=error,
        error_module=watch.deepest_on_error if error else None,
        experts=experts,
    )


def _call_arguments(inputs: Mapping[str, Any] | Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``inputs`` as the forward's positional and keyword arguments."""
    if isinstance(inputs, Tensor):
        return (inputs,), {}
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    raise TypeError(
        f"inputs must be a mapping of forward arguments or a tensor, got {type(inputs).__name__}"
    )


def _forward(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    watch: NonFiniteWatch,
    issues: list[Issue],
    weights: list[tuple[str, Tensor]] | None,
    routed: list[tuple[str, Any, Any]],
) -> tuple[Any, str | None]:
    """One forward under the hooks: the output, and the error it raised (an issue first)."""
    error: str | None = None
    output: Any = None
    handles = _mask_hooks(model, issues) + _router_hooks(model, routed)
    capture = (
        _attention_capture(model, weights) if weights is not None else contextlib.nullcontext()
    )
    try:
        with torch.no_grad(), capture, watch:
            output = model(*args, **kwargs)
    except (ValueError, TypeError, RuntimeError, IndexError) as e:
        error = f"{type(e).__name__}: {e}"
        issues.insert(
            0,
            Issue(
                "error",
                watch.deepest_on_error or "<model>",
                f"the forward pass raised {error}",
                "read the message: attnlab's errors name the values involved; "
                "the input checks above may point at the cause",
            ),
        )
    finally:
        for h in handles:
            h.remove()
    return output, error


def _add_nonfinite_issue(
    issues: list[Issue], watch: NonFiniteWatch, bad_params: dict[str, int]
) -> None:
    """The first module whose output is not finite, and why (first of all issues); else
    the non-finite parameters the forward did not use."""
    if watch.first_module is None:
        if bad_params:
            issues.append(
                Issue(
                    "nonfinite",
                    ", ".join(sorted(bad_params)),
                    f"parameters hold NaN/Inf: {bad_params} (the forward did not use them)",
                    "reload or re-initialise those weights",
                )
            )
        return
    name = watch.first_module
    in_params = {
        p: n for p, n in bad_params.items() if p.startswith(f"{name}.") or name == "<model>"
    }
    outs = watch.first_outputs
    ins = watch.first_inputs
    inputs_finite = all(s.get("nan", 0) == 0 and s.get("inf", 0) == 0 for s in ins)
    half = any(s.get("dtype") in ("float16", "bfloat16") for s in outs)
    only_inf = all(s.get("nan", 0) == 0 for s in outs)
    kind = "nonfinite"
    if in_params:
        msg = (
            f"first NaN/Inf appears in the output of {name}, whose parameters "
            f"{sorted(in_params)} hold non-finite values"
        )
        fix = "reload or re-initialise those weights; check the checkpoint and the last optimizer steps"
    elif inputs_finite and half and only_inf:
        peak = max((s.get("abs_max", 0.0) for s in ins), default=0.0)
        msg = (
            f"{name} turned finite inputs (largest |x| = {peak:.3g}) into Inf in "
            f"{outs[0]['dtype']}: an overflow (float16 holds at most 65504)"
        )
        fix = (
            "run in bfloat16 or float32, or keep this module in float32 "
            "(module.float() and cast its input)"
        )
        kind = "overflow"
    elif inputs_finite:
        msg = f"{name} produced NaN/Inf from finite inputs: {outs}"
        fix = "check this module's arithmetic (division by zero, log of 0, overflow)"
    else:
        msg = f"{name} received non-finite inputs: {ins}"
        fix = "the inputs passed to the model are not finite; check inputs_embeds / the data"
    issues.insert(0, Issue(kind, name, msg, fix))


def _head_statistics(
    model: nn.Module,
    found: list[tuple[str, Tensor]],
    *,
    backend: str,
    row_sum_tol: float,
    issues: list[Issue],
) -> list[HeadStats]:
    """Per-head statistics of the captured weights; rows that do not sum to one and rows
    whose keys are all masked become issues."""
    heads: list[HeadStats] = []
    for layer, (name, w) in enumerate(found):
        stats = attention_head_stats(w, layer=layer, module=name)
        heads += stats
        worst = max(stats, key=lambda s: s.row_sum_error)
        if worst.row_sum_error > row_sum_tol and math.isfinite(worst.row_sum_error):
            mod = model.get_submodule(name) if name else model
            used = getattr(mod, "backend", "auto")
            used = backend if used == "auto" else used
            issues.append(
                Issue(
                    "row_sum",
                    name or "<model>",
                    f"attention rows do not sum to one: |sum - 1| up to {worst.row_sum_error:.3g} "
                    f"(head {worst.head}, layer {layer}); backend {used!r} produced these weights",
                    "the attention implementation does not normalise its weights; compare with "
                    "attnlab.backends.use('reference') and fix or drop the backend",
                )
            )
        masked_rows = sum(s.fully_masked_rows for s in stats)
        if masked_rows and not any(i.kind == "fully_masked" for i in issues):
            issues.append(
                Issue(
                    "fully_masked",
                    name or "<model>",
                    f"{masked_rows} (query, head) rows in layer {layer} have every key masked",
                    "check the mask: every query needs at least one key it may attend to",
                )
            )
    return heads
