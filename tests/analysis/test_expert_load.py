"""Expert load statistics and the collapsed-router fault found by diagnose."""

from __future__ import annotations

import math

import torch

from attnlab.analysis.diagnostics import diagnose
from attnlab.analysis.expert_stats import expert_load
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import MoEConfig
from attnlab.modules.moe import MoEBlock


def _model() -> DecoderLM:
    torch.manual_seed(0)
    c = DecoderConfig.mixtral(
        moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=24),
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
    )
    return DecoderLM(c).eval()


def test_expert_load_counts_entropy_and_padding() -> None:
    logits = torch.tensor([[5.0, 0.0, 0.0], [0.0, 5.0, 0.0], [0.0, 0.0, 0.0], [5.0, 1.0, 0.0]])
    load = expert_load(logits, 1, mask=torch.tensor([1, 1, 0, 1]))
    assert load.tokens == 3 and load.tokens_per_expert == [2, 1, 0]
    assert load.unused_experts == 1 and load.busiest_expert == 0
    assert math.isclose(load.max_share, 2 / 3)
    p = torch.softmax(logits[[0, 1, 3]], -1)
    assert math.isclose(load.router_entropy, float(-(p * p.log()).sum(-1).mean()), rel_tol=1e-6)
    assert not load.collapsed


def test_diagnose_reports_expert_load_and_finds_an_injected_collapsed_router() -> None:
    model = _model()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    healthy = diagnose(model, {"input_ids": ids})
    assert healthy.ok and len(healthy.experts) == 2
    assert all(sum(x.tokens_per_expert) == 24 * 2 for x in healthy.experts)
    assert "MoE layer" in healthy.summary()
    # the fault: layer 1's router weights zeroed -> equal logits, the same experts for all
    block = model.layers[1].feed_forward
    assert isinstance(block, MoEBlock)
    with torch.no_grad():
        block.router.weight.zero_()
    report = diagnose(model, {"input_ids": ids})
    assert not report.ok
    issue = next(i for i in report.issues if i.kind == "router_collapse")
    assert issue.where == "layers.1.feed_forward" and "100%" in issue.message
    assert report.experts[1].collapsed and not report.experts[0].collapsed
    assert "COLLAPSED" in report.summary()
