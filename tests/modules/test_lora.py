"""LoRALinear and apply_lora: identity at init, only adapters train, merge, errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.modules.lora import (
    LoRALinear,
    apply_lora,
    lora_modules,
    merge_and_unload,
    merge_lora,
    unmerge_lora,
)


def _model() -> DecoderLM:
    torch.manual_seed(0)
    cfg = DecoderConfig.llama(
        vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, max_position_embeddings=32,
    )  # fmt: skip
    return DecoderLM(cfg).eval()


def test_fresh_adapter_computes_the_base_and_only_adapters_train():
    model = _model()
    ids = torch.randint(0, 61, (2, 9))
    before = model(input_ids=ids).logits
    from attnlab.interop.peft import resolve_targets

    apply_lora(model, resolve_targets(model, "q_proj,o_proj,down_proj"), rank=4, alpha=8)
    torch.testing.assert_close(model(input_ids=ids).logits, before)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(list(lora_modules(model))) == 6  # 3 targets x 2 layers
    # o_proj (transformers' name) is attnlab's out_proj
    assert isinstance(model.layers[0].self_attention.out_proj, LoRALinear)


def test_scaling_and_rslora():
    base = nn.Linear(8, 5)
    assert LoRALinear(base_layer=base, rank=4, alpha=8).scaling == 2.0
    rs = LoRALinear(base_layer=nn.Linear(8, 5), rank=4, alpha=8, use_rslora=True)
    assert rs.scaling == pytest.approx(8 / math.sqrt(4))


def test_forward_is_the_paper_formula_and_merge_roundtrips():
    torch.manual_seed(0)
    base = nn.Linear(8, 5)
    w0 = base.weight.detach().clone()
    m = LoRALinear(base_layer=base, rank=3, alpha=6)
    nn.init.normal_(m.lora_B.weight)
    x = torch.randn(4, 8, dtype=torch.float64)
    m64 = m.double()
    want = x @ (w0.double() + 2.0 * m64.lora_B.weight @ m64.lora_A.weight).T + base.bias
    torch.testing.assert_close(m64(x), want)
    m64.merge()
    torch.testing.assert_close(m64(x), want)
    m64.unmerge()
    torch.testing.assert_close(m64.base_layer.weight, w0.double())
    lin = m64.merged_linear()
    torch.testing.assert_close(lin(x), want)


def test_model_merge_unmerge_and_unload():
    model = _model()
    apply_lora(
        model, ["layers.0.self_attention.q_proj", "layers.1.feed_forward.up_proj"], rank=2, alpha=4
    )
    for _, m in lora_modules(model):
        nn.init.normal_(m.lora_B.weight)
    ids = torch.randint(0, 61, (1, 7))
    want = model(input_ids=ids).logits.detach()
    merge_lora(model)
    torch.testing.assert_close(model(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
    unmerge_lora(model)
    merge_and_unload(model)
    assert not list(lora_modules(model))
    torch.testing.assert_close(model(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)


def test_optimizer_state_only_for_adapters():
    model = _model()
    apply_lora(model, ["layers.0.self_attention.v_proj"], rank=2, alpha=2)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    model.train()
    loss = model(input_ids=torch.randint(0, 61, (2, 6)), labels=torch.randint(0, 61, (2, 6))).loss
    loss.backward()
    opt.step()
    assert len(opt.state) == 2
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_errors_name_the_values():
    model = _model()
    with pytest.raises(ValueError, match="rank must be a positive integer, got 0"):
        LoRALinear(base_layer=nn.Linear(3, 3), rank=0, alpha=1)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.5"):
        LoRALinear(base_layer=nn.Linear(3, 3), rank=1, alpha=1, dropout=1.5)
    with pytest.raises(TypeError, match="got LayerNorm"):
        LoRALinear(base_layer=nn.LayerNorm(3), rank=1, alpha=1)
    with pytest.raises(ValueError, match="'layers.0.ffn_norm' is a RMSNorm, not a linear"):
        apply_lora(model, ["layers.0.ffn_norm"], rank=1, alpha=1)
    with pytest.raises(ValueError, match="'nope' is not a module"):
        apply_lora(model, ["nope"], rank=1, alpha=1)
    from attnlab.interop.peft import resolve_targets

    with pytest.raises(ValueError, match=r"'qproj' matches no linear layer.*'q_proj'"):
        resolve_targets(model, ["qproj"])
    apply_lora(model, ["layers.0.self_attention.q_proj"], rank=1, alpha=1)
    with pytest.raises(ValueError, match="already has a LoRA adapter"):
        apply_lora(model, ["layers.0.self_attention.q_proj"], rank=1, alpha=1)


def test_gradient_checkpointing_and_bf16_autocast_keep_the_adapters_training():
    model = _model()
    apply_lora(
        model,
        ["layers.0.self_attention.q_proj", "layers.1.feed_forward.down_proj"],
        rank=2,
        alpha=4,
    )
    for _, m in lora_modules(model):
        nn.init.normal_(m.lora_B.weight, std=0.1)
    model.train()
    ids = torch.randint(0, 61, (2, 9))

    def grads(ckpt: bool) -> dict[str, torch.Tensor]:
        model.config.gradient_checkpointing = ckpt
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    plain, ckpt = grads(False), grads(True)
    assert plain.keys() == ckpt.keys() and len(plain) == 4
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], atol=1e-6, rtol=1e-5)
    model.config.gradient_checkpointing = False
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
            torch.testing.assert_close(p.grad, plain[n], atol=0.05, rtol=0.1)
