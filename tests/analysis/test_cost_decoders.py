"""The cost model on decoder LMs and encoder-decoders: parameters, FLOPs, KV-cache bytes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import attnlab.backends as backends
from attnlab.analysis.cost import estimate
from attnlab.analysis.measure import count_matmul_flops
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.seq2seq import Seq2SeqLM
from attnlab.models.seq2seq_config import Seq2SeqConfig

SMALL: dict[str, Any] = dict(
    vocab_size=300,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=96,
    max_position_embeddings=256,
)
DECODERS = {
    "llama-gqa": DecoderConfig.llama(num_key_value_heads=2, **SMALL),
    "gpt2": DecoderConfig.gpt2(**SMALL),
    "mistral-window": DecoderConfig.mistral(sliding_window=8, num_key_value_heads=1, **SMALL),
    "bloom-alibi": DecoderConfig.bloom(**SMALL),
}
S2S: dict[str, Any] = dict(
    vocab_size=300, d_model=64, num_heads=4, d_ff=96, num_layers=2, num_decoder_layers=3
)
SEQ2SEQ = {
    "t5": Seq2SeqConfig.t5(**S2S),
    "transformer": Seq2SeqConfig.transformer(**S2S),
    "t5-gated-untied": Seq2SeqConfig.t5(mlp="gated", tie_word_embeddings=False, **S2S),
}


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_decoder_parameters_and_forward_flops(name: str) -> None:
    cfg = DECODERS[name]
    model = DecoderLM(cfg).eval()
    assert estimate(cfg, seq_len=4).parameter_count == model.num_parameters()
    ids = torch.randint(0, 300, (2, 19))
    with backends.use("reference"), torch.no_grad():
        measured = count_matmul_flops(lambda: model(ids))
    est = estimate(model, batch_size=2, seq_len=19, backend="reference")
    assert est.matmul_flops == pytest.approx(measured, rel=0.02)
    assert est.by_component["lm_head"].matmul_flops == 2 * 2 * 19 * 64 * 300


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_decode_step_flops_and_kv_cache_bytes_equal_the_cache_tensors(name: str) -> None:
    cfg = DECODERS[name]
    model = DecoderLM(cfg).eval()
    prompt, batch = 13, 3
    ids = torch.randint(0, 300, (batch, prompt))
    nxt = torch.randint(0, 300, (batch, 1))
    sliding = cfg.sliding_window is not None
    for kind, capacity in (("dynamic", prompt + 1), ("dynamic", 0), ("static", 32)):
        if kind == "static" and sliding:
            continue
        cache = model.new_cache(kind=kind, max_length=capacity)  # type: ignore[arg-type]
        with backends.use("reference"), torch.no_grad():
            model(ids, past_key_values=cache)
            measured = count_matmul_flops(lambda c=cache: model(nxt, past_key_values=c))
        kw: dict[str, Any] = dict(
            batch_size=batch, seq_len=prompt, mode="decode", backend="reference"
        )
        if sliding:
            kw["cache"] = "sliding"
        else:
            kw |= dict(cache=kind, cache_capacity=capacity)
        est = estimate(cfg, **kw)
        held = sum(
            t.untyped_storage().nbytes()
            for layer in cache.layers
            for t in (layer.k, layer.v)  # type: ignore[attr-defined]
        )
        assert est.kv_cache_bytes == held, (kind, capacity)
        assert est.matmul_flops == pytest.approx(measured, rel=0.02), (kind, capacity)


@pytest.mark.parametrize("name", sorted(SEQ2SEQ))
def test_encoder_decoder_parameters_flops_and_cross_cache(name: str) -> None:
    cfg = SEQ2SEQ[name]
    model = Seq2SeqLM(cfg).eval()
    assert estimate(cfg, seq_len=4).parameter_count == sum(p.numel() for p in model.parameters())
    src, tgt = torch.randint(2, 300, (2, 17)), torch.randint(2, 300, (2, 9))
    with backends.use("reference"), torch.no_grad():
        measured = count_matmul_flops(lambda: model(input_ids=src, decoder_input_ids=tgt))
    est = estimate(cfg, batch_size=2, seq_len=17, target_len=9, backend="reference")
    assert est.matmul_flops == pytest.approx(measured, rel=0.02)
    # decoding: a self-attention cache of the decoded tokens and the encoder's keys/values
    with torch.no_grad():
        out = model(input_ids=src, decoder_input_ids=tgt, use_cache=True)
    cache = out.past_key_values
    held = sum(t.untyped_storage().nbytes() for c in cache.layers for t in (c.k, c.v))
    held += sum(t.untyped_storage().nbytes() for c in cache.cross for t in (c.key, c.value))
    step = estimate(
        cfg, batch_size=2, seq_len=17, target_len=0, new_tokens=9, mode="decode", cache_capacity=0
    )
    assert step.kv_cache_bytes == held


_MEASURE = """
import json, sys, torch
import torch.nn.functional as F
import attnlab.backends as backends
from attnlab.analysis.measure import peak_memory
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
args = json.loads(sys.argv[1])
torch.manual_seed(0)
model = DecoderLM(DecoderConfig(**args["config"])).train()
ids = torch.randint(0, 1000, (args["batch"], args["seq"]))
def step():
    with backends.use(args["backend"]):
        logits = model(ids).logits
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
step()
model.zero_grad(set_to_none=True)
print(json.dumps(peak_memory(step)))
"""

MEMORY = {
    "llama-gqa-reference": ("llama", dict(num_key_value_heads=2), "reference", 2, 256),
    "mistral-window-tiled": ("mistral", dict(sliding_window=64), "tiled", 2, 512),
    "gpt2-sdpa": ("gpt2", {}, "sdpa", 4, 128),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(MEMORY))
def test_decoder_training_memory_within_20_percent_of_measured(case: str) -> None:
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    preset, extra, backend, batch, seq = MEMORY[case]
    small = dict(
        vocab_size=1000,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=384,
        max_position_embeddings=1024,
    )
    cfg = getattr(DecoderConfig, preset)(**small, **extra)
    src = Path(__file__).resolve().parents[2] / "src"
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1")
    args = json.dumps({"config": cfg.to_dict(), "batch": batch, "seq": seq, "backend": backend})
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, args],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=300,
    )
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    est = estimate(cfg, batch_size=batch, seq_len=seq, mode="training", backend=backend)
    assert est.activation_bytes == pytest.approx(measured, rel=0.20), (case, measured)
