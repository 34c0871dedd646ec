"""SmolLM2-135M-Instruct, the real decoder: attnlab's GGUF load against transformers' own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.interop.gguf_reader import read_gguf
from attnlab.interop.gguf_writer import write_gguf

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def _chat_ids(model: torch.nn.Module, messages: list[dict[str, str]]) -> torch.Tensor:
    tok = model.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return torch.tensor([tok.encode(text, add_special_tokens=False)])


def test_config_and_special_tokens(smollm2: torch.nn.Module) -> None:
    c = smollm2.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads) == (30, 576, 9)
    assert (c.num_key_value_heads, c.vocab_size, c.rope_theta) == (3, 49152, 100000.0)
    assert c.tie_word_embeddings and c.max_position_embeddings == 8192
    tok = smollm2.tokenizer
    assert (tok.eos_token, tok.bos_token) == ("<|im_end|>", "<|im_start|>")
    assert smollm2.generation_config["eos_token_id"] == tok.eos_token_id == 2
    text = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_greedy_answer_to_a_factual_question(smollm2: torch.nn.Module) -> None:
    ids = _chat_ids(smollm2, QUESTION)
    eos = smollm2.generation_config["eos_token_id"]
    out = smollm2.generate(ids, 16, eos_token_id=eos)
    answer = smollm2.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_tokenizer_matches_transformers_gguf_tokenizer(
    smollm2: torch.nn.Module, smollm2_file: Path
) -> None:
    # the class AutoTokenizer resolves to, without AutoConfig reading the whole file again
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(
        str(smollm2_file.parent), gguf_file=smollm2_file.name
    )
    ours = smollm2.tokenizer
    texts = [
        "The quick brown fox, 1234 héllo\n\n  x",
        "<|im_start|>user\nhi<|im_end|>",
        " def f():",
    ]
    for text in texts:
        assert ours.encode(text) == ref.encode(text)
        assert ours.decode(ref.encode(text)) == ref.decode(ref.encode(text))
    assert ours.apply_chat_template(QUESTION, tokenize=False) == ref.apply_chat_template(
        QUESTION, tokenize=False
    )
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == (
        ref.bos_token,
        ref.eos_token,
        ref.pad_token,
        ref.unk_token,
    )


def _first_layers(src: Path, dst: Path, layers: int) -> Path:
    """A copy of ``src`` keeping its first ``layers`` blocks, their bytes unchanged (Q4_1/Q8_0)."""
    g = read_gguf(src)
    meta = {k: v for k, v in g.metadata.items() if not k.startswith("tokenizer.")}
    meta["llama.block_count"] = layers
    keep = [n for n in g.tensors if not n.startswith("blk.") or int(n.split(".")[1]) < layers]
    tensors = {}
    for name in keep:
        info = g.tensors[name]
        raw = g.raw(name).numpy()
        if info.kind.name == "F32":
            tensors[name] = (raw.view("float32").reshape(info.shape), "F32")
        else:  # rows of blocks, as the writer takes them
            tensors[name] = (raw.reshape(info.shape[0], -1), info.kind.name)
    return write_gguf(dst, meta, tensors)


def test_logits_match_transformers_on_the_first_layers(smollm2_file: Path, tmp_path: Path) -> None:
    path = _first_layers(smollm2_file, tmp_path / "smollm2-3layers.gguf", 3)
    ours = attnlab.from_gguf(path, tokenizer=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    )
    ids = torch.tensor([[504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 26541, 314]])
    with torch.no_grad():
        a, b = ours(input_ids=ids).logits, hf(ids).logits
    assert a.shape == (1, 12, 49152)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_perplexity_matches_transformers_on_the_first_layers(
    smollm2: torch.nn.Module, smollm2_file: Path, tmp_path: Path
) -> None:
    from attnlab.analysis.perplexity import strided_perplexity

    path = _first_layers(smollm2_file, tmp_path / "smollm2-2layers.gguf", 2)
    ours = attnlab.from_gguf(path, tokenizer=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    )
    import pydoc_data.topics

    text = pydoc_data.topics.topics["assert"]
    ids = smollm2.tokenizer.encode(text)[:300]
    a = strided_perplexity(ours, ids, context=128, stride=64)
    b = strided_perplexity(hf, ids, context=128, stride=64)
    assert a.tokens == b.tokens == len(ids) - 1 and a.windows == b.windows
    assert a.perplexity == pytest.approx(b.perplexity, rel=1e-4)
