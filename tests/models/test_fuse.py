"""Fused q/k/v and gate/up (pack_model's ``fuse``): the same logits and tokens as the separate
layers on Llama/Qwen2/Gemma 2/Phi-3/GPT-2-style decoders, one graph when compiled, the state
dict and the saved files unchanged, in-place writes noticed, and refusals with reasons."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from attnlab.generation import generate
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.fuse import fuse_projections, fused_projections
from attnlab.models.inference import (
    FUSE_BY_DEFAULT,
    default_fuse,
    pack_model,
    packing_report,
    unpack_model,
)
from attnlab.modules.attention import MultiHeadAttention
from attnlab.modules.fused_linear import FusedProjection

COMMON: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    max_position_embeddings=64,
)
CONFIGS = {
    "llama-gqa": lambda: DecoderConfig.llama(**COMMON),
    "qwen2-bias": lambda: DecoderConfig.qwen2(**COMMON),
    "gemma2-mqa": lambda: DecoderConfig.gemma2(
        **(COMMON | {"num_key_value_heads": 1, "head_dim": 16}), window=4
    ),
    "phi3-partial": lambda: DecoderConfig.phi3(**COMMON, partial_rotary_factor=0.5),
    "gpt2-standard-mlp": lambda: DecoderConfig.gpt2(**(COMMON | {"num_key_value_heads": 4})),
    "olmo-qk-norm": lambda: DecoderConfig.llama(**COMMON, qk_norm=True),
}
# fused groups per layer: q/k/v, and gate/up where the MLP is gated
GROUPS = {name: 1 if name.startswith("gpt2") else 2 for name in CONFIGS}


def _model(name: str) -> DecoderLM:
    torch.manual_seed(0)
    model = DecoderLM(CONFIGS[name]()).eval()
    with torch.no_grad():  # biases away from zero, so a misplaced one shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_logits_and_tokens_equal_the_separate_layers(name: str) -> None:
    model = _model(name)
    ids = torch.randint(0, 64, (3, 6), generator=torch.Generator().manual_seed(1))
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want, want_step = model(ids).logits, model(ids[:, :1]).logits
    plain = generate(model, ids, 6, compile=False)
    pack_model(model, rows=(1, 4), fuse=True)
    fused = fused_projections(model)
    assert len(fused) == 2 * GROUPS[name] and packing_report(model)["fused"] == len(fused)
    with torch.no_grad():
        got, step = model(ids).logits, model(ids[:, :1]).logits  # 18 rows, 3 rows
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step, want_step, rtol=1e-5, atol=1e-5)
    assert torch.equal(generate(model, ids, 6, compile=False), plain)
    assert dict(model.named_parameters()) == params  # the very same objects
    got_state = model.state_dict()
    assert list(got_state) == list(state)
    assert all(torch.equal(got_state[k], v) for k, v in state.items())
    unpack_model(model)
    assert not fused_projections(model)
    attn = model.layers[0].self_attention
    assert isinstance(attn, MultiHeadAttention) and type(attn.q_proj) is nn.Linear


def test_gguf_file_and_hf_weights_do_not_change(tmp_path: Path) -> None:
    from attnlab.interop.gguf_writer import to_gguf

    model = _model("llama-gqa")
    (tmp_path / "plain").mkdir()
    (tmp_path / "fused").mkdir()
    to_gguf(model, tmp_path / "plain" / "m.gguf")
    pack_model(model, rows=(1,), fuse=True)
    assert fused_projections(model)
    to_gguf(model, tmp_path / "fused" / "m.gguf")
    assert (tmp_path / "plain" / "m.gguf").read_bytes() == (
        tmp_path / "fused" / "m.gguf"
    ).read_bytes()


def test_compiled_step_is_one_graph_without_breaks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``generate``'s compiled step (fullgraph) over fused projections: one graph for the run,
    the tokens of the unfused eager loop."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend=counter, **kw))
    monkeypatch.setenv("ATTNLAB_FUSE", "1")
    torch._dynamo.reset()
    model = _model("qwen2-bias")
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(2))
    eager = generate(model, ids, 10, compile=False)
    assert torch.equal(generate(model, ids, 10, compile=True), eager)
    assert len(fused_projections(model)) == 4  # laid out (and fused) by the compiled path
    assert torch.equal(generate(model, ids, 10, compile=True), eager)
    assert counter.frame_count == 1, counter.frame_count


def test_in_place_writes_and_casts_are_noticed() -> None:
    model = _model("llama-gqa")
    ids = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(3))
    pack_model(model, rows=(2,), fuse=True)
    attn, mlp = model.layers[1].self_attention, model.layers[1].feed_forward
    with torch.no_grad():
        attn.v_proj.weight.mul_(2.0)
        mlp.up_proj.weight.add_(0.5)
        got = model(ids).logits
    unpack_model(model)
    with torch.no_grad():
        torch.testing.assert_close(got, model(ids).logits, rtol=1e-5, atol=1e-5)
    pack_model(model, rows=(2,), fuse=True)
    model.to(torch.bfloat16)  # converted: fused again in bfloat16
    with torch.no_grad():
        low = model(ids).logits
    assert low.dtype == torch.bfloat16
    assert attn.fused_qkv is not None and attn.fused_qkv.weight is not None
    assert attn.fused_qkv.weight.dtype == torch.bfloat16


def test_training_is_refused() -> None:
    model = DecoderLM(DecoderConfig.llama(**COMMON))
    with pytest.raises(ValueError, match="training mode"):
        fuse_projections(model)
    model.eval()
    pack_model(model, rows=(2,), fuse=True)
    with pytest.raises(ValueError, match="needs gradients"):
        model(torch.randint(0, 64, (2, 3)))  # grad mode on: the copy would not follow a step
    unpack_model(model).train()
    model(torch.randint(0, 64, (2, 3))).logits.sum().backward()
    assert model.layers[0].self_attention.q_proj.weight.grad is not None


def test_lora_cross_attention_and_mixed_layers_are_left_with_a_reason() -> None:
    from attnlab.models.seq2seq import Seq2SeqLM
    from attnlab.models.seq2seq_config import Seq2SeqConfig
    from attnlab.modules.lora import apply_lora

    model = _model("llama-gqa")
    apply_lora(model, ["layers.0.self_attention.k_proj"], rank=2, alpha=4.0)
    model.layers[1].feed_forward.up_proj.to(torch.bfloat16)
    left = fuse_projections(model, rows=(1,))
    assert "LoRA" in left["layers.0.self_attention"]
    assert "dtypes" in left["layers.1.feed_forward"]
    assert set(fused_projections(model)) == {
        "layers.0.feed_forward.fused_gate_up",
        "layers.1.self_attention.fused_qkv",
    }
    s2s = Seq2SeqLM(
        Seq2SeqConfig(vocab_size=32, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    ).eval()
    left = fuse_projections(s2s, rows=(1,))
    cross = [n for n in left if n.endswith("cross_attention")]
    assert cross and all("cross-attention" in left[n] for n in cross)
    assert any(n.endswith("self_attention.fused_qkv") for n in fused_projections(s2s))


def test_missing_biases_add_zeros_and_bad_groups_are_refused() -> None:
    torch.manual_seed(0)
    attn = MultiHeadAttention(embed_dim=16, num_heads=2, num_kv_heads=1, bias=True).eval()
    attn.k_proj.bias = None  # Whisper's keys have no bias
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        want, _ = attn(x, is_causal=True)
        attn.fused_qkv = FusedProjection(
            layers=[attn.q_proj, attn.k_proj, attn.v_proj], names=["q", "k", "v"], rows=(4,)
        )
        got, _ = attn(x, is_causal=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="input widths differ"):
        FusedProjection(layers=[nn.Linear(4, 2), nn.Linear(5, 2)], names=["a", "b"])
    with pytest.raises(ValueError, match="not a float or quantized linear"):
        FusedProjection(layers=[nn.Linear(4, 2), nn.Conv1d(4, 2, 1)], names=["a", "b"])


def test_the_environment_turns_fusion_on_and_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ATTNLAB_FUSE", raising=False)
    assert default_fuse() is FUSE_BY_DEFAULT
    monkeypatch.setenv("ATTNLAB_FUSE", "1")
    model = pack_model(_model("llama-gqa"), rows=(1,))
    assert len(fused_projections(model)) == 4
    monkeypatch.setenv("ATTNLAB_FUSE", "0")
    assert default_fuse() is False
    model = pack_model(model, rows=(1,))
    assert not fused_projections(model)
    monkeypatch.setenv("ATTNLAB_FUSE", "yes")
    with pytest.raises(ValueError, match="ATTNLAB_FUSE"):
        pack_model(model, rows=(1,))


def test_by_default_only_quantized_groups_fuse(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unless told, ``pack_model`` fuses the groups of quantized layers (measured faster)
    and leaves float groups separate; ``ATTNLAB_FUSE=0`` leaves both, ``=1`` fuses both."""
    from attnlab.models.inference import FUSE_QUANTIZED_BY_DEFAULT
    from attnlab.models.quantize import quantize_model
    from attnlab.modules.linear import LinearSpec

    assert FUSE_QUANTIZED_BY_DEFAULT and not FUSE_BY_DEFAULT
    monkeypatch.delenv("ATTNLAB_FUSE", raising=False)
    assert not fused_projections(pack_model(_model("llama-gqa"), rows=(1,)))
    quantized = _model("qwen2-bias")
    quantize_model(quantized, LinearSpec("int8", compute="float32"))
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = quantized(ids).logits
    pack_model(quantized, rows=(1,))
    fused = fused_projections(quantized)
    assert len(fused) == 4 and all(f.quant is not None for f in fused.values())
    with torch.no_grad():
        torch.testing.assert_close(quantized(ids).logits, want, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("ATTNLAB_FUSE", "0")
    assert not fused_projections(pack_model(quantized, rows=(1,)))


@pytest.mark.parametrize("spec", ["int8", "int8:g32", "int4"])
def test_quantized_layers_join_exactly(spec: str) -> None:
    """int8 per channel, Q8_0-like groups, Q4_1-like int4: the fused layer joins the levels,
    scales and minimums (never re-rounded), float32 compute: the logits of the separate
    layers within float32 rounding; the state dict untouched."""
    from attnlab.models.quantize import quantize_model
    from attnlab.modules.linear import LinearSpec

    model = _model("qwen2-bias")
    parsed = LinearSpec.parse(spec)
    quantize_model(
        model, LinearSpec(parsed.weights, group_size=parsed.group_size, compute="float32")
    )
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(4))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want, want_step = model(ids).logits, model(ids[:, :1]).logits
    assert fuse_projections(model, rows=(1, 4)) == {}
    fused = fused_projections(model)
    assert len(fused) == 4 and all(f.quant is not None for f in fused.values())
    with torch.no_grad():
        got, step = model(ids).logits, model(ids[:, :1]).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step, want_step, rtol=1e-5, atol=1e-5)
    got_state = model.state_dict()
    assert list(got_state) == list(state)
    assert all(torch.equal(got_state[k], v) for k, v in state.items())


def test_smollm2_q4_1_blocks_fused(smollm2_file: Path) -> None:
    """SmolLM2's GGUF Q4_1 blocks as stored (no float round trip), fused: the logits of the
    separate layers within float32 rounding, the same next tokens."""
    import attnlab

    model = attnlab.from_gguf(smollm2_file, quantize="gguf", tokenizer=False, compute="float32")
    ids = torch.tensor([[1, 504, 3458, 282, 4103, 314]])
    with torch.no_grad():
        want = model(ids).logits
    pack_model(model, rows=(1,), fuse=True)
    assert len(fused_projections(model)) == 2 * model.config.num_hidden_layers
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
