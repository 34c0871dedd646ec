"""Attention calls that say where their queries and keys sit (``q_positions``/``k_positions``).

The independent check: a call on keys gathered from a longer sequence, in any order,
with empty entries (``-1``) between them, equals the reference on the whole sequence
with the pattern made dense on contiguous positions and the keys that were not
gathered masked out, row by row. Every exact backend then equals the reference on
the positioned call, forward and backward (query, key, value and a T5 bias table).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab import scaled_dot_product_attention
from attnlab.backends import AttentionCall, dispatch_trusted, explain
from attnlab.backends.sparse import sparse_attention
from attnlab.backends.tiled import tiled_attention
from attnlab.functional import masks as M
from attnlab.functional import sdpa_reference
from attnlab.functional.positions import alibi_slopes, t5_relative_position_bucket
from attnlab.functional.score_mods import alibi, softcap, t5_bias
from attnlab.modules.positions import T5RelativePositionBias

BUDGET = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

TOL = {
    torch.float64: {"atol": 1e-10, "rtol": 1e-8},
    torch.float32: {"atol": 3e-5, "rtol": 1e-4},
}


@st.composite
def patterns(draw: st.DrawFn, total: int, batch: int) -> M.MaskPattern | None:
    kind = draw(
        st.sampled_from(
            ["none", "causal", "window", "global", "document", "padding", "prefix", "dilated"]
        )
    )
    if kind == "none":
        return None
    if kind == "causal":
        return M.causal()
    if kind == "window":
        return M.sliding_window(draw(st.integers(0, 6)), draw(st.integers(0, 3)))
    if kind == "global":
        return M.global_tokens(draw(st.lists(st.integers(0, total - 1), min_size=1, max_size=3)))
    if kind == "document":
        ids = torch.tensor(
            [
                sorted(draw(st.lists(st.integers(0, 3), min_size=total, max_size=total)))
                for _ in range(batch)
            ]
        )
        return M.document(ids) & M.causal()
    if kind == "padding":
        keep = torch.ones(batch, total, dtype=torch.long)
        for b in range(batch):
            keep[b, : draw(st.integers(0, total - 1))] = 0  # left padding
        return M.padding(keep) & M.causal()
    if kind == "prefix":
        return M.prefix_lm(draw(st.integers(0, total)))
    return M.dilated(draw(st.integers(1, 3)), draw(st.integers(1, 3)), causal=True)


@st.composite
def positioned_calls(draw: st.DrawFn) -> dict:
    """A batch whose rows hold different slots of one ``T``-slot sequence."""
    batch = draw(st.integers(1, 2))
    h_kv = draw(st.sampled_from([1, 2]))
    h = h_kv * draw(st.sampled_from([1, 2]))
    total = draw(st.integers(2, 40))
    n_q = draw(st.integers(1, min(total, 12)))
    n_k = draw(st.integers(1, total))
    holes = draw(st.integers(0, 4))
    e = draw(st.sampled_from([4, 8]))
    pattern = draw(patterns(total, batch))
    mods = draw(st.sampled_from(["none", "alibi", "softcap+alibi", "t5"]))
    shuffle = draw(st.booleans())
    per_row = draw(st.booleans()) and batch > 1
    rows = batch if per_row else 1
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    q_slots, k_slots = [], []
    for _ in range(rows):
        q_slots.append(torch.randperm(total, generator=g)[:n_q].sort().values)
        ks = torch.randperm(total, generator=g)[:n_k]
        ks = ks if shuffle else ks.sort().values
        hole_at = torch.randint(0, n_k + 1, (holes,), generator=g).sort().values
        parts, prev = [], 0
        for i, at in enumerate(hole_at.tolist()):
            parts += [ks[prev:at], torch.tensor([-1])]
            prev = at
            del i
        parts.append(ks[prev:])
        k_slots.append(torch.cat(parts))
    return {
        "batch": batch,
        "h": h,
        "h_kv": h_kv,
        "total": total,
        "e": e,
        "pattern": pattern,
        "mods": mods,
        "q_pos": torch.stack(q_slots),  # [rows, L]
        "k_pos": torch.stack(k_slots),  # [rows, S]
        "seed": seed,
    }


def _mods(kind: str, h: int, g: torch.Generator, dtype: torch.dtype) -> tuple:
    if kind == "alibi":
        return (alibi(h),)
    if kind == "softcap+alibi":
        return (alibi(h), softcap(2.0))
    if kind == "t5":
        table = torch.randn(8, h, generator=g, dtype=dtype).requires_grad_()
        return (t5_bias(table, bidirectional=True, max_distance=16),)
    return ()


def _inputs(c: dict, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(c["seed"])
    B, L, S, E = c["batch"], c["q_pos"].shape[1], c["k_pos"].shape[1], c["e"]
    q = torch.randn(B, c["h"], L, E, generator=g, dtype=dtype)
    k = torch.randn(B, c["h_kv"], S, E, generator=g, dtype=dtype)
    v = torch.randn(B, c["h_kv"], S, E, generator=g, dtype=dtype)
    return q, k, v


@BUDGET
@given(positioned_calls())
def test_positions_equal_the_whole_sequence_with_the_rest_masked(c: dict) -> None:
    """Gathered keys with holes, per row, equal the contiguous reference on all ``T`` slots."""
    dtype = torch.float64
    B, T, E, h, h_kv = c["batch"], c["total"], c["e"], c["h"], c["h_kv"]
    g = torch.Generator().manual_seed(c["seed"] + 1)
    k_full = torch.randn(B, h_kv, T, E, generator=g, dtype=dtype)
    v_full = torch.randn(B, h_kv, T, E, generator=g, dtype=dtype)
    q = torch.randn(B, h, c["q_pos"].shape[1], E, generator=g, dtype=dtype)
    q_pos = c["q_pos"].expand(B, -1)
    k_pos = c["k_pos"].expand(B, -1)
    gather = k_pos.clamp(min=0)[:, None, :, None]  # [B, 1, S, 1]
    k = torch.gather(k_full, 2, gather.expand(B, h_kv, -1, E))
    v = torch.gather(v_full, 2, gather.expand(B, h_kv, -1, E))
    k = torch.where(k_pos[:, None, :, None] >= 0, k, torch.full_like(k, 1e3))  # garbage holes
    mods = _mods(c["mods"], h, g, dtype)
    pattern = c["pattern"]
    attn = pattern.with_scores(*mods) if pattern is not None and mods else pattern
    if pattern is None and mods:
        attn = M.full().with_scores(*mods)
    out = scaled_dot_product_attention(
        q,
        k,
        v,
        attn,
        enable_gqa=True,
        q_positions=c["q_pos"],
        k_positions=c["k_pos"],
        backend="reference",
    )
    for b in range(B):
        dense = (pattern or M.full()).to_dense(T, T)  # [T, T] or [B, 1, T, T]
        dense = dense[b, 0] if dense.dim() == 4 else dense
        rows = dense[q_pos[b]]  # [L, T]
        gathered = torch.zeros(T, dtype=torch.bool)
        gathered[k_pos[b][k_pos[b] >= 0]] = True
        ref, _ = sdpa_reference(
            q[b : b + 1],
            k_full[b : b + 1],
            v_full[b : b + 1],
            rows & gathered,
            enable_gqa=True,
            score_mods=mods,
            q_positions=q_pos[b : b + 1],
        )
        torch.testing.assert_close(out[b : b + 1], ref, **TOL[dtype])


@BUDGET
@given(positioned_calls(), st.sampled_from([torch.float32, torch.float64]), st.booleans())
def test_every_backend_equals_the_reference_with_positions(
    c: dict, dtype: torch.dtype, is_causal: bool
) -> None:
    """tiled, sparse and sdpa (through a dense mask) equal the reference, forward and backward."""
    q, k, v = _inputs(c, dtype)
    g = torch.Generator().manual_seed(c["seed"] + 2)
    mods = _mods(c["mods"], c["h"], g, dtype)
    pattern = c["pattern"]
    if mods:
        pattern = (pattern or M.full()).with_scores(*mods)
    kw = {
        "enable_gqa": True,
        "is_causal": is_causal,
        "q_positions": c["q_pos"],
        "k_positions": c["k_pos"],
    }
    backends = ["tiled", "sparse"] + ([] if mods else ["sdpa"])
    leaves = [q, k, v, *(p for m in mods for p in m.parameters())]

    def run(name: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        for t in leaves[3:]:
            t.grad = None
        out = scaled_dot_product_attention(*xs, pattern, backend=name, **kw)
        assert isinstance(out, torch.Tensor)
        out.pow(2).sum().backward()
        grads = [x.grad for x in xs] + [t.grad for t in leaves[3:]]
        return out.detach(), [gr.clone() for gr in grads if gr is not None]

    ref_out, ref_grads = run("reference")
    for name in backends:
        out, grads = run(name)
        torch.testing.assert_close(out, ref_out, **TOL[dtype], msg=name)
        assert len(grads) == len(ref_grads), name
        for a, b in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b, **TOL[dtype], msg=name)


def test_tiled_t5_bias_gradient_with_small_tiles() -> None:
    """The hand-written backward gives the T5 table's gradient across many tiles."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 37, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 4, 45, 8, generator=g, dtype=torch.float64) for _ in range(2))
    q_pos = torch.arange(8, 45).view(1, -1)
    k_pos = torch.arange(45).view(1, -1).clone()
    k_pos[0, 5:9] = -1
    grads = []
    for fn in ("ref", "tiled"):
        table = torch.randn(32, 4, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        table.requires_grad_()
        pattern = M.causal().with_scores(t5_bias(table, bidirectional=False), softcap(3.0))
        if fn == "ref":
            out = scaled_dot_product_attention(
                q, k, v, pattern, backend="reference", q_positions=q_pos, k_positions=k_pos
            )
        else:
            out, _ = tiled_attention(
                q, k, v, pattern, block_q=8, block_k=8, q_positions=q_pos, k_positions=k_pos
            )
        assert isinstance(out, torch.Tensor)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum().backward()
        grads.append(table.grad)
    assert grads[0] is not None and grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], atol=1e-10, rtol=1e-8)


