"""``attnlab chat``: SmolLM2 answers, history kept within the context, folders without a
template refused with what to do; ``attnlab convert`` both ways."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import attnlab
from attnlab.cli.chat import Conversation
from attnlab.cli.main import main
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig

transformers = pytest.importorskip("transformers")


@pytest.fixture
def default_model(smollm2: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Commands that load SmolLM2 get the session's copy instead of reading the file again."""
    monkeypatch.setattr(attnlab, "from_gguf", lambda *a, **k: smollm2)
    return smollm2


def test_prompt_answers_with_the_default_model(
    default_model: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    q = "What is the capital of France? Answer in one sentence."
    assert main(["chat", "--prompt", q, "--max-new-tokens", "16"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_messages_on_stdin_are_one_conversation(
    default_model: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stdin = io.StringIO("My name is Ada.\n\nWhat is my name?\n")
    monkeypatch.setattr("sys.stdin", stdin)
    args = ["chat", "--json", "--max-new-tokens", "12", "--system", "Be brief."]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    roles = [m["role"] for m in data["messages"]]
    assert data["model"] == "SmolLM2-135M-Instruct"
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert data["messages"][1]["content"] == "My name is Ada."
    assert all(m["content"].strip() for m in data["messages"])


def test_old_turns_are_dropped_to_fit_the_context(smollm2: Any) -> None:
    tok = smollm2.tokenizer

    def length(messages: list[dict[str, str]]) -> int:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return len(tok.encode(text, add_special_tokens=False))

    system = {"role": "system", "content": "Be brief."}
    u1, a1 = "one two three", "four five six " * 15
    full = length(
        [
            system,
            {"role": "user", "content": u1},
            {"role": "assistant", "content": a1},
            {"role": "user", "content": "seven"},
        ]
    )
    short = length([system, {"role": "user", "content": "seven"}])
    budget = (full + short) // 2  # room for the last message, not for the whole history
    conv = Conversation(tok, context=budget + 10, max_new_tokens=10, system="Be brief.")
    conv.prompt_ids(u1)
    conv.answered(a1)
    assert conv.dropped == 0
    assert len(conv.prompt_ids("seven")) == short
    assert conv.dropped == 1
    assert conv.messages() == [system, {"role": "user", "content": "seven"}]
    with pytest.raises(ValueError, match="takes .* tokens with the template; the context holds"):
        conv.prompt_ids("word " * 200)
    assert conv.messages() == [system, {"role": "user", "content": "seven"}]


def _tiny_folder(tmp_path: Path, *, chat_template: str | None = None) -> Path:
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["hello there, how are you"] * 10, vocab_size=280)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="!")
    if chat_template:
        tok.chat_template = chat_template
    torch.manual_seed(0)
    config = DecoderConfig.llama(
        vocab_size=288, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
    )  # fmt: skip
    folder = tmp_path / "tiny"
    attnlab.to_hf(DecoderLM(config)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_a_folder_without_a_chat_template_says_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _tiny_folder(tmp_path)
    assert main(["chat", str(folder), "--prompt", "hello"]) == 1
    err = capsys.readouterr().err
    assert "has no chat template" in err and "--chat-template" in err
    args = ["chat", str(folder), "--prompt", "hello", "--chat-template", "chatml", "--json"]
    code = main([*args, "--max-new-tokens", "8"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["messages"][0] == {
        "role": "user",
        "content": "hello",
    }
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["chat", str(folder), "--chat-template", str(empty / "none.jinja")]) == 1
    assert "cannot be read" in capsys.readouterr().err
    assert main(["chat", str(folder), "--prompt", "x", "--temperature", "0.5"]) == 2
    assert "add --sample" in capsys.readouterr().err


def test_convert_folder_to_gguf_and_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _tiny_folder(
        tmp_path, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    gguf_file = tmp_path / "tiny.q8_0.gguf"
    assert main(["convert", str(folder), str(gguf_file), "--dtype", "q8_0"]) == 0
    back = tmp_path / "back"
    capsys.readouterr()
    assert main(["convert", str(gguf_file), str(back), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["out"] == str(back) and report["mib"] > 0
    ids = torch.tensor([[1, 7, 30, 200]])
    with torch.no_grad():
        a = attnlab.from_gguf(gguf_file)(input_ids=ids).logits
        b = attnlab.from_hf(back)(input_ids=ids).logits
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(back))(ids).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(hf, b, rtol=1e-4, atol=1e-4)
    tok = transformers.AutoTokenizer.from_pretrained(str(back))
    assert tok.encode("hello there") == attnlab.from_gguf(gguf_file).tokenizer.encode("hello there")
    assert tok.chat_template is not None
    # generate and visualize take the .gguf file too
    capsys.readouterr()
    assert (
        main(["generate", "--model", str(gguf_file), "--prompt", "hello", "--max-new-tokens", "3"])
        == 0
    )
    assert capsys.readouterr().out.startswith("hello")
    pictures = tmp_path / "pictures"
    assert (
        main(
            [
                "visualize",
                "--model",
                str(gguf_file),
                "--text",
                "hello there",
                "--out",
                str(pictures),
            ]
        )
        == 0
    )
    assert (pictures / "index.html").is_file()
    assert main(["convert", str(folder), str(tmp_path / "x"), "--dtype", "f16"]) == 2
    assert "applies to a .gguf OUT" in capsys.readouterr().err
