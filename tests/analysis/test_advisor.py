"""The advisor: each recommendation is backed by the cost model's numbers."""

from __future__ import annotations

import json
import re

import pytest

from attnlab.analysis.advisor import advise
from attnlab.analysis.arch import preset
from attnlab.analysis.cost import estimate, human_bytes

TOPICS = {"attention", "window", "backend", "positions", "kv_heads", "dtype", "checkpointing"}


def _numbers(text: str) -> bool:
    return bool(re.search(r"\d+(\.\d+)? (GiB|MiB|KiB|ms|GFLOP|TFLOP)", text))


def test_short_classification_keeps_the_tutorial_defaults() -> None:
    a = advise("classification", seq_len=256, memory_gb=8)
    assert {r.topic for r in a.recommendations} == TOPICS
    assert a.get("attention").choice == "dense (full) attention"
    assert a.get("positions").choice.startswith("learned")
    assert a.get("kv_heads").choice == "12 of 12 (MHA)"
    assert a.get("checkpointing").choice == "off" and a.fits
    assert all(_numbers(r.reason) for r in a.recommendations if r.topic != "window")
    # the reason quotes the cost model's own figure
    r = estimate(preset("tutorial"), seq_len=256, mode="training", backend="sdpa")
    assert human_bytes(r.total_bytes) in a.get("attention").reason


def test_numbers_overrule_the_long_document_rule_of_thumb() -> None:
    a = advise("long-document", seq_len=2048, memory_gb=16)
    reason = a.get("attention").reason
    assert a.get("attention").choice == "dense (full) attention"
    assert "tutorial suggests a 512 window" in reason and "numbers win" in reason
    assert a.get("positions").choice == "RoPE or ALiBi"  # 2048 > 512 learned positions


def test_tight_memory_turns_on_bf16_and_checkpointing_with_the_savings() -> None:
    a = advise("long-document", seq_len=32768, memory_gb=4)
    assert a.fits and a.estimate.total_bytes <= 4 * 1024**3
    assert a.get("dtype").choice == "bfloat16"
    assert "float32 needs" in a.get("dtype").reason and "over your 4.0 GiB" in a.get("dtype").reason
    ck = a.get("checkpointing")
    assert ck.choice.startswith("on") and "without it activations take" in ck.reason


def test_latency_budget_picks_a_window_and_gqa_for_realtime() -> None:
    a = advise("realtime", seq_len=4096, memory_gb=4, latency_ms=50)
    assert a.get("kv_heads").choice.endswith("(GQA)")
    assert (
        "12 kv heads" in a.get("kv_heads").reason
        and "tutorial's real-time rule" in a.get("kv_heads").reason
    )
    lat = a.get("latency")
    assert lat.choice == "meets the budget"
    assert a.arch.num_kv_heads < a.arch.num_heads


def test_nothing_fits_says_so() -> None:
    a = advise("long-document", seq_len=8192, memory_gb=0.5)
    assert not a.fits and a.notes
    assert a.get("attention").choice.startswith("none fits")


def test_json_and_summary() -> None:
    a = advise("generation", seq_len=1024, memory_gb=8, latency_ms=100, device="cuda")
    data = json.loads(json.dumps(a.to_dict()))
    assert data["device"] == "cuda" and data["recommendations"]
    assert a.get("dtype").choice == "bfloat16"
    assert "why:" in a.summary()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(task="chat", seq_len=8, memory_gb=1), "unknown task 'chat'"),
        (dict(task="generation", seq_len=0, memory_gb=1), "seq_len must be a positive int, got 0"),
        (dict(task="generation", seq_len=8, memory_gb=0), "memory_gb must be > 0, got 0"),
        (dict(task="generation", seq_len=8, memory_gb=1, device="tpu"), "device must be"),
        (dict(task="generation", seq_len=8, memory_gb=1, latency_ms=-1), "latency_ms must be > 0"),
    ],
)
def test_bad_inputs(kwargs: dict[str, object], match: str) -> None:
    task = kwargs.pop("task")
    with pytest.raises(ValueError, match=match):
        advise(task, **kwargs)  # type: ignore[arg-type]


def test_generation_total_counts_the_kv_cache_it_reasons_with() -> None:
    a = advise("generation", seq_len=8192, memory_gb=4)
    assert a.fits and a.total_bytes > a.estimate.total_bytes  # the KV cache is part of it
    assert a.total_bytes <= 4 * 1024**3
    totals = [
        line.strip() for line in a.summary().splitlines() if line.strip().startswith("total:")
    ]
    assert totals == [f"total: {human_bytes(a.total_bytes)} (fits)"]


def test_a_local_global_layout_over_its_latency_budget_halves_its_layers() -> None:
    """Gemma 2's alternating local/global layers: the distilled half keeps the pattern."""
    gemma = preset("gemma-2-2b")
    a = advise("generation", seq_len=2048, memory_gb=64, latency_ms=5, base=gemma)
    (latency,) = [r for r in a.recommendations if r.topic == "latency"]
    assert latency.choice.startswith("over budget")
    half = re.search(r"half the layers \((\d+), .*\) about (\d+) ms", latency.reason)
    assert half is not None and int(half.group(1)) == gemma.num_layers // 2
    full = re.search(r"about (\d+) ms", latency.reason)
    assert full is not None and 0 < int(half.group(2)) < int(full.group(1))