def test_t5_score_mod_equals_the_t5_module() -> None:
    """The score modifier adds what T5's dense ``[B, H, L, S]`` bias (its table looked up
    at the buckets of ``k - q``) adds."""
    module = T5RelativePositionBias(
        num_heads=3, num_buckets=16, max_distance=20, bidirectional=False
    )
    q_pos = torch.tensor([[5, 6, 7], [0, 1, 2]])
    k_pos = torch.tensor([[0, 2, 4, 6, 7], [0, 1, 2, 3, 4]])
    bucket = t5_relative_position_bucket(
        k_pos[:, None, :] - q_pos[:, :, None], bidirectional=False, num_buckets=16, max_distance=20
    )  # [B, L, S]
    dense = module.relative_attention_bias(bucket).permute(0, 3, 1, 2)  # [B, H, L, S]
    mod = t5_bias(module.relative_attention_bias.weight, bidirectional=False, max_distance=20)
    h = torch.arange(3).view(-1, 1, 1)
    got = mod(
        torch.zeros(2, 3, 3, 5),
        torch.zeros((), dtype=torch.long),
        h,
        q_pos[:, None, :, None],
        k_pos[:, None, None, :],
    )
    torch.testing.assert_close(got, dense)


def test_alibi_on_slots_equals_bloom_alibi_on_left_padded_rows() -> None:
    """Slots (left padding included) and BLOOM's cumsum positions differ by a per-row constant."""
    g = torch.Generator().manual_seed(5)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    slots = torch.arange(6).view(1, -1)
    pattern = (M.causal() & M.padding(mask)).with_scores(alibi(4))
    out = scaled_dot_product_attention(q, k, v, pattern, q_positions=slots, k_positions=slots)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # BLOOM's positions
    rel = pos[:, None, None, :] - pos[:, None, :, None]  # [B, 1, L, S]: j - i
    bias = alibi_slopes(4).view(1, -1, 1, 1) * rel  # [B, H, L, S]
    keep = M.causal().to_dense(6, 6) & mask.bool()[:, None, None, :]
    ref, _ = sdpa_reference(q, k, v, bias.masked_fill(~keep, float("-inf")))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_cached_decoding_positions_equal_the_bottom_right_mask() -> None:
    """One new query at slot S-1 over S cached keys: the causal window by slot."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 2, 1, 8, generator=g)
    k, v = (torch.randn(1, 2, 20, 8, generator=g) for _ in range(2))
    pattern = M.sliding_window(4)
    out = scaled_dot_product_attention(
        q, k, v, pattern, is_causal=True, q_positions=torch.tensor([[19]])
    )
    dense = pattern.to_dense(1, 20, q_offset=19) & M.causal_mask(1, 20, offset=19)
    ref, _ = sdpa_reference(q, k, v, dense)
    torch.testing.assert_close(out, ref)


def test_dispatch_trusted_equals_the_public_call_and_explain_sees_positions() -> None:
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 2, 5, 8, generator=g) for _ in range(3))
    k_pos = torch.tensor([[0, 1, 2, -1, 4], [0, -1, 2, 3, 4]])
    q_pos = torch.tensor([[4, 5, 6, 7, 8]])
    pattern = M.causal()
    call = AttentionCall.from_inputs(
        q,
        k,
        v,
        pattern,
        dropout_p=0.0,
        is_causal=False,
        enable_gqa=False,
        return_weights=False,
        positions=True,
    )
    out, _ = dispatch_trusted(call, q, k, v, q_positions=q_pos, k_positions=k_pos)
    ref = scaled_dot_product_attention(
        q, k, v, pattern, backend="reference", q_positions=q_pos, k_positions=k_pos
    )
    torch.testing.assert_close(out, ref)
    why = explain(q, k, v, pattern, q_positions=q_pos, k_positions=k_pos)
    assert "positions" in why.reasons["flex"]
    assert "positions" in why.reasons["linear"] or "approximate" in why.reasons["linear"]


def test_sparse_with_positions_skips_no_attended_key() -> None:
    """Keys out of order: the block geometry brackets them by their min and max slot."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 70, 8, generator=g) for _ in range(3))
    k_pos = torch.randperm(70, generator=g).view(1, -1)
    out, _ = sparse_attention(q, k, v, M.sliding_window(3), block=8, k_positions=k_pos)
    ref = scaled_dot_product_attention(
        q, k, v, M.sliding_window(3), backend="reference", k_positions=k_pos
    )
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"q_positions": torch.zeros(1, 3)}, TypeError, "q_positions must be an integer"),
        ({"q_positions": torch.zeros(1, 4, dtype=torch.long)}, ValueError, r"\[2 or 1, 3\]"),
        ({"k_positions": torch.zeros(3, 5, dtype=torch.long)}, ValueError, r"\[2 or 1, 5\]"),
        ({"k_positions": torch.full((1, 5), -2)}, ValueError, "k_positions must be >= -1"),
        ({"q_positions": torch.full((1, 3), -1)}, ValueError, "q_positions must be >= 0"),
        ({"k_positions": [0, 1, 2, 3, 4]}, TypeError, "k_positions must be a torch.Tensor"),
    ],
)
def test_bad_positions_are_refused_naming_the_argument(
    kwargs: dict, error: type[Exception], match: str
) -> None:
    q = torch.randn(2, 1, 3, 4)
    k = v = torch.randn(2, 1, 5, 4)
    with pytest.raises(error, match=match):
        scaled_dot_product_attention(q, k, v, **kwargs)
    with pytest.raises(error, match=match):
        explain(q, k, v, **kwargs)


def test_evaluate_shapes_and_empty_keys() -> None:
    p = M.sliding_window(2)
    out = p.evaluate(torch.tensor([[3, 4]]), torch.tensor([[1, -1, 3, 4], [2, 3, 4, 5]]))
    assert out.shape == (2, 1, 2, 4)
    assert out[0, 0, :, 1].sum() == 0  # the empty key is never attended
    assert out[0, 0].tolist() == [[True, False, True, False], [False, False, True, True]]
    with pytest.raises(ValueError, match="batch size 2"):
        M.padding(torch.ones(2, 4)).evaluate(
            torch.zeros(3, 1, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)
        )
