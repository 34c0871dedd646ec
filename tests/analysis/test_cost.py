"""The cost model against reality: parameters, FlopCounterMode, measured peak memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import attnlab.backends as backends
from attnlab.analysis.arch import ArchSpec, describe
from attnlab.analysis.cost import estimate
from attnlab.analysis.cost_layers import window_density
from attnlab.analysis.measure import count_matmul_flops
from attnlab.functional import masks
from attnlab.models import EncoderConfig, EncoderModel

SRC = Path(__file__).resolve().parents[2] / "src"


def _cfg(**kw: object) -> EncoderConfig:
    base: dict[str, object] = dict(
        vocab_size=500,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=256,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return EncoderConfig(**(base | kw))  # type: ignore[arg-type]


CONFIGS = {
    "mha-post": _cfg(),
    "gqa-pre": _cfg(num_key_value_heads=2, norm_position="pre", add_pooler=False),
    "mqa-notypes": _cfg(num_key_value_heads=1, type_vocab_size=0, hidden_act="relu"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameter_count_equals_the_model(name: str) -> None:
    cfg = CONFIGS[name]
    report = estimate(cfg, seq_len=8)
    assert report.parameter_count == EncoderModel(cfg).num_parameters()
    assert report.parameter_bytes == 4 * report.parameter_count
    assert estimate(cfg, seq_len=8, dtype="bf16").parameter_bytes == 2 * report.parameter_count


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize(("batch", "seq"), [(1, 7), (3, 40)])
def test_forward_matmul_flops_match_flop_counter(name: str, batch: int, seq: int) -> None:
    cfg = CONFIGS[name]
    model = EncoderModel(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    with backends.use("reference"), torch.no_grad():
        measured = count_matmul_flops(lambda: model(ids))
    est = estimate(model, batch_size=batch, seq_len=seq, backend="reference")
    assert est.forward_matmul_flops == est.matmul_flops
    assert est.matmul_flops == pytest.approx(measured, rel=0.02)
    # the quadratic term is there: attention matmuls are 4·B·H·L²·E per layer
    attn = est.by_component["attention_scores"].matmul_flops
    attn += est.by_component["attention_v"].matmul_flops
    assert attn == 4 * batch * 4 * seq * seq * 16 * 2
    assert est.flops > est.matmul_flops  # softmax, norms, activations counted apart


def test_training_matmul_flops_match_flop_counter() -> None:
    cfg = CONFIGS["gqa-pre"]
    model = EncoderModel(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 24))

    def step() -> None:
        model(ids).last_hidden_state.sum().backward()

    with backends.use("reference"):
        measured = count_matmul_flops(step)
    est = estimate(cfg, batch_size=2, seq_len=24, mode="training", backend="reference")
    assert est.matmul_flops == pytest.approx(measured, rel=0.02)
    assert est.matmul_flops == pytest.approx(3 * est.forward_matmul_flops)


_MEASURE = textwrap.dedent(
    """
    import json, sys, torch
    from torch.utils.checkpoint import checkpoint
    import attnlab.backends as backends
    from attnlab.analysis.measure import peak_memory
    from attnlab.models import EncoderConfig, EncoderModel
    args = json.loads(sys.argv[1])
    torch.manual_seed(0)
    cfg = EncoderConfig(**args["config"])
    model = EncoderModel(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (args["batch"], args["seq"]))
    def step():
        with backends.use(args["backend"]):
            if not args["checkpointing"]:
                model(ids).last_hidden_state.sum().backward()
                return
            x = model.embeddings(ids)
            for layer in model.layers:
                x = checkpoint(lambda h, layer=layer: layer(h)[0], x, use_reentrant=False)
            x.sum().backward()
    step()
    model.zero_grad(set_to_none=True)
    print(json.dumps(peak_memory(step)))
    """
)

MEMORY_CASES = {
    # score matrices dominate (S = 512 > D)
    "reference-scores": dict(
        hidden_size=128, num_attention_heads=4, batch=2, seq=512, backend="reference"
    ),
    # hidden-sized activations dominate, GQA, dropout, pre-LN
    "reference-hidden-gqa": dict(
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=2,
        norm_position="pre",
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        batch=4,
        seq=128,
        backend="reference",
    ),
    # torch's fused kernel: no score matrix saved
    "sdpa-tiled": dict(hidden_size=256, num_attention_heads=4, batch=2, seq=512, backend="sdpa"),
    # torch's kernel with attention dropout falls back to its math path (weights saved)
    "sdpa-dropout-fallback": dict(
        hidden_size=256,
        num_attention_heads=4,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        batch=4,
        seq=256,
        backend="sdpa",
    ),
    # per-layer gradient checkpointing (torch.utils.checkpoint around each layer)
    "reference-checkpointed": dict(
        hidden_size=128, num_attention_heads=4, batch=2, seq=512, backend="reference", ckpt=True
    ),
    "sdpa-checkpointed": dict(
        hidden_size=256, num_attention_heads=4, batch=2, seq=512, backend="sdpa", ckpt=True
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(MEMORY_CASES))
def test_training_activation_memory_within_20_percent_of_measured_peak(case: str) -> None:
    spec = dict(MEMORY_CASES[case])
    batch, seq, backend = spec.pop("batch"), spec.pop("seq"), spec.pop("backend")
    ckpt = bool(spec.pop("ckpt", False))
    config = (
        dict(
            vocab_size=1000,
            num_hidden_layers=4 if ckpt else 2,
            add_pooler=not ckpt,
            intermediate_size=4 * int(spec["hidden_size"]),  # type: ignore[call-overload]
            max_position_embeddings=512,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        | spec
    )
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    args = json.dumps(
        {"config": config, "batch": batch, "seq": seq, "backend": backend, "checkpointing": ckpt}
    )
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, args],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=300,
    )
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    est = estimate(
        EncoderConfig(**config),  # type: ignore[arg-type]
        batch_size=batch,  # type: ignore[arg-type]
        seq_len=seq,  # type: ignore[arg-type]
        mode="training",
        backend=str(backend),
        checkpointing=ckpt,
    )
    assert est.activation_bytes == pytest.approx(measured, rel=0.20), (case, measured)


def test_activation_variants_order() -> None:
    cfg = EncoderConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    r = estimate(cfg, batch_size=1, seq_len=4096, mode="training")
    v = r.activation_variants
    assert set(v) == {
        "materialised",
        "tiled",
        "materialised+checkpointing",
        "tiled+checkpointing",
    }
    assert v["tiled"] < v["materialised"]
    assert v["tiled+checkpointing"] < v["tiled"]
    assert v["materialised+checkpointing"] < v["materialised"]
    # 12 layers x 12 heads x 4096² float32 x 3 saved score tensors dominate
    assert v["materialised"] > 12 * 12 * 4096**2 * 4 * 3
    kw = dict(batch_size=1, seq_len=4096, mode="training", backend="reference")
    plain = estimate(cfg, **kw)  # type: ignore[arg-type]
    ck = estimate(cfg, checkpointing=True, **kw)  # type: ignore[arg-type]
    assert ck.activation_bytes < plain.activation_bytes
    # the layers' forward runs twice: (1 + 1 + 2) / (1 + 2) of the work
    assert ck.matmul_flops == pytest.approx(4 / 3 * plain.matmul_flops, rel=0.01)


def test_inference_tiled_memory_is_linear_and_materialised_quadratic() -> None:
    cfg = EncoderConfig()
    small = estimate(cfg, seq_len=1024, backend="reference")
    big = estimate(cfg, seq_len=4096, backend="reference")
    assert big.activation_bytes / small.activation_bytes > 10
    small_t = estimate(cfg, seq_len=1024, backend="sdpa")
    big_t = estimate(cfg, seq_len=4096, backend="sdpa")
    assert big_t.activation_bytes / small_t.activation_bytes == pytest.approx(4, rel=0.01)


def test_optimizer_state_and_mixed_precision() -> None:
    cfg = CONFIGS["mha-post"]
    n = estimate(cfg, seq_len=8).parameter_count
    assert estimate(cfg, seq_len=8, mode="training").optimizer_bytes == 8 * n
    assert estimate(cfg, seq_len=8, mode="training", optimizer="sgd").optimizer_bytes == 0
    assert estimate(cfg, seq_len=8, mode="training", dtype=torch.bfloat16).optimizer_bytes == 12 * n
    assert estimate(cfg, seq_len=8).optimizer_bytes == 0


def test_window_density_closed_form_equals_counting() -> None:
    for w, q_len, kv_len, off in [(1, 5, 5, 0), (4, 17, 17, 0), (16, 1, 40, 39), (8, 20, 64, 44)]:
        q = torch.arange(q_len)[:, None] + off
        k = torch.arange(kv_len)[None]
        dense = ((k <= q) & (k > q - w)).double().mean().item()
        assert window_density(w, q_len, kv_len, off) == pytest.approx(dense, abs=1e-12)


def test_window_and_pattern_scale_attention_for_skipping_backends_only() -> None:
    spec = describe(EncoderConfig()).with_(causal=True)
    dense = estimate(spec, seq_len=8192, backend="reference")
    causal = estimate(spec, seq_len=8192, backend="sdpa")
    window = estimate(spec, seq_len=8192, backend="sdpa", window=512)
    s_dense = dense.by_component["attention_scores"].matmul_flops
    # the reference computes every pair; torch's kernel skips the causal half
    assert causal.by_component["attention_scores"].matmul_flops == pytest.approx(
        s_dense * (8192 + 1) / (2 * 8192)
    )
    assert window.attention_density == pytest.approx(512 / 8192, rel=0.05)
    pattern = masks.sliding_window(63)
    with_pattern = estimate(EncoderConfig(), seq_len=256, mask=pattern)
    assert with_pattern.attention_density == pytest.approx(pattern.density(256), rel=1e-9)


def test_kv_cache_bytes_formula() -> None:
    spec = describe(CONFIGS["gqa-pre"]).with_(causal=True)
    r = estimate(spec, batch_size=3, seq_len=100, mode="decode", dtype="fp16")
    # 2 (k and v) x layers x batch x kv_heads x head_dim x tokens x bytes
    assert r.kv_cache_bytes == 2 * 2 * 3 * 2 * 16 * 101 * 2
    assert estimate(spec, seq_len=100).kv_cache_bytes == 0
    sliding = estimate(spec.with_(window=16), seq_len=100, mode="decode", cache="sliding")
    # the last 16 slots plus the new token, as SlidingWindowKVCache holds them
    assert sliding.kv_cache_bytes == 2 * 2 * 1 * 2 * 16 * (16 + 1) * 4
    # a growing cache with no preallocation doubles past the prefill
    grown = estimate(spec, seq_len=100, mode="decode", cache_capacity=0)
    assert grown.kv_cache_bytes == 2 * 2 * 1 * 2 * 16 * 200 * 4
    static = estimate(spec, seq_len=100, mode="decode", cache="static", cache_capacity=512)
    assert static.kv_cache_bytes == 2 * 2 * 1 * 2 * 16 * 512 * 4


def test_report_serialises_and_summarises() -> None:
    r = estimate(EncoderConfig(), batch_size=2, seq_len=128, mode="training")
    data = json.loads(json.dumps(r.to_dict()))
    assert data["arch"]["hidden_size"] == 768
    assert set(data["by_component"]) >= {"embeddings", "projections", "attention_scores"}
    text = r.summary()
    assert "optimizer state" in text and "attention_scores" in text


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(seq_len=0), ValueError, "seq_len must be a positive int, got 0"),
        (dict(seq_len=8, batch_size=-1), ValueError, "batch_size"),
        (dict(seq_len=8, mode="train"), ValueError, "mode must be"),
        (dict(seq_len=8, dtype="int8"), ValueError, "unknown dtype 'int8'"),
        (dict(seq_len=8, dtype=torch.int32), ValueError, "floating"),
        (dict(seq_len=8, optimizer="lion"), ValueError, "optimizer must be"),
        (dict(seq_len=8, mode="decode", cache="sliding"), ValueError, "needs a window"),
    ],
)
def test_bad_inputs(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        estimate(EncoderConfig(), **kwargs)  # type: ignore[arg-type]


def test_unknown_config_type_names_known_ones() -> None:
    with pytest.raises(TypeError, match="no cost-model adapter for dict.*EncoderConfig"):
        estimate({"hidden_size": 3}, seq_len=4)
    with pytest.raises(ValueError, match="num_heads \\(6\\) must be divisible by num_kv_heads"):
        ArchSpec(
            name="x",
            num_layers=1,
            hidden_size=8,
            num_heads=6,
            num_kv_heads=4,
            head_dim=2,
            ffn="standard",
            intermediate_size=8,
            vocab_size=10,
        )


def test_tile_skipping_backends_count_whole_tiles() -> None:
    spec = describe(EncoderConfig()).with_(causal=True)
    exact = estimate(spec, seq_len=1000, backend="sdpa")  # skips the causal half exactly
    tiled = estimate(spec, seq_len=1000, backend="tiled")  # 256 x 256 tiles
    blocks = [min(256, 1000 - q0) for q0 in range(0, 1000, 256)]  # 256, 256, 256, 232
    keys = [min(1000, 256 * (i + 1)) for i in range(4)]  # key blocks 0..i
    pairs = sum(r * k for r, k in zip(blocks, keys))
    assert tiled.by_component["attention_scores"].matmul_flops == 2 * 12 * 12 * 64 * pairs
    assert exact.by_component["attention_scores"].matmul_flops == pytest.approx(
        2 * 12 * 12 * 64 * 1000 * 1001 / 2
    )
    # a dense window mask given to sdpa: every pair is computed
    masked = estimate(spec, seq_len=1000, backend="sdpa", window=100)
    assert masked.by_component["attention_scores"].matmul_flops == 2 * 12 * 12 * 64 * 1000**2
    # a sliding cache: the last W + 1 keys, the new query last
    step = estimate(
        spec.with_(window=300), seq_len=5000, mode="decode", cache="sliding", backend="tiled"
    )
    assert step.by_component["attention_scores"].matmul_flops == 2 * 12 * 12 * 64 * 1 * 301


def test_auto_is_the_registrys_choice() -> None:
    """``auto`` in the cost model is what the registry chooses for the same call (one source)."""
    from attnlab.analysis.arch import preset

    mistral = preset("mistral-7b")  # a 4096-key window, 32 heads on 8 key/value heads
    assert estimate(mistral, seq_len=512).backend == "sdpa"  # the window covers everything
    x = torch.zeros(1, 1, 1, 1)
    for n in (512, 8192, 32768):
        q, kv = x.expand(1, 32, n, 128), x.expand(1, 8, n, 128)  # no memory behind them
        real = backends.explain(q, kv, kv, masks.sliding_window(4095), enable_gqa=True)
        r = estimate(mistral, seq_len=n)
        assert r.backend == real.chosen
        assert any(f"auto resolves to {real.chosen!r}" in note for note in r.notes)
    assert estimate(mistral, seq_len=32768).backend != "sdpa"  # most tiles are empty
    training = estimate(mistral, seq_len=32768, mode="training").backend
    q = x.expand(1, 32, 32768, 128).requires_grad_()
    kv = x.expand(1, 8, 32768, 128)
    assert (
        training == backends.explain(q, kv, kv, masks.sliding_window(4095), enable_gqa=True).chosen
    )
    with backends.use("reference"):
        assert estimate(mistral, seq_len=512).backend == "reference"
    assert estimate(mistral, seq_len=512, backend="sparse").backend == "sparse"


def test_one_traits_record_torch_free() -> None:
    """The backends, the registry and the cost model read one record; importing it needs no torch."""
    import subprocess
    import sys

    from attnlab.analysis.cost_layers import BACKEND_TRAITS
    from attnlab.backend_traits import TRAITS
    from attnlab.backends import flex, get, sparse, tiled

    assert BACKEND_TRAITS is TRAITS
    assert TRAITS["tiled"].block == (tiled.BLOCK_Q, tiled.BLOCK_K)
    assert TRAITS["sparse"].block == (sparse.BLOCK, sparse.BLOCK)
    assert TRAITS["flex"].block == (flex.BLOCK_SIZE, flex.BLOCK_SIZE)
    for name, t in TRAITS.items():
        b = get(name)
        assert (b.exact, b.priority, b.description) == (t.exact, t.priority, t.description)
    code = (
        "import sys, attnlab.backend_traits, attnlab.analysis.cost_layers; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
