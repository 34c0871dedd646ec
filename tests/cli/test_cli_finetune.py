"""``attnlab finetune``: LoRA and QLoRA runs on a tiny model, exports peft and transformers load."""

from __future__ import annotations

import json
import random

import pytest
import torch

import attnlab
from attnlab.cli.main import main
from attnlab.interop.peft import load_peft_adapter

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def chat_jsonl(tmp_path_factory):
    rng = random.Random(0)
    rows = []
    for i in range(80):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        if i % 2:
            rows.append(
                {"prompt": f"What is {a} plus {b}?", "completion": f"{a} plus {b} is {a + b}."}
            )
        else:
            rows.append({"messages": [
                {"role": "user", "content": f"Add {a} and {b}."},
                {"role": "assistant", "content": f"{a + b}"},
                {"role": "user", "content": "Double it."},
                {"role": "assistant", "content": f"{2 * (a + b)}"},
            ]})  # fmt: skip
    p = tmp_path_factory.mktemp("chat") / "rows.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def _run(capsys, *args):
    assert main(["finetune", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_lora_run_trains_and_exports_what_peft_and_transformers_load(
    chat_model_dir, chat_jsonl, tmp_path, capsys
):
    out = tmp_path / "run"
    s = _run(
        capsys, chat_model_dir, chat_jsonl, "--lora-rank", 4, "--steps", 16, "--lr", "1e-2",
        "--batch-size", 4, "--max-len", 96, "--lora-dropout", 0, "--out", out,
    )  # fmt: skip
    assert s["heldout_loss_after"] < s["heldout_loss_before"]
    assert 0 < s["trainable_params"] < s["total_params"]
    assert s["layout"] in ("packed", "padded") and s["layout"] in s["layout_reason"]
    for name in ("metrics.jsonl", "loss_curve.png", "finetune.json"):
        assert (out / name).is_file()
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(chat_model_dir)).eval()
    with_peft = peft.PeftModel.from_pretrained(base, str(out / "adapter")).eval()
    want = with_peft(input_ids=ids).logits
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out / "merged")).eval()
    torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
    ours = load_peft_adapter(attnlab.from_hf(chat_model_dir).float(), out / "adapter").eval()
    torch.testing.assert_close(ours(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
    # the merged model as GGUF, read back by attnlab's GGUF loader
    assert s["exports"]["gguf"] == str(out / "merged.gguf")
    from_file = attnlab.from_gguf(out / "merged.gguf").float().eval()
    torch.testing.assert_close(from_file(input_ids=ids).logits, want, atol=1e-4, rtol=1e-4)
    # the adapters moved away from zero: the run changed the model
    base_logits = attnlab.from_hf(chat_model_dir).float()(input_ids=ids).logits
    assert not torch.allclose(want, base_logits, atol=1e-3)


def test_qlora_run_trains_on_the_nf4_base(chat_model_dir, chat_jsonl, tmp_path, capsys):
    s = _run(
        capsys, chat_model_dir, chat_jsonl, "--qlora", "--lora-rank", 4, "--steps", 12,
        "--lr", "1e-2", "--batch-size", 4, "--max-len", 96, "--layout", "packed",
        "--out", tmp_path / "q",
    )  # fmt: skip
    assert s["heldout_loss_after"] < s["heldout_loss_before"]
    assert s["layout"] == "packed"
    assert (tmp_path / "q" / "merged" / "config.json").is_file()


def test_resume_continues_the_same_run(chat_model_dir, chat_jsonl, tmp_path, capsys):
    common = [chat_model_dir, chat_jsonl, "--lora-rank", 2, "--steps", 4, "--batch-size", 2,
              "--max-len", 96, "--lora-dropout", 0, "--layout", "padded"]  # fmt: skip
    full = _run(capsys, *common, "--out", tmp_path / "a")
    _run(capsys, *common, "--save-every", 2, "--out", tmp_path / "b")
    ckpt = tmp_path / "b" / "checkpoints" / "step-2"
    resumed = _run(capsys, *common, "--out", tmp_path / "b", "--resume", ckpt)
    assert resumed["train_loss"] == pytest.approx(full["train_loss"], rel=1e-12)


def test_user_errors_are_one_line(chat_model_dir, chat_jsonl, tmp_path, capsys):
    assert main(["finetune", str(chat_model_dir), str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err
    code = main(["finetune", str(chat_model_dir), str(chat_jsonl), "--targets", "qkv"])
    assert code == 2 and "matches no linear layer" in capsys.readouterr().err
    code = main(["finetune", str(chat_model_dir), str(chat_jsonl), "--lora-rank", "0"])
    assert code == 2 and "lora-rank" in capsys.readouterr().err
