"""``attnlab backends``: list the attention backends, or explain which one ``auto`` picks.

``attnlab backends --explain --seq-len 16384 --mask window:512`` prints the backend
``auto`` would run for that call and why each other one was passed over, from the
same cost model that ``auto`` uses (no attention is computed).
"""

from __future__ import annotations

import argparse

from attnlab.cli._common import positive_int, print_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("backends", help="list attention backends; --explain shows auto's choice")
    p.add_argument("--explain", action="store_true", help="explain auto's choice for one call")
    p.add_argument("--seq-len", type=positive_int, default=4096, help="query and key length")
    p.add_argument(
        "--kv-len", type=positive_int, default=None, help="key length (default: --seq-len)"
    )
    p.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    p.add_argument("--heads", type=positive_int, default=12, help="query heads (default 12)")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="key/value heads (GQA)")
    p.add_argument("--head-dim", type=positive_int, default=64, help="head dimension (default 64)")
    p.add_argument(
        "--mask",
        default="causal",
        help="none, causal, window:W (causal window of W keys), or window:LEFT:RIGHT",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float16", "bfloat16", "float32", "float64"],
        help="dtype of the call (default float32)",
    )
    p.add_argument("--grad", action="store_true", help="gradients are needed (training)")
    p.add_argument("--weights", action="store_true", help="attention weights are returned")
    p.add_argument("--backend", default="auto", help="a backend name, or auto")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(func=run)


def _mask(spec: str) -> tuple[object, bool]:
    from attnlab.functional import masks

    if spec == "none":
        return None, False
    if spec == "causal":
        return None, True
    if spec.startswith("window:"):
        parts = spec.split(":")[1:]
        try:
            nums = [int(x) for x in parts]
        except ValueError:
            nums = []
        if len(nums) == 1 and nums[0] >= 1:
            return masks.sliding_window(nums[0] - 1), False
        if len(nums) == 2:
            return masks.sliding_window(nums[0], nums[1]), False
    raise ValueError(f"--mask must be none, causal, window:W or window:LEFT:RIGHT, got {spec!r}")


def run(args: argparse.Namespace) -> int:
    import torch

    from attnlab import backends

    if not args.explain:
        listed = [backends.get(name) for name in backends.available()]
        if args.json:
            print_json(
                [{"name": b.name, "exact": b.exact, "description": b.description} for b in listed]
            )
            return 0
        for b in listed:
            kind = "exact" if b.exact else "approximate"
            print(f"{b.name:10s} {kind:12s} {b.description}")
        return 0
    kv_len = args.kv_len or args.seq_len
    kv_heads = args.kv_heads or args.heads
    dtype = getattr(torch, args.dtype)
    # Views of one element: explain reads only shapes, so nothing large is allocated.
    one = torch.zeros(1, 1, 1, 1, dtype=dtype)
    q = one.expand(args.batch, args.heads, args.seq_len, args.head_dim)
    k = one.expand(args.batch, kv_heads, kv_len, args.head_dim)
    if args.grad:
        q = q.clone().requires_grad_()
    mask, is_causal = _mask(args.mask)
    e = backends.explain(
        q,
        k,
        k,
        mask,  # type: ignore[arg-type]
        is_causal=is_causal,
        enable_gqa=kv_heads != args.heads,
        backend=args.backend,
        return_weights=args.weights,
    )
    if args.json:
        print_json({"chosen": e.chosen, "reasons": e.reasons})
    else:
        print(e)
    return 0
