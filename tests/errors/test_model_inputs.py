"""Classes 1 and 3 at the model level: a model given no tokens raises ``ValueError``, and an
``attention_mask`` that is not 1/0 is refused the same way by every model and by
``generate``/``stream`` (one validator: ``attnlab.functional._checks.check_binary_mask``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.models import (
    DecoderConfig,
    DecoderLM,
    EncoderConfig,
    EncoderModel,
    Seq2SeqConfig,
    Seq2SeqLM,
)

torch.manual_seed(0)
ENCODER = EncoderModel(
    EncoderConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16,
    )
).eval()  # fmt: skip
DECODER = DecoderLM(
    DecoderConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16,
    )
).eval()  # fmt: skip
SEQ2SEQ = Seq2SeqLM(
    Seq2SeqConfig(vocab_size=32, d_model=16, num_heads=2, d_ff=32, num_layers=1)
).eval()

ids4 = torch.tensor([[1, 2, 3, 4]])


def _seq2seq(ids: torch.Tensor, mask: torch.Tensor | None = None) -> Any:
    return SEQ2SEQ(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :1])


# entry points taking (input_ids, attention_mask)
MODEL_CALLS: dict[str, Callable[[torch.Tensor, torch.Tensor | None], Any]] = {
    "encoder": lambda ids, m: ENCODER(ids, attention_mask=m),
    "decoder": lambda ids, m: DECODER(ids, attention_mask=m),
    "seq2seq": _seq2seq,
    "decoder.generate": lambda ids, m: DECODER.generate(ids, 2, attention_mask=m),
    "decoder.stream": lambda ids, m: list(DECODER.stream(ids, 2, attention_mask=m)),
    "seq2seq.generate": lambda ids, m: SEQ2SEQ.generate(ids, 2, attention_mask=m),
}


@pytest.mark.parametrize("entry", list(MODEL_CALLS))
@pytest.mark.parametrize("shape", [(1, 0), (0, 4), (0, 0)])
def test_no_tokens_is_a_value_error(entry: str, shape: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match=r"no tokens|non-empty"):
        MODEL_CALLS[entry](torch.zeros(shape, dtype=torch.long), None)


def test_no_tokens_through_embeddings_and_decoder_inputs() -> None:
    with pytest.raises(ValueError, match="inputs_embeds holds no tokens"):
        ENCODER(inputs_embeds=torch.zeros(1, 0, 16))
    with pytest.raises(ValueError, match="at least one token"):
        DECODER(inputs_embeds=torch.zeros(1, 0, 16))
    with pytest.raises(ValueError, match="decoder_input_ids holds no tokens"):
        SEQ2SEQ(input_ids=ids4, decoder_input_ids=torch.zeros(1, 0, dtype=torch.long))


bad_mask_values = st.one_of(
    st.sampled_from([2.0, -1.0, 0.5, float("-inf"), float("nan"), float("inf")]),
    st.floats(allow_nan=False, width=32).filter(lambda x: x not in (0.0, 1.0)),
    st.integers(min_value=-5, max_value=5).filter(lambda x: x not in (0, 1)),
)


@pytest.mark.parametrize("entry", list(MODEL_CALLS))
def test_masks_other_than_one_zero_are_refused(entry: str) -> None:
    @settings(max_examples=8)
    @given(bad=bad_mask_values, where=st.integers(0, 3))
    def check(bad: float, where: int) -> None:
        dtype = torch.long if isinstance(bad, int) else torch.float32
        mask = torch.ones(1, 4, dtype=dtype)
        mask[0, where] = bad
        with pytest.raises(ValueError, match=r"attention_mask must hold only 1 \(token\) and 0"):
            MODEL_CALLS[entry](ids4, mask)

    check()


@pytest.mark.parametrize("entry", list(MODEL_CALLS))
def test_additive_float_masks_point_to_attn_mask(entry: str) -> None:
    additive = torch.tensor([[float("-inf"), 0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="goes to attn_mask"):
        MODEL_CALLS[entry](ids4, additive)


@pytest.mark.parametrize("entry", list(MODEL_CALLS))
@pytest.mark.parametrize("dtype", [torch.bool, torch.long, torch.float32, torch.int8])
def test_one_zero_masks_of_any_dtype_are_accepted(entry: str, dtype: torch.dtype) -> None:
    MODEL_CALLS[entry](ids4, torch.tensor([[0, 1, 1, 1]]).to(dtype))


@pytest.mark.parametrize("entry", ["encoder", "decoder", "seq2seq", "decoder.generate"])
def test_mask_shapes_and_types(entry: str) -> None:
    with pytest.raises(ValueError, match=r"attention_mask.*(\(1, 3\)|covers 3)"):
        MODEL_CALLS[entry](ids4, torch.ones(1, 3))
    with pytest.raises(TypeError, match="attention_mask must be a torch.Tensor, got list"):
        MODEL_CALLS[entry](ids4, [[1, 1, 1, 1]])  # type: ignore[arg-type]


def test_decoder_masks_are_checked_once_per_forward_not_per_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import attnlab.models.lm_shell as decoder_module  # the shell checks the mask

    calls = []
    original = decoder_module.check_binary_mask

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(decoder_module, "check_binary_mask", counting)
    deep = DecoderLM(
        DecoderConfig(
            vocab_size=32, hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=16,
        )
    ).eval()  # fmt: skip
    deep(ids4, attention_mask=torch.tensor([[0, 1, 1, 1]]))
    assert len(calls) == 1


@pytest.mark.parametrize("entry", ["encoder", "decoder", "seq2seq"])
def test_token_ids_out_of_range_or_of_the_wrong_type(entry: str) -> None:
    with pytest.raises(ValueError, match=r"\[0, .*32.*got values in \[1, 99\]"):
        MODEL_CALLS[entry](torch.tensor([[1, 99]]), None)
    with pytest.raises(TypeError, match="integer tensor, got torch.float32"):
        MODEL_CALLS[entry](torch.ones(1, 2), None)
