"""LoRA against peft 0.21: same base, same adapter weights -> same outputs and gradients.

Each case builds a small transformers model, converts it with ``from_hf``, adapts the
same modules on both sides (peft by its own names, attnlab by the same names), gives the
adapters the same random weights (``B`` non-zero, or the test would compare the base)
and compares the forward, the adapters' gradients, the merged weights and the exported
adapter folder loaded back by peft.
"""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import attnlab  # noqa: E402
from attnlab.interop.peft import (  # noqa: E402
    hf_module_names,
    load_peft_adapter,
    resolve_targets,
    save_peft_adapter,
)
from attnlab.modules.lora import (  # noqa: E402
    apply_lora,
    lora_modules,
    merge_and_unload,
    merge_lora,
    unmerge_lora,
)

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def _gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=97, n_positions=64, n_embd=48, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _bert() -> torch.nn.Module:
    cfg = transformers.BertConfig(
        vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=80, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertModel(cfg, add_pooling_layer=False)


CASES = {
    "llama": (
        _llama,
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "gpt2": (_gpt2, ["c_attn", "c_proj", "c_fc"]),
    "bert": (_bert, ["query", "value", "dense"]),
}


def _pair(name: str, *, rank: int = 4, alpha: float = 8.0, rslora: bool = False):
    torch.manual_seed(0)
    build, targets = CASES[name]
    hf = build().eval()
    ours = attnlab.from_hf(hf).float().eval()
    cfg = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
        use_rslora=rslora, fan_in_fan_out=name == "gpt2",
    )  # fmt: skip
    theirs = peft.get_peft_model(hf, cfg)
    apply_lora(ours, resolve_targets(ours, targets), rank=rank, alpha=alpha, use_rslora=rslora)
    # give peft's adapters random weights (B too), then copy them to attnlab through the
    # exported folder's own mapping
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in theirs.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return hf, theirs, ours


def _base(name: str) -> torch.nn.Module:
    """The same base weights as :func:`_pair`'s, without adapters."""
    torch.manual_seed(0)
    return attnlab.from_hf(CASES[name][0]().eval()).float()


def _inputs(name: str):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 97, (2, 11), generator=g)
    return {"input_ids": ids}


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_and_gradients_equal_peft(name, tmp_path):
    _hf, theirs, ours = _pair(name)
    theirs.save_pretrained(str(tmp_path / "peft"))
    chosen = sorted(p for p, _ in lora_modules(ours))  # by the names peft was given
    # a plain copy of the base, adapted from peft's own folder
    ours = load_peft_adapter(_base(name), tmp_path / "peft")
    assert sorted(p for p, _ in lora_modules(ours)) == chosen
    kw = _inputs(name)
    key = "last_hidden_state" if name == "bert" else "logits"
    out_t = getattr(theirs(**kw), key)
    out_o = getattr(ours(**kw), key)
    torch.testing.assert_close(out_o, out_t, **TOL)
    out_t.square().mean().backward()
    out_o.square().mean().backward()
    hf_names = hf_module_names(ours)
    grads_t = {n: p.grad for n, p in theirs.named_parameters() if p.grad is not None}
    assert grads_t and all("lora_" in n for n in grads_t)  # only adapters train
    for path, m in lora_modules(ours):
        assert m.base_layer.weight.grad is None
        theirs_name = hf_names[path]
        parent, _, part = theirs_name.rpartition(".")
        if part in ("q", "k", "v"):  # fused c_attn: A shared, B rows split
            ga = grads_t[f"base_model.model.{parent}.lora_A.default.weight"]
            gb = grads_t[f"base_model.model.{parent}.lora_B.default.weight"]
            gb = gb.chunk(3, dim=0)["qkv".index(part)]
        else:
            ga = grads_t[f"base_model.model.{theirs_name}.lora_A.default.weight"]
            gb = grads_t[f"base_model.model.{theirs_name}.lora_B.default.weight"]
            torch.testing.assert_close(m.lora_A.weight.grad, ga, **TOL)
        torch.testing.assert_close(m.lora_B.weight.grad, gb, **TOL)
        if part in ("q", "k", "v"):  # the shared A gathers the three parts' gradients
            torch.testing.assert_close(m.lora_A.weight.grad, ga, **TOL)
    assert all(p.grad is None for p in ours.parameters() if not p.requires_grad)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("rslora", [False, True])
def test_export_loads_in_peft_with_the_same_outputs(name, rslora, tmp_path):
    _hf, theirs, _ = _pair(name, rslora=rslora)
    theirs.save_pretrained(str(tmp_path / "peft"))
    ours = load_peft_adapter(_base(name), tmp_path / "peft")
    assert ours.get_submodule(next(p for p, _ in lora_modules(ours))).use_rslora is rslora
    save_peft_adapter(ours, tmp_path / "ours", base_model_name_or_path="tiny")
    reloaded = peft.PeftModel.from_pretrained(
        attnlab.to_hf(_base(name)), str(tmp_path / "ours")
    ).eval()
    kw = _inputs(name)
    key = "last_hidden_state" if name == "bert" else "logits"
    torch.testing.assert_close(getattr(reloaded(**kw), key), getattr(theirs(**kw), key), **TOL)
    torch.testing.assert_close(getattr(ours(**kw), key), getattr(theirs(**kw), key), **TOL)


@pytest.mark.parametrize("name", sorted(CASES))
def test_merge_equals_merge_and_unload(name, tmp_path):
    _hf, theirs, _ = _pair(name)
    theirs.save_pretrained(str(tmp_path / "peft"))
    ours = load_peft_adapter(_base(name), tmp_path / "peft")
    kw = _inputs(name)
    key = "last_hidden_state" if name == "bert" else "logits"
    before = getattr(ours(**kw), key).detach()
    merge_lora(ours)
    torch.testing.assert_close(getattr(ours(**kw), key), before, **TOL)
    unmerge_lora(ours)
    torch.testing.assert_close(getattr(ours(**kw), key), before, **TOL)
    merged_theirs = theirs.merge_and_unload()
    merged_ours = attnlab.to_hf(merge_and_unload(ours))
    want = merged_theirs.state_dict()
    for k, v in merged_ours.state_dict().items():
        torch.testing.assert_close(v, want[k], **TOL, msg=lambda m, k=k: f"{k}: {m}")
