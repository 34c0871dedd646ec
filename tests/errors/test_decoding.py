"""Class 8 in decoding: NaN or infinite logits make greedy and sampled decoding raise
``NonFiniteError`` naming the step and the rows, never emit a token (argmax of NaN is 0)
or fail inside ``torch.multinomial``.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.errors import NonFiniteError
from attnlab.functional.sampling import next_token
from attnlab.models import DecoderConfig, DecoderLM, Seq2SeqConfig, Seq2SeqLM

torch.manual_seed(0)
DECODER = DecoderLM(
    DecoderConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32,
    )
).eval()  # fmt: skip
SEQ2SEQ = Seq2SeqLM(
    Seq2SeqConfig(
        vocab_size=32, d_model=16, num_heads=2, d_ff=32, num_layers=1, tie_word_embeddings=False
    )
).eval()

POISON = {"nan": float("nan"), "+inf": float("inf"), "all -inf": float("-inf")}


def _poisoning_next_token(step: int, kind: str, row: int) -> Any:
    """``next_token`` with one row's logits spoiled at decoding step ``step``."""
    import attnlab.functional.sampling as sampling

    def wrapped(logits: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("step") == step:
            logits = logits.clone()
            if kind == "all -inf":
                logits[row, :] = float("-inf")
            else:
                logits[row, 3] = POISON[kind]
        return sampling.next_token(logits, **kwargs)

    return wrapped


@settings(max_examples=10)
@given(
    step=st.integers(0, 3),
    kind=st.sampled_from(list(POISON)),
    row=st.integers(0, 1),
    do_sample=st.booleans(),
    seq2seq=st.booleans(),
)
def test_non_finite_logits_stop_decoding_at_their_step(
    step: int, kind: str, row: int, do_sample: bool, seq2seq: bool
) -> None:
    model = SEQ2SEQ if seq2seq else DECODER
    generation = importlib.import_module("attnlab.generation.generate")

    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(generation, "next_token", _poisoning_next_token(step, kind, row))
        with pytest.raises(NonFiniteError, match=rf"decoding step {step}: .*row\(s\) \[{row}\]"):
            model.generate(ids, 5, do_sample=do_sample, generator=torch.Generator().manual_seed(0))


def test_nan_weights_stop_greedy_decoding_at_the_first_step() -> None:
    model = DecoderLM(DECODER.config).eval()
    with torch.no_grad():
        model.norm.weight[0] = float("nan")
    with pytest.raises(NonFiniteError, match="decoding step 0"):
        model.generate(torch.tensor([[1, 2]]), 3)


def test_next_token_checks_its_logits() -> None:
    logits = torch.randn(3, 10)
    logits[:, 0] = float("-inf")  # a masked token is fine
    assert next_token(logits).shape == (3,)
    logits[1, 4] = float("nan")
    for do_sample in (False, True):
        with pytest.raises(NonFiniteError, match=r"step 7: .*row\(s\) \[1\].*NaN"):
            next_token(logits, do_sample=do_sample, step=7)
    assert isinstance(NonFiniteError("x"), ValueError)


def test_finite_decoding_is_unchanged() -> None:
    ids = torch.tensor([[1, 2, 3]])
    out = DECODER.generate(ids, 4)
    assert out.shape == (1, 7)
