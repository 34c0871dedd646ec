"""The flex backend: tiny compiled cases (skipped where torch.compile cannot run).

Compiles take 10-20 s each on this project's CPU: the compiled tests keep to two or
three compiles each.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from attnlab import scaled_dot_product_attention
from attnlab.backends import explain, flex_masks
from attnlab.backends import flex as flex_mod
from attnlab.functional import masks as M
from attnlab.functional import sdpa_reference
from attnlab.functional.score_mods import alibi, softcap


def test_check_reasons_on_cpu() -> None:
    q = torch.randn(1, 1, 8, 4, requires_grad=True)
    reasons = explain(q, q, q, M.sliding_window(2)).reasons
    assert "inference only" in reasons["flex"]
    x = q.detach()
    assert "dense mask" in explain(x, x, x, torch.ones(8, 8, dtype=torch.bool)).reasons["flex"]
    assert "float64" in explain(x.double(), x.double(), x.double()).reasons["flex"]


def test_explain_says_a_compile_is_coming() -> None:
    x = torch.zeros(1, 1, 1, 1).expand(1, 4, 4096, 64)
    why = explain(x, x, x, M.sliding_window(255)).reasons["flex"]
    assert "not compiled for this shape yet, first call costs ~15 s" in why


def _torch_flex_is_sound() -> bool:
    """Whether torch's own compiled FlexAttention (no attnlab code) matches SDPA here.

    On this project's newer AVX2-only machines (AMD EPYC, no AVX-512), torch 2.13's
    compiled CPU FlexAttention returns wrong values even without a mask; that is the
    environment's, not attnlab's.
    """
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 40, 16, generator=g) for _ in range(3))
    out = torch.compile(flex_attention, dynamic=False)(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return bool(torch.allclose(out, ref, atol=1e-4, rtol=1e-4))


@pytest.mark.slow
@pytest.mark.xfail(
    strict=False,
    reason="torch 2.13's compiled CPU FlexAttention intermittently returns 1-3 wrong rows of 40 "
    "for this per-batch document pattern (seen on main before issue 8 and again after KV heads "
    "were repeated on CPU); a known open defect of the flex backend on CPU, see issue 8's notes",
)
def test_compiled_flex_equals_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("torch.compile on CPU needs a C++ compiler")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 40, 16, generator=g)
    k, v = (torch.randn(2, 2, 40, 16, generator=g) for _ in range(2))
    docs = torch.tensor([[0] * 15 + [1] * 25, [0] * 30 + [1] * 10])
    pattern = (M.document(docs) & M.sliding_window(8, 2) | M.global_tokens([0])).with_scores(
        alibi(4), softcap(5.0)
    )
    with caplog.at_level(logging.WARNING, logger="attnlab.backends.flex"):
        try:
            out = scaled_dot_product_attention(q, k, v, pattern, enable_gqa=True, backend="flex")
        except Exception as e:  # a broken toolchain is the environment's, not ours
            if "compile" in type(e).__module__ or "Inductor" in type(e).__name__:
                pytest.skip(f"torch.compile unavailable here: {e}")
            raise
    assert any("compiling FlexAttention" in r.getMessage() for r in caplog.records)
    ref, _ = sdpa_reference(
        q, k, v, pattern.to_dense(40, 40), enable_gqa=True, score_mods=pattern.score_mods
    )
    if not _torch_flex_is_sound():
        pytest.skip("torch's compiled CPU FlexAttention is wrong on this machine (AVX2 only)")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    # cached now: auto no longer charges the compile, and no second warning
    assert "not compiled" not in explain(q, k, v, pattern, enable_gqa=True).reasons["flex"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="attnlab.backends.flex"):
        scaled_dot_product_attention(q, k, v, pattern, enable_gqa=True, backend="flex")
    assert not caplog.records
    assert flex_mod._kernels
    _, w = scaled_dot_product_attention(
        q, k, v, pattern, enable_gqa=True, backend="flex", return_weights=True
    )
    _, ref_w = sdpa_reference(
        q,
        k,
        v,
        pattern.to_dense(40, 40),
        enable_gqa=True,
        score_mods=pattern.score_mods,
        return_weights=True,
    )
    torch.testing.assert_close(w, ref_w, atol=1e-5, rtol=1e-4)


def _needs_cxx() -> None:
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("torch.compile on CPU needs a C++ compiler")


def test_refuses_rather_than_running_unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    """No fused kernel to be had: the check says why, auto passes flex over, a direct call raises."""
    x = torch.randn(1, 2, 200, 8)
    pattern = M.sliding_window(16)
    assert "limit" not in explain(x, x, x, pattern).reasons["flex"]  # it can run here
    monkeypatch.setattr(flex_mod, "MAX_FAMILIES", len(flex_mod._entries))
    monkeypatch.setattr(flex_masks, "_block_masks", type(flex_masks._block_masks)())
    new_family = M.sliding_window(17)  # a window this process has not compiled
    why = explain(x, x, x, new_family).reasons["flex"]
    assert "limit" in why and "every sequence length" in why
    assert explain(x, x, x, new_family).chosen != "flex"
    with pytest.raises(
        ValueError, match="backend 'flex' .* cannot run this call: already compiled"
    ):
        scaled_dot_product_attention(x, x, x, new_family, backend="flex")
    with pytest.raises(RuntimeError, match="cannot get a fused FlexAttention kernel"):
        flex_mod.flex_attention(x, x, x, new_family)
    assert not flex_masks._block_masks  # refused before any work
    monkeypatch.setattr(flex_mod, "MAX_FAMILIES", 10**6)
    with torch._dynamo.config.patch(disable=True):
        assert "disabled" in explain(x, x, x, M.sliding_window(18)).reasons["flex"]


@pytest.mark.slow
def test_many_lengths_stay_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Twelve distinct lengths: two compiles (one static, one dynamic), never a fallback.

    With one static ``torch.compile`` object dynamo stops after 8 shapes and runs
    FlexAttention unfused (the whole score matrix). Each call here checks its values
    against the reference; the compile count says no length compiled on its own, and
    ``fullgraph=True`` would have raised on a fallback.
    """
    _needs_cxx()
    monkeypatch.setattr(flex_mod, "_broken", None)
    pattern = M.sliding_window(23).with_scores(softcap(20.0))  # a family of its own
    before = flex_mod.compiled_kernels()
    checked_sound = False
    for i, n in enumerate(range(130, 130 + 12 * 41, 41)):  # 12 lengths, 2 to 5 tiles
        g = torch.Generator().manual_seed(i)
        q, k, v = (torch.randn(1, 2, n, 8, generator=g) for _ in range(3))
        out = scaled_dot_product_attention(q, k, v, pattern, is_causal=True, backend="flex")
        ref = scaled_dot_product_attention(q, k, v, pattern, is_causal=True, backend="reference")
        if not checked_sound and not torch.allclose(out, ref, atol=1e-5, rtol=1e-4):
            if not _torch_flex_is_sound():
                pytest.skip("torch's compiled CPU FlexAttention is wrong on this machine")
            checked_sound = True
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    assert flex_mod.compiled_kernels() - before == 2
    # every length is served now: auto no longer charges a compile for a new one
    q = torch.randn(1, 2, 999, 8)
    assert "not compiled" not in explain(q, q, q, pattern, is_causal=True).reasons["flex"]
    # dynamo's recompile limit reached: a clear error, and flex refused from then on
    monkeypatch.setattr(flex_mod, "_RECOMPILE_LIMIT", 1)
    short = torch.randn(1, 2, 40, 8)  # one tile: a size dynamo specialises, so a recompile
    with pytest.raises(RuntimeError, match="recompile limit .* score matrix"):
        scaled_dot_product_attention(short, short, short, pattern, is_causal=True, backend="flex")
    why = explain(q, q, q, pattern, is_causal=True).reasons["flex"]
    assert "recompile limit" in why
