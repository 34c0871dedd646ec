"""``attnlab diagnose`` on an MoE model folder: expert load, and the collapsed-router fault."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from attnlab.cli.main import main

tf = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from attnlab.interop.pretrained import minilm_path

    folder = tmp_path_factory.mktemp("tiny-mixtral")
    cfg = tf.MixtralConfig(
        vocab_size=30522,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 1.0)
    model.save_pretrained(folder)
    src = Path(minilm_path())
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(src / name, folder / name)
    return folder


def test_diagnose_reports_expert_load_and_the_injected_collapse(
    mixtral_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = ["time flies like an arrow and fruit flies like a banana"]
    args = ["diagnose", "--model", str(mixtral_dir), "--text", text[0]]
    assert main([*args, "--json"]) == 0
    healthy = json.loads(capsys.readouterr().out)
    assert len(healthy["experts"]) == 2 and not any(x["collapsed"] for x in healthy["experts"])
    assert main([*args, "--inject", "collapsed-router"]) == 1
    out = capsys.readouterr().out
    assert "[router_collapse] layers.1.feed_forward" in out and "COLLAPSED" in out


def test_collapsed_router_needs_an_moe_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagnose", "--inject", "collapsed-router"]) == 2
    assert "needs a model with MoE layers" in capsys.readouterr().err
