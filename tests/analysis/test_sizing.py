"""Sizing advice: the recommended shape is checked against the cost model that costs it."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnlab.analysis.cost import estimate
from attnlab.analysis.sizing import ASPECT_RANGE, TOKENS_PER_PARAMETER, size_model


@given(
    params=st.sampled_from([30e6, 120e6, 400e6, 1.5e9]),
    context=st.sampled_from([256, 1024, 4096]),
)
def test_parameter_budget_is_met_and_costed(params: float, context: int) -> None:
    a = size_model(params=params, context=context, memory_gb=1024)
    # the cost model counts the recommended architecture at the budget (within 10 %)
    assert a.parameters == estimate(a.arch, seq_len=context).parameter_count
    assert abs(math.log(a.parameters / params)) < 0.1
    assert ASPECT_RANGE[0] <= a.arch.hidden_size / a.arch.num_layers <= ASPECT_RANGE[1]
    assert a.arch.num_heads * a.arch.head_dim == a.arch.hidden_size
    assert a.tokens == pytest.approx(TOKENS_PER_PARAMETER * a.parameters)
    assert a.train_flops == pytest.approx(6 * a.parameters * a.tokens)


def test_compute_budget_is_compute_optimal() -> None:
    c = 1e19
    a = size_model(compute_flops=c, context=1024, memory_gb=1024)
    # Hoffmann et al.: C = 6 N D with D = 20 N
    assert a.train_flops == pytest.approx(c, rel=0.25)
    assert any("Hoffmann" in r for r in a.reasons)


def test_memory_budget_holds_for_the_cost_model() -> None:
    a = size_model(params=3e9, context=2048, memory_gb=16)
    step = estimate(
        a.arch, seq_len=2048, mode="training", checkpointing=a.checkpointing
    ).total_bytes
    assert a.fits and step <= 16 * 1024**3
    assert a.train_memory_bytes == step
    assert a.parameters < 3e9  # shrunk to what fits, and said so
    assert any("memory-bound" in r for r in a.reasons)


def test_long_context_chooses_gqa_and_extrapolation_alibi() -> None:
    short = size_model(params=300e6, context=1024, memory_gb=64)
    long = size_model(params=300e6, context=4096, memory_gb=12, extrapolation=4)
    assert short.arch.attention_kind == "MHA" and short.arch.position == "rope"
    assert long.arch.num_kv_heads < long.arch.num_heads
    assert long.kv_cache_bytes <= 0.1 * 12 * 1024**3
    assert long.arch.position == "alibi"


def test_given_tokens_are_judged() -> None:
    a = size_model(params=1e9, tokens=1e9, context=1024, memory_gb=1024)
    assert a.tokens == 1e9
    assert any("under-trained" in r for r in a.reasons)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"params": 1e6, "hours": 1.0}, "exactly one budget"),
        ({}, "exactly one budget"),
        ({"params": float("inf")}, "params"),
        ({"params": -5.0}, "params"),
        ({"params": 1e6, "extrapolation": 0.5}, "extrapolation"),
        ({"params": 1e6, "dtype": "int8"}, "dtype"),
    ],
)
def test_bad_budgets_are_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        size_model(context=1024, memory_gb=8, **kwargs)


def test_cli_sizing_json_is_strict() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "attnlab.cli",
            "advise",
            "--params",
            "20M",
            "--seq-len",
            "512",
            "--memory-gb",
            "4",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout, parse_constant=lambda c: pytest.fail(f"non-finite {c}"))
    assert data["arch"]["num_layers"] >= 1 and data["reasons"]
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "attnlab.cli",
            "advise",
            "--params",
            "zero",
            "--seq-len",
            "512",
            "--memory-gb",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "--params" in bad.stderr
