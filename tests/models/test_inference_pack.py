"""pack_model: a model's float linears (and a tied head) laid out for decode steps, with the
same parameters, the same logits, refused for training, and undone by unpack_model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnlab.backends.linear_pack import PackedLinear, static_rows, use_gemm
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.inference import pack_model, packed_linears, packing_report, unpack_model
from attnlab.modules.packed_linear import PackedLinearLayer

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("kernel", ["mm_t", "mkldnn"])
def test_same_logits_same_parameters(tied: bool, kernel: str) -> None:
    model = DecoderLM(DecoderConfig.llama(tie_word_embeddings=tied, **COMMON)).eval()
    ids = torch.randint(0, 96, (3, 5))
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    with torch.no_grad():
        want = model(ids).logits
    with use_gemm(kernel):
        pack_model(model, rows=(1, 4), fuse=False)
    assert dict(model.named_parameters()) == params  # the very same objects
    assert list(model.state_dict()) == keys
    packed = packed_linears(model)
    # 2 layers x (q, k, v, o, gate, up, down) + the head (tied: packed_head)
    assert len(packed) == 15 and ("packed_head" in packed) == tied
    if tied:
        assert (
            model.packed_head is not None and model.packed_head.weight is model.embed_tokens.weight
        )
    with torch.no_grad():
        got = model(ids).logits  # 15 rows: past the packed buckets, F.linear
        step = model(ids[:, :1]).logits  # 3 rows
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step, want[:, :1], rtol=1e-5, atol=1e-5)
    report = packing_report(model)
    assert report["kernels"][4] == {kernel: 15} and kernel in report["why"][4][kernel]
    assert report["extra_bytes"] > 0
    unpack_model(model)
    assert packed_linears(model) == {} and model.packed_head is None
    assert type(model.layers[0].feed_forward.gate_proj) is nn.Linear
    assert dict(model.named_parameters()) == params


def test_refused_for_training() -> None:
    model = DecoderLM(DecoderConfig.llama(**COMMON))
    with pytest.raises(ValueError, match="training mode"):
        pack_model(model)
    model.eval()
    model.prepare_inference(rows=(2,), kernel="mm_t")
    assert isinstance(model.layers[0].self_attention.out_proj, PackedLinearLayer)
    ids = torch.randint(0, 96, (2, 3))
    with pytest.raises(ValueError, match="needs gradients"):
        model(ids)  # grad mode on: the packed copies would not follow an optimizer step
    unpack_model(model).train()
    model(ids).logits.sum().backward()  # unpacked, it trains again
    assert model.embed_tokens.weight.grad is not None


def test_compiled_head_and_layer() -> None:
    model = DecoderLM(DecoderConfig.llama(tie_word_embeddings=True, **COMMON)).eval()
    layer = model.layers[0].feed_forward

    def f(h: torch.Tensor) -> torch.Tensor:
        return model.lm_logits(layer(h))

    h = torch.randn(1, 4, 32)
    with torch.inference_mode():
        want = f(h)
        pack_model(model, rows=(4,), kernel="mkldnn")
        assert isinstance(model.packed_head, PackedLinear)
        with static_rows():
            got = torch.compile(f, fullgraph=True, dynamic=False)(h)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
