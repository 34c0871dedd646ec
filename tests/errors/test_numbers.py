"""Class 2 and 9 of the hardening issue: every number a user gives is checked where it
enters, for type, finiteness and range, and the message names the argument, the value
and what is accepted.

Each entry point is listed once with the argument's name and the kind of number it
takes; hypothesis draws bad values of every sort (NaN, infinities, out-of-range values,
strings, bools, floats where ints go) for each.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import scaled_dot_product_attention as sdpa
from attnlab.analysis import advise, estimate
from attnlab.functional.positions import rope_inv_freq
from attnlab.functional.sampling import check_sampling
from attnlab.models import DecoderConfig, EncoderConfig, Seq2SeqConfig
from attnlab.modules import MultiHeadAttention
from attnlab.modules.positions import RotaryEmbedding

q = torch.randn(1, 2, 3, 8)
tiny_dec: dict[str, Any] = dict(
    vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
    intermediate_size=32, max_position_embeddings=16,
)  # fmt: skip
tiny_enc: dict[str, Any] = dict(
    vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
    intermediate_size=32, max_position_embeddings=16,
)  # fmt: skip
tiny_s2s: dict[str, Any] = dict(vocab_size=32, d_model=16, num_heads=2, d_ff=32, num_layers=1)

NON_NUMBERS = st.sampled_from(["2", "", "nan", [1.0], True, False, b"1", 1j])
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])


def bad_positive_float() -> st.SearchStrategy[object]:
    return st.one_of(NON_NUMBERS, NON_FINITE, st.floats(max_value=0.0), st.integers(max_value=0))


def bad_at_least_one() -> st.SearchStrategy[object]:
    return st.one_of(NON_NUMBERS, NON_FINITE, st.floats(max_value=0.999, allow_nan=False))


def bad_probability() -> st.SearchStrategy[object]:
    return st.one_of(
        NON_NUMBERS,
        NON_FINITE,
        st.floats(max_value=-1e-9, allow_infinity=False),
        st.floats(min_value=1.0, allow_infinity=False),
    )


def bad_positive_int() -> st.SearchStrategy[object]:
    return st.one_of(
        NON_NUMBERS,
        NON_FINITE,
        st.integers(max_value=0),
        st.floats(min_value=0.5, max_value=100.5).filter(lambda x: x != int(x)),
    )


def bad_nonnegative_int() -> st.SearchStrategy[object]:
    return st.one_of(NON_NUMBERS, NON_FINITE, st.integers(max_value=-1), st.just(2.5))


def _scaling(kind: str) -> Callable[[object], dict[str, Any]]:
    def build(factor: object) -> dict[str, Any]:
        extra = {"low_freq_factor": 1.0, "high_freq_factor": 4.0} if kind == "llama3" else {}
        return {"rope_type": kind, "factor": factor, **extra}

    return build


# (argument name as the message shows it, entry point taking the bad value, bad values)
ENTRIES: list[tuple[str, Callable[[object], object], st.SearchStrategy[object]]] = [
    ("scale", lambda v: sdpa(q, q, q, scale=v), bad_positive_float()),
    ("dropout_p", lambda v: sdpa(q, q, q, dropout_p=v), bad_probability()),
    ("scale", lambda v: MultiHeadAttention(embed_dim=8, num_heads=2, scale=v), bad_positive_float()),
    ("dropout", lambda v: MultiHeadAttention(embed_dim=8, num_heads=2, dropout=v), bad_probability()),
    ("num_heads", lambda v: MultiHeadAttention(embed_dim=8, num_heads=v), bad_positive_int()),
    ("rope_theta", lambda v: DecoderConfig(**tiny_dec, rope_theta=v), bad_at_least_one()),
    ("norm_eps", lambda v: DecoderConfig(**tiny_dec, norm_eps=v), bad_positive_float()),
    ("hidden_size", lambda v: DecoderConfig(**{**tiny_dec, "hidden_size": v}), bad_positive_int()),
    ("attention_dropout", lambda v: DecoderConfig(**tiny_dec, attention_dropout=v), bad_probability()),
    ("sliding_window", lambda v: DecoderConfig(**tiny_dec, sliding_window=v), bad_positive_int()),
    ("pad_token_id", lambda v: DecoderConfig(**tiny_dec, pad_token_id=v), bad_nonnegative_int()),
    *(
        (
            "factor",
            lambda v, kind=kind: DecoderConfig(**tiny_dec, rope_scaling=_scaling(kind)(v)),
            bad_at_least_one(),
        )
        for kind in ("linear", "dynamic", "yarn", "llama3")
    ),
    ("layer_norm_eps", lambda v: EncoderConfig(**tiny_enc, layer_norm_eps=v), bad_positive_float()),
    ("hidden_dropout_prob", lambda v: EncoderConfig(**tiny_enc, hidden_dropout_prob=v), bad_probability()),
    ("type_vocab_size", lambda v: EncoderConfig(**tiny_enc, type_vocab_size=v), bad_nonnegative_int()),
    ("layer_norm_epsilon", lambda v: Seq2SeqConfig(**tiny_s2s, layer_norm_epsilon=v), bad_positive_float()),
    ("attention_scale", lambda v: Seq2SeqConfig(**tiny_s2s, attention_scale=v), bad_positive_float()),
    ("dropout_rate", lambda v: Seq2SeqConfig(**tiny_s2s, dropout_rate=v), bad_probability()),
    ("base", lambda v: RotaryEmbedding(dim=8, base=v), bad_at_least_one()),
    ("base", lambda v: rope_inv_freq(8, base=v), bad_at_least_one()),
    ("temperature", lambda v: check_sampling(do_sample=True, temperature=v, top_k=None, top_p=None), bad_positive_float()),
    ("top_k", lambda v: check_sampling(do_sample=True, temperature=1.0, top_k=v, top_p=None), bad_positive_int()),
    ("seq_len", lambda v: estimate(DecoderConfig(**tiny_dec), seq_len=v), bad_positive_int()),
    ("batch_size", lambda v: estimate(DecoderConfig(**tiny_dec), seq_len=8, batch_size=v), bad_positive_int()),
    ("window", lambda v: estimate(DecoderConfig(**tiny_dec), seq_len=8, window=v), bad_positive_int()),
    (
        "cache_capacity",
        lambda v: estimate(DecoderConfig(**tiny_dec), seq_len=8, mode="decode", cache_capacity=v),
        bad_nonnegative_int(),
    ),
    ("memory_gb", lambda v: advise("generation", seq_len=64, memory_gb=v), bad_positive_float()),
    ("latency_ms", lambda v: advise("generation", seq_len=64, memory_gb=1.0, latency_ms=v), bad_positive_float()),
    ("seq_len", lambda v: advise("generation", seq_len=v, memory_gb=1.0), bad_positive_int()),
]  # fmt: skip


def _shown(value: object) -> str:
    return repr(value)


@pytest.mark.parametrize(
    ("name", "call", "bad"), ENTRIES, ids=[f"{i}-{e[0]}" for i, e in enumerate(ENTRIES)]
)
def test_bad_numbers_are_refused_by_name(
    name: str, call: Callable[[object], object], bad: st.SearchStrategy[object]
) -> None:
    @settings(max_examples=20)
    @given(bad)
    def check(value: object) -> None:
        with pytest.raises((ValueError, TypeError)) as info:
            call(value)
        msg = str(info.value)
        assert name in msg, msg
        assert _shown(value) in msg, msg
        assert "must be" in msg, msg

    check()


@pytest.mark.parametrize(
    ("scaling", "needle"),
    [
        ({"rope_type": "linear"}, "needs a 'factor'"),
        ({"rope_type": "dynamic"}, "needs a 'factor'"),
        ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4, "high_freq_factor": 1}, "high_freq_factor > low_freq_factor"),
        ({"rope_type": "yarn", "factor": 4.0, "beta_fast": -1}, "beta_fast"),
        ({"rope_type": "yarn", "original_max_position_embeddings": 0}, "original_max_position_embeddings"),
        ({"rope_type": "su", "factor": 2.0}, "unknown RoPE scaling type 'su'"),
        ("linear", "rope_scaling must be a dict"),
    ],
)  # fmt: skip
def test_rope_scaling_is_refused_at_construction(scaling: object, needle: str) -> None:
    with pytest.raises((ValueError, TypeError), match=needle):
        DecoderConfig(**tiny_dec, rope_scaling=scaling)  # type: ignore[arg-type]


def test_good_numbers_still_pass() -> None:
    # integral numpy-free values of the right kind, at the edges of their ranges
    assert sdpa(q, q, q, scale=1e-3).isfinite().all()
    DecoderConfig(**tiny_dec, rope_theta=1.0, rope_scaling={"rope_type": "yarn"})
    DecoderConfig(**tiny_dec, rope_scaling={"rope_type": "linear", "factor": 1})
    EncoderConfig(**tiny_enc, hidden_dropout_prob=0, type_vocab_size=0)
    check_sampling(do_sample=True, temperature=0.01, top_k=1, top_p=1.0)
    estimate(DecoderConfig(**tiny_dec), seq_len=8, mode="decode", cache="static", cache_capacity=64)


def test_backend_names_are_checked_at_construction() -> None:
    with pytest.raises(ValueError, match=r"unknown attention backend 'bogus'; known: \['auto'"):
        MultiHeadAttention(embed_dim=8, num_heads=2, backend="bogus")
    with pytest.raises(TypeError, match="backend must be a backend name"):
        MultiHeadAttention(embed_dim=8, num_heads=2, backend=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'bogus'"):
        estimate(DecoderConfig(**tiny_dec), seq_len=8, backend="bogus")
