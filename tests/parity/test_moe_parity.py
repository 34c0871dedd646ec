"""Mixtral, Qwen2-MoE and OLMoE: attnlab against transformers (tiny random configs, float32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import attnlab
from attnlab.models.decoder import DecoderLM
from attnlab.modules.moe import MoEBlock

tf = pytest.importorskip("transformers")

COMMON: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _hf(arch: str) -> Any:
    if arch == "mixtral":
        cfg = tf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
        cls = tf.MixtralForCausalLM
    elif arch == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(
            **COMMON,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        )
        cls = tf.Qwen2MoeForCausalLM
    else:
        cfg = tf.OlmoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2)
        cls = tf.OlmoeForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.uniform_(0.8, 1.2)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)  # decisive routing: no near-ties between experts
            else:
                p.normal_(0, 0.15)
    model.generation_config.eos_token_id = None
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    ids[1, :3] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids, mask, pos


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "olmoe"])
def pair(request: pytest.FixtureRequest) -> tuple[Any, DecoderLM]:
    hf = _hf(request.param)
    ours = attnlab.from_hf(hf)
    assert isinstance(ours, DecoderLM)
    return hf, ours


def test_logits_router_logits_and_aux_loss_match_with_left_padding(
    pair: tuple[Any, DecoderLM],
) -> None:
    hf, ours = pair
    ids, mask, pos = _batch()
    with torch.no_grad():
        theirs = hf(ids, attention_mask=mask, position_ids=pos, output_router_logits=True)
        mine = ours(ids, attention_mask=mask, output_router_logits=True)
    real = mask.bool()
    torch.testing.assert_close(mine.logits[real], theirs.logits[real], atol=1e-4, rtol=1e-4)
    assert mine.router_logits is not None
    assert len(mine.router_logits) == len(theirs.router_logits)
    flat = real.reshape(-1)
    for a, b in zip(mine.router_logits, theirs.router_logits):
        torch.testing.assert_close(a[flat], b[flat], atol=1e-4, rtol=1e-4)
    assert mine.aux_loss is not None
    torch.testing.assert_close(mine.aux_loss, theirs.aux_loss, atol=1e-5, rtol=1e-5)


def test_greedy_generation_is_identical_for_32_tokens(pair: tuple[Any, DecoderLM]) -> None:
    hf, ours = pair
    ids, mask, _ = _batch()
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
    mine = ours.generate(ids, 32, attention_mask=mask)
    assert torch.equal(mine, theirs)


def test_to_hf_round_trip(pair: tuple[Any, DecoderLM]) -> None:
    hf, ours = pair
    back = attnlab.to_hf(ours)
    assert type(back) is type(hf)
    theirs = hf.state_dict()
    for k, v in back.state_dict().items():
        torch.testing.assert_close(v, theirs[k], atol=0, rtol=0, msg=k)
    assert any(isinstance(layer.feed_forward, MoEBlock) for layer in ours.layers)


def test_from_a_saved_folder_with_per_expert_tensors(
    pair: tuple[Any, DecoderLM], tmp_path: Any
) -> None:
    # transformers writes checkpoints with one tensor per expert (the hub's layout)
    hf, ours = pair
    hf.save_pretrained(tmp_path)
    loaded = attnlab.from_hf(tmp_path)
    mine = ours.state_dict()
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, mine[k], atol=0, rtol=0, msg=k)
