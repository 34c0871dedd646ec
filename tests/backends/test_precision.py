"""``dtype="auto"``: bfloat16 where torch says the CPU multiplies it natively, float32
elsewhere. Both branches are tested on every machine by setting torch's answer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.backends import precision
from attnlab.backends.precision import choose_float_dtype, native_bf16
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch) -> object:
    """Set what this CPU answers (``cpu(True)``: AVX-512 BF16/AMX; ``cpu(False)``: AVX2)."""

    def answer(native: bool) -> None:
        monkeypatch.setattr(precision, "_NATIVE_BF16", [native])

    return answer


def test_auto_follows_torchs_answer_about_the_cpu(cpu: object) -> None:
    cpu(True)  # type: ignore[operator]
    amx = choose_float_dtype("auto")
    assert amx.dtype == torch.bfloat16 and "natively" in amx.reason
    cpu(False)  # type: ignore[operator]
    avx2 = choose_float_dtype("auto")
    assert avx2.dtype == torch.float32 and "no native bfloat16" in str(avx2)
    # asked, never chosen: a named dtype is taken as it is on either CPU
    assert choose_float_dtype("bfloat16").dtype == torch.bfloat16
    assert choose_float_dtype(torch.float16).dtype == torch.float16
    with pytest.raises(ValueError, match=r"dtype must be one of \['auto'"):
        choose_float_dtype("int8")
    with pytest.raises(ValueError, match="dtype must be one of"):
        choose_float_dtype(torch.int8)


def test_the_real_answer_is_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "_NATIVE_BF16", [])
    want = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert native_bf16() == bool(want)


@pytest.mark.parametrize("native", [True, False])
def test_from_gguf_auto_loads_in_the_chosen_dtype(
    tmp_path: Path, cpu: object, native: bool
) -> None:
    pytest.importorskip("gguf")
    torch.manual_seed(0)
    config = DecoderConfig.llama(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32,
    )  # fmt: skip
    path = attnlab.to_gguf(DecoderLM(config).eval(), tmp_path / "t.gguf")
    cpu(native)  # type: ignore[operator]
    model = attnlab.from_gguf(path, dtype="auto", tokenizer=False)
    want = torch.bfloat16 if native else torch.float32
    assert model.dtype_choice.dtype == want
    assert {p.dtype for p in model.parameters()} == {want}
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.dtype == want and bool(torch.isfinite(logits).all())
