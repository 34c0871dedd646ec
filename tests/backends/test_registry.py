"""The backend registry: names, `use`, and `explain`."""

from __future__ import annotations

import pytest
import torch

from attnlab import backends
from attnlab import scaled_dot_product_attention as sdpa
from attnlab.functional import masks
from attnlab.functional.score_mods import softcap


def test_known_backends_and_unknown_name() -> None:
    assert {"reference", "sdpa"} <= set(backends.available())
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        sdpa(q, q, q, backend="nope")
    with pytest.raises(ValueError, match="unknown attention backend"), backends.use("nope"):
        pass


def test_use_sets_what_auto_resolves_to() -> None:
    q = torch.randn(1, 2, 4, 8)
    assert backends.explain(q, q, q).chosen == "sdpa"
    with backends.use("reference"):
        assert backends.current() == "reference"
        assert backends.explain(q, q, q).chosen == "reference"
        with backends.use("auto"):
            assert backends.explain(q, q, q).chosen == "sdpa"
    assert backends.current() == "auto"


def test_explain_gives_a_reason_for_every_backend() -> None:
    q = torch.randn(1, 2, 4, 8)
    ex = backends.explain(q, q, q, return_weights=True)
    assert ex.chosen == "reference"
    assert set(ex.reasons) == set(backends.available())
    assert "weights" in ex.reasons["sdpa"]
    assert "backend: reference" in str(ex)


def test_naming_a_backend_that_cannot_run_the_call_is_an_error() -> None:
    # issue 4: every exact backend returns weights; torch's kernel cannot soft-cap scores
    q = torch.randn(1, 2, 4, 8)
    capped = masks.causal().with_scores(softcap(5.0))
    with pytest.raises(ValueError, match="'sdpa'.*cannot run this call.*score modifiers"):
        sdpa(q, q, q, capped, backend="sdpa")


def test_a_call_the_used_backend_cannot_run_is_explained() -> None:
    q = torch.randn(1, 2, 4, 8)
    capped = masks.causal().with_scores(softcap(5.0))
    with backends.use("sdpa"), pytest.raises(ValueError, match="set by attnlab.backends.use"):
        sdpa(q, q, q, capped)
