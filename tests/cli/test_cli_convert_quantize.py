"""``attnlab convert --quantize``: a quantized GGUF file or folder that the other commands load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.cli.main import main
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.quantize import quantized_layers

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")


def _tiny_folder(tmp_path: Path) -> Path:
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["hello there, how are you"] * 10, vocab_size=280)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="!")
    torch.manual_seed(0)
    config = DecoderConfig.llama(
        vocab_size=288, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
    )  # fmt: skip
    folder = tmp_path / "tiny"
    attnlab.to_hf(DecoderLM(config)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_convert_quantize_to_gguf_and_to_a_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _tiny_folder(tmp_path)
    q4 = tmp_path / "tiny.q4_1.gguf"
    assert main(["convert", str(folder), str(q4), "--quantize", "int4"]) == 0
    kinds = {
        gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(str(q4)).tensors
    }
    assert kinds == {"Q4_1", "F32"}
    loaded = attnlab.from_gguf(q4, quantize="gguf")
    assert {m.kind for m in quantized_layers(loaded).values()} == {"int4"}
    out = tmp_path / "tiny-int8"
    assert main(["convert", str(folder), str(out), "--quantize", "int8"]) == 0
    assert (out / "attnlab_quantized.json").is_file() and (out / "tokenizer.json").is_file()
    capsys.readouterr()
    # the quantized folder is a model the other commands run, as stored
    args = ["generate", "--model", str(out), "--prompt", "hello", "--max-new-tokens", "3"]
    assert main(args) == 0
    assert capsys.readouterr().out.startswith("hello")


def test_convert_quantize_refusals_name_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _tiny_folder(tmp_path)
    assert main(["convert", str(folder), str(tmp_path / "x.gguf"), "--quantize", "int8"]) == 2
    assert "--quantize int8 has no GGUF block type" in capsys.readouterr().err
    args = [
        "convert",
        str(folder),
        str(tmp_path / "x.gguf"),
        "--quantize",
        "int4",
        "--dtype",
        "f16",
    ]
    assert main(args) == 2
    assert "pass one" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()
