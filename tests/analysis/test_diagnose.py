"""Diagnostics: inject a fault, check that the report names it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import attnlab.backends as backends
from attnlab.analysis.diagnose import NonFiniteWatch, attention_head_stats, diagnose
from attnlab.backends import registry
from attnlab.functional.attention import sdpa_reference
from attnlab.functional.masks import causal_mask
from attnlab.models import EncoderConfig, EncoderModel
from attnlab.modules.attention import MultiHeadAttention


def _model(**kw: object) -> EncoderModel:
    cfg = EncoderConfig(
        **(
            dict(
                vocab_size=100,
                hidden_size=32,
                num_hidden_layers=3,
                num_attention_heads=4,
                intermediate_size=64,
                max_position_embeddings=64,
            )
            | kw
        )  # type: ignore[arg-type]
    )
    return EncoderModel(cfg).eval()


def _inputs(batch: int = 2, seq: int = 9) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(1, 100, (batch, seq)),
        "attention_mask": torch.ones(batch, seq, dtype=torch.long),
    }


def test_healthy_model_has_no_issues_and_full_statistics() -> None:
    report = diagnose(_model(), _inputs())
    assert report.ok, report.summary()
    assert report.first_nonfinite_module is None and report.output_finite
    assert len(report.heads) == 3 * 4
    assert max(h.row_sum_error for h in report.heads) < 1e-6
    assert all(0 < h.entropy <= torch.log(torch.tensor(9.0)) + 1e-6 for h in report.heads)
    assert all(h.fully_masked_rows == 0 and h.rows == 18 for h in report.heads)
    assert [row["layer"] for row in report.layer_summary()] == [0, 1, 2]
    assert "no issues found" in report.summary()


def test_nan_weights_in_one_layer_are_named() -> None:
    model = _model()
    with torch.no_grad():
        model.layers[1].feed_forward.fc_in.weight[3, 5] = float("nan")
    report = diagnose(model, _inputs())
    assert report.first_nonfinite_module == "layers.1.feed_forward.fc_in"
    assert report.nonfinite_parameters == {"layers.1.feed_forward.fc_in.weight": 1}
    assert not report.output_finite and not report.ok
    first = report.issues[0]
    assert first.kind == "nonfinite" and "layers.1.feed_forward.fc_in.weight" in first.message
    # the statistics of the inputs that led there are finite: the fault is in the weights
    assert report.first_nonfinite_inputs[0]["nan"] == 0


def test_nan_in_value_projection_names_that_projection() -> None:
    model = _model()
    with torch.no_grad():
        model.layers[2].attention.v_proj.weight[0, 0] = float("nan")
    report = diagnose(model, _inputs(), attention_stats=False)
    assert report.first_nonfinite_module == "layers.2.attention.v_proj"
    assert "layers.2.attention.v_proj.weight" in report.issues[0].message


def test_mask_blanking_whole_rows() -> None:
    inputs = _inputs()
    inputs["attention_mask"][1] = 0
    report = diagnose(_model(), inputs)
    assert report.output_finite  # attnlab returns zeros, not NaN
    blank = [i for i in report.issues if i.kind == "fully_masked"]
    assert blank and blank[0].where == "attention_mask[1]"
    assert all(h.fully_masked_rows == 9 for h in report.heads)  # sequence 1's 9 queries


def test_float_mask_where_a_bool_was_meant() -> None:
    mha = MultiHeadAttention(embed_dim=16, num_heads=2).eval()
    x = torch.randn(1, 5, 16)
    float01 = causal_mask(5).float()  # 1 = attend, meant as a bool mask
    report = diagnose(mha, {"query": x, "attn_mask": float01})
    issue = next(i for i in report.issues if i.kind == "mask")
    assert "ADDED" in issue.message and ".bool()" in issue.fix
    # what it does: nothing is masked, the future gets weight
    assert report.heads[0].first_token_share < 0.99


def test_additive_float_attention_mask_where_1_0_was_meant() -> None:
    inputs = _inputs()
    additive = torch.zeros(2, 9)
    additive[:, 7:] = float("-inf")
    inputs["attention_mask"] = additive  # type: ignore[assignment]
    report = diagnose(_model(), inputs)
    kinds = [i.kind for i in report.issues]
    assert "mask" in kinds and "error" in kinds
    mask_issue = next(i for i in report.issues if i.kind == "mask")
    assert "(mask == 0).long()" in mask_issue.fix
    assert report.error is not None and "attention_mask must hold only 1" in report.error


def test_one_dimensional_input_ids() -> None:
    report = diagnose(_model(), {"input_ids": torch.randint(1, 100, (9,))})
    issue = next(i for i in report.issues if i.kind == "shape")
    assert "unsqueeze(0)" in issue.fix


@pytest.fixture
def unnormalised_backend() -> Iterator[str]:
    def fn(*args: object, return_weights: bool = False, **kw: object) -> tuple[object, object]:
        out, w = sdpa_reference(*args, return_weights=True, **kw)  # type: ignore[arg-type]
        assert w is not None
        w = w * 0.8  # rows sum to 0.8
        return out, (w if return_weights else None)

    registry.register(
        registry.Backend(name="unnormalised", fn=fn, check=lambda call: None, priority=5000)
    )
    try:
        yield "unnormalised"
    finally:
        registry._REGISTRY.pop("unnormalised")


def test_attention_whose_rows_do_not_sum_to_one(unnormalised_backend: str) -> None:
    with backends.use(unnormalised_backend):
        report = diagnose(_model(), _inputs())
    issue = next(i for i in report.issues if i.kind == "row_sum")
    assert issue.where == "layers.0.attention"
    assert "'unnormalised'" in issue.message and "0.2" in issue.message
    assert all(h.row_sum_error == pytest.approx(0.2) for h in report.heads)


def test_float16_overflow_is_named() -> None:
    model = _model().half()
    with torch.no_grad():
        w = model.layers[0].feed_forward.fc_in.weight
        w.copy_(torch.randn(w.shape) * 1e4)  # finite in float16, its products are not
    report = diagnose(model, _inputs())
    assert report.first_nonfinite_module == "layers.0.feed_forward.fc_in"
    assert report.issues[0].kind == "overflow"
    assert "65504" in report.issues[0].message and "bfloat16" in report.issues[0].fix


def test_watch_alone_and_stats_errors() -> None:
    model = _model()
    with NonFiniteWatch(model) as watch:
        model(**_inputs())
    assert watch.first_module is None
    stats = attention_head_stats(torch.eye(4).expand(2, 4, 4))
    assert [s.first_token_share for s in stats] == [0.25, 0.25]
    assert stats[0].mean_distance == 0.0 and stats[0].max_weight == 1.0
    with pytest.raises(ValueError, match=r"weights must be \[B, H, L, S\]"):
        attention_head_stats(torch.ones(4))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        diagnose("model", _inputs())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="inputs must be a mapping"):
        diagnose(model, [1, 2])  # type: ignore[arg-type]
