"""``attnlab generate``: random tiny models and local transformers folders, streamed output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.cli.main import main


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mistral", "bloom", "t5"])
def test_random_model_streams_tokens(arch: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "--random", arch, "--prompt", "hi", "--max-new-tokens", "5"])
    out = capsys.readouterr().out
    assert code == 0
    if arch != "t5":
        assert out.startswith("hi")
    assert out.endswith("\n") and len(out.strip()) > 2


def test_local_folder_with_ids_matches_the_library(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=48, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    code = main(["generate", "--model", str(tmp_path), "--ids", "3 4 5", "--max-new-tokens", "6"])
    out = capsys.readouterr().out.split()
    expected = attnlab.from_hf(tmp_path).generate(torch.tensor([[3, 4, 5]]), 6)[0, 3:]
    assert code == 0 and [int(t) for t in out] == expected.tolist()
    code = main(["generate", "--model", str(tmp_path), "--prompt", "hello"])
    assert code == 2
    assert "no tokenizer" in capsys.readouterr().err


def test_bad_sampling_settings_are_reported(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "--random", "llama", "--ids", "1", "--sample", "--top-p", "2"])
    assert code == 2
    assert "--top-p" in capsys.readouterr().err


def test_local_folder_with_a_tokenizer_streams_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    words = ["<pad>", "<unk>"] + [f"w{i}" for i in range(48)]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>"
    )
    fast.save_pretrained(tmp_path)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=48, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    code = main(
        ["generate", "--model", str(tmp_path), "--prompt", "w1 w2 w3", "--max-new-tokens", "4"]
    )
    out = capsys.readouterr().out.strip()
    new = attnlab.from_hf(tmp_path).generate(torch.tensor([[3, 4, 5]]), 4)[0, 3:]
    assert code == 0
    assert out == "w1 w2 w3 " + " ".join(words[i] for i in new.tolist())


def test_compile_is_refused_for_an_encoder_decoder(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "--random", "t5", "--ids", "1 2", "--compile"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--compile" in err and "Seq2SeqLM" in err and "Traceback" not in err


def test_sink_window_streams_as_the_library_does(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    import torch

    from attnlab.cli.generate import random_model
    from attnlab.generation import generate, sink_cache

    args = ["generate", "--random", "llama", "--ids", "1 2 3 4 5 6", "--max-new-tokens", "20"]
    assert main([*args, "--sink-window", "6", "--sinks", "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["new_ids"]
    model = random_model("llama", 0)
    cache = sink_cache(model, window=6, sinks=2)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    want = generate(model, ids, 20, cache=cache)[0, 6:].tolist()
    assert got == want
    plain = generate(model, ids, 20)[0, 6:].tolist()
    assert got != plain  # the cache evicted: not the full-context decoding


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--random", "llama", "--sinks", "2"], "add --sink-window"),
        (["--random", "llama", "--sink-window", "8", "--compile"], "drop --compile"),
        (["--random", "gpt2", "--sink-window", "8"], "'learned'"),
        (["--random", "t5", "--sink-window", "8"], "encoder-decoder"),
    ],
)
def test_sink_window_refusals(
    extra: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", *extra, "--ids", "1 2"]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("flag", "want"), [([], None), (["--no-compile"], False), (["--compile"], True)]
)
def test_compile_defaults_to_generates_own_rule(
    flag: list[str], want: bool | None, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    from attnlab.generation import compiled
    from attnlab.models.lm_shell import CausalLMShell

    seen: dict[str, object] = {}
    real = CausalLMShell.stream

    def spy(self: object, *args: object, **kwargs: object) -> object:
        seen["compile"] = kwargs["compile"]
        if kwargs["compile"]:  # stands for a compile: the report the CLI must show
            records = self.__dict__.setdefault("_compile_records", [])  # type: ignore[attr-defined]
            records.append(compiled.CompileRecord(1, 128, 12.5))
        kwargs["compile"] = False
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(CausalLMShell, "stream", spy)
    args = ["generate", "--random", "llama", "--ids", "1 2 3", "--max-new-tokens", "3", "--json"]
    assert main([*args, *flag]) == 0
    assert seen["compile"] is want
    captured = capsys.readouterr()
    import json

    report = json.loads(captured.out)["compile"]
    if want:
        assert report == [{"batch_size": 1, "cache_slots": 128, "seconds": 12.5}]
        assert "compiled the decode step in 12.5 s" in captured.err
    else:
        assert report == [] and "compiled" not in captured.err
