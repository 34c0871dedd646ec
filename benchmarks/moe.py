"""One MoE block: attnlab's dispatches against their floor and transformers' Mixtral block.

The block: ``E`` experts, top-``k`` (softmax, renormalised), SwiGLU experts of width ``F``
on ``T`` tokens of width ``D``, float32. Measured in one run, interleaved, with one
thread and process time (other processes' load barely moves it):

* attnlab dropless (sorted grouped matmuls) and capacity (factor ``--capacity-factor``)
  dispatch, forward and forward + backward;
* the floor: the grouped matmuls alone on the already-routed, already-sorted tokens
  (``torch._grouped_mm`` twice; forward + backward: the same under autograd);
* transformers' ``MixtralSparseMoeBlock`` on the same weights with its experts
  implementation pinned to ``eager`` (a loop over experts) and to ``grouped_mm``;
* the per-token reference loop, timed on ``--loop-tokens`` tokens and scaled to ``T``;
* the cost model's expert FLOPs against ``FlopCounterMode`` on the reference loop
  (run on the meta device: exact counts, no arithmetic).

Usage: ``python benchmarks/moe.py [--width 3584] [--tokens 4096] [--rounds 3] [--write]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, median_ms, time_interleaved, write_section
from attnlab.analysis.arch import MoESpec
from attnlab.analysis.moe_cost import routed_expert_flops
from attnlab.functional.expert_dispatch import moe_reference, sort_by_expert
from attnlab.functional.routing import token_choice
from attnlab.modules.experts import Experts, Router
from attnlab.modules.moe import MoEBlock


def _hf_block(args: argparse.Namespace, implementation: str) -> torch.nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(
        hidden_size=args.hidden,
        intermediate_size=args.width,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        experts_implementation=implementation,
    )
    return MixtralSparseMoeBlock(cfg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--width", type=int, default=3584)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--loop-tokens", type=int, default=64)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--write", action="store_true", help="write the table to docs/benchmarks.md")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    e, k, d, f, t = args.experts, args.top_k, args.hidden, args.width, args.tokens

    block = MoEBlock(
        router=Router(embed_dim=d, num_experts=e, top_k=k),
        experts=Experts(num_experts=e, embed_dim=d, hidden_dim=f),
        capacity_factor=args.capacity_factor,
    )
    with torch.no_grad():
        block.router.weight.normal_(0, 0.5)  # routing with some spread, not uniform
    hf = {name: _hf_block(args, name) for name in ("eager", "grouped_mm")}
    for m in hf.values():
        m.gate.weight = block.router.weight
        m.experts.gate_up_proj = block.experts.w_in
        m.experts.down_proj = block.experts.w_out
    x = torch.randn(1, t, d)
    flat = x.view(t, d)

    # same numbers before timing anything
    with torch.no_grad():
        ours = block(x).hidden
        for name, m in hf.items():
            torch.testing.assert_close(ours, m(x), atol=1e-4, rtol=1e-4, msg=name)

    # the floor: the two grouped matmuls on routed, sorted tokens
    routing = token_choice(block.router(flat)[0].detach(), k)
    order, counts = sort_by_expert(routing.experts, e)
    xs = flat[order // k].contiguous()  # [A, D]
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    w_in, w_out = block.experts.w_in, block.experts.w_out
    hs = torch.randn(xs.shape[0], f)

    def floor_fwd() -> object:
        with torch.no_grad():
            torch._grouped_mm(xs, w_in.transpose(1, 2), offs=offsets)
            return torch._grouped_mm(hs, w_out.transpose(1, 2), offs=offsets)

    xs_g, hs_g = xs.clone().requires_grad_(), hs.clone().requires_grad_()
    grad_a, grad_b = torch.randn(xs.shape[0], w_in.shape[1]), torch.randn(xs.shape[0], d)
    grad_y = torch.randn_like(x)

    def floor_fwd_bwd() -> object:
        a = torch._grouped_mm(xs_g, w_in.transpose(1, 2), offs=offsets)
        b = torch._grouped_mm(hs_g, w_out.transpose(1, 2), offs=offsets)
        torch.autograd.backward([a, b], [grad_a, grad_b])
        return None

    def fwd(fn: torch.nn.Module, **kw: object):
        def run() -> object:
            with torch.no_grad():
                return fn(x, **kw)

        return run

    def fwd_bwd(fn: torch.nn.Module, **kw: object):
        def run() -> object:
            out = fn(x, **kw)
            out = out.hidden if hasattr(out, "hidden") else out
            out.backward(grad_y)
            return None

        return run

    timing = dict(rounds=args.rounds, warmup=1, clock=time.process_time)
    t_fwd = time_interleaved(
        {
            "floor": floor_fwd,
            "attnlab dropless": fwd(block, dispatch="dropless"),
            "attnlab capacity": fwd(block, dispatch="capacity"),
            "HF grouped_mm": fwd(hf["grouped_mm"]),
            "HF eager": fwd(hf["eager"]),
        },
        **timing,  # type: ignore[arg-type]
    )
    t_bwd = time_interleaved(
        {
            "floor": floor_fwd_bwd,
            "attnlab dropless": fwd_bwd(block, dispatch="dropless"),
            "attnlab capacity": fwd_bwd(block, dispatch="capacity"),
            "HF grouped_mm": fwd_bwd(hf["grouped_mm"]),
            "HF eager": fwd_bwd(hf["eager"]),
        },
        **timing,  # type: ignore[arg-type]
    )

    # the per-token reference loop on a slice, scaled to T tokens
    n_loop = min(args.loop_tokens, t)
    sub = token_choice(block.router(flat[:n_loop])[0].detach(), k)
    t0 = time.process_time()
    with torch.no_grad():
        moe_reference(flat[:n_loop], sub, w_in, w_out, activation=F.silu, gated=True)
    loop_ms = 1000 * (time.process_time() - t0) * t / n_loop

    # cost model vs FlopCounterMode on the reference loop (meta tensors: counts only)
    meta = [z.detach().to("meta") for z in (flat, w_in, w_out)]
    meta_routing = routing._replace(weights=routing.weights.to("meta"))
    with FlopCounterMode(display=False) as counter:
        moe_reference(meta[0], meta_routing, meta[1], meta[2], activation=F.silu, gated=True)
    counted = counter.get_total_flops()
    spec = MoESpec(num_layers=1, num_experts=e, top_k=k, intermediate_size=f)
    modelled = routed_expert_flops(t * k, d, spec)

    with torch.no_grad():
        dropped = float(block(x, dispatch="capacity").dropped or 0.0)

    def row(name: str, fw: float, fb: float) -> str:
        return (
            f"| {name} | {fw:,.0f} | {fw / median_ms(t_fwd['floor']):.2f} | "
            f"{fb:,.0f} | {fb / median_ms(t_bwd['floor']):.2f} |"
        )

    m_f = {name: median_ms(v) for name, v in t_fwd.items()}
    m_b = {name: median_ms(v) for name, v in t_bwd.items()}
    lines = [
        f"{e} experts, top-{k}, hidden {d}, expert width {f}, {t} tokens, float32; "
        f"{machine_line()}; process time, {args.threads} thread(s), median of {args.rounds} "
        "interleaved rounds.",
        "",
        "| dispatch | forward ms | x floor | fwd+bwd ms | x floor |",
        "|---|---|---|---|---|",
        *(row(name, m_f[name], m_b[name]) for name in m_f),
        f"| per-token reference loop (forward, {n_loop} tokens scaled to {t}) | {loop_ms:,.0f} | "
        f"{loop_ms / m_f['floor']:.1f} | | |",
        "",
        "| ratio | forward | fwd+bwd | target |",
        "|---|---|---|---|",
        f"| attnlab dropless / floor | {m_f['attnlab dropless'] / m_f['floor']:.2f} | "
        f"{m_b['attnlab dropless'] / m_b['floor']:.2f} | <= 1.3 |",
        f"| HF eager / attnlab dropless (speed-up) | "
        f"{m_f['HF eager'] / m_f['attnlab dropless']:.2f} | "
        f"{m_b['HF eager'] / m_b['attnlab dropless']:.2f} | >= 3 |",
        f"| HF grouped_mm / attnlab dropless (speed-up) | "
        f"{m_f['HF grouped_mm'] / m_f['attnlab dropless']:.2f} | "
        f"{m_b['HF grouped_mm'] / m_b['attnlab dropless']:.2f} | >= 0.95 |",
        "",
        f"Capacity dispatch (factor {args.capacity_factor}) dropped {100 * dropped:.1f} % of the "
        "assignments on this routing.",
        f"Cost model: routed-expert FLOPs {modelled:.4e}; FlopCounterMode on the reference loop "
        f"{counted:.4e}; ratio {modelled / counted:.4f} (target within 2 %).",
    ]
    body = "\n".join(lines)
    print(body)
    if args.write:
        cmd = "python benchmarks/moe.py " + " ".join(sys.argv[1:])
        write_section(
            "## Mixture of experts (issue 11)",
            f"Command: `{cmd.strip()}` (figures taken on a loaded shared machine).\n\n{body}",
        )


if __name__ == "__main__":
    main()
