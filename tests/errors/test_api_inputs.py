"""Class B of issue 22: the Python APIs check what they are given, at the root: block ids
and counts in the paged pool, token ids and sizes in the engine, every config field by its
type (bools are not ints, epsilons > 0, no NaN), recurrent inputs, masks and dtypes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from attnlab.cache.paged.allocator import BlockAllocator
from attnlab.models.recurrent import RWKVLM, MambaLM, RetNetLM
from attnlab.models.recurrent_config import MambaConfig, RetNetConfig, RWKVConfig


@pytest.mark.parametrize("bad", [-1, 8, True, 1.0, "1"])
def test_allocator_block_ids(bad: Any) -> None:
    a = BlockAllocator(num_blocks=8)
    held = [a.allocate() for _ in range(3)]
    for op in (a.release, a.incref, a.refcount, a.is_cached):
        with pytest.raises(ValueError, match=r"block must be an int in \[0, 7\]"):
            op(bad)
    assert [a.refcount(b) for b in held] == [1, 1, 1]  # nothing changed


def _pool() -> Any:
    from attnlab.cache.paged import PagedKVPool
    from attnlab.models import DecoderConfig, DecoderLM

    cfg = DecoderConfig.llama(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=64,
    )  # fmt: skip
    return PagedKVPool.for_model(DecoderLM(cfg), num_blocks=8, block_size=4)


def test_pool_counts_tokens_and_step_rows() -> None:
    pool = _pool()
    pool.add_sequence("a", [1, 2, 3])
    for bad in (-3, True, 1.5):
        with pytest.raises(ValueError, match="num_new must be an int >= 0"):
            pool.reserve("a", bad)
    with pytest.raises(ValueError, match=r"tokens\[1\] must be an int >= 0"):
        pool.add_sequence("b", [1, 2.9])
    with pytest.raises(ValueError, match=r"tokens\[0\] must be an int >= 0"):
        pool.append_tokens("a", [True])
    pool.reserve("a", 3)
    with pytest.raises(ValueError, match="'a' appear twice"):
        pool.begin_step([("a", 1), ("a", 2)])


def test_engine_checks_token_ids_and_sizes(tmp_path: Path) -> None:
    from attnlab.models import DecoderConfig, DecoderLM
    from attnlab.serving.engine import Engine
    from attnlab.serving.params import ParamError

    cfg = DecoderConfig.llama(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=64,
    )  # fmt: skip
    model = DecoderLM(cfg)
    for name in ("max_num_seqs", "block_size", "max_num_batched_tokens"):
        with pytest.raises(ValueError, match=f"{name} must be a positive int"):
            Engine(model, None, **{name: 0})
    with pytest.raises(ValueError, match="max_num_seqs must be a positive int"):
        Engine(model, None, max_num_seqs=True)
    eng = Engine(model, None, num_blocks=8, block_size=4)
    with pytest.raises(ParamError, match=r"token ids must be ints, got 1.7 \(float\)"):
        eng.add_request("r", [1.7, 2.9])
    with pytest.raises(ParamError, match="token ids must be ints, got True"):
        eng.add_request("r", [True, 2])
    assert not eng.requests and not eng.waiting


TINY: dict[str, Any] = dict(vocab_size=32, hidden_size=16, num_hidden_layers=1)
CONFIG_CASES: list[tuple[type, dict[str, Any], str]] = [
    (MambaConfig, {"version": True}, "version must be an int"),
    (MambaConfig, {"num_hidden_layers": True}, "num_hidden_layers must be an int"),
    (MambaConfig, {"norm_eps": -1e-5}, "norm_eps must be > 0"),
    (MambaConfig, {"norm_eps": math.nan}, "norm_eps must be a finite number > 0"),
    (MambaConfig, {"version": 2, "head_dim": 8, "dt_limit": (math.nan, 1.0)}, "dt_limit"),
    (MambaConfig, {"version": 2, "head_dim": 8, "dt_limit": (5.0, 1.0)}, "0 <= low <= high"),
    (MambaConfig, {"use_bias": "no"}, "use_bias must be true or false"),
    (RWKVConfig, {"layer_norm_epsilon": -1.0}, "layer_norm_epsilon must be > 0"),
    (RWKVConfig, {"layer_norm_epsilon": math.nan}, "layer_norm_epsilon"),
    (RetNetConfig, {"num_heads": 2, "norm_eps": 0.0}, "norm_eps must be > 0"),
    (RetNetConfig, {"num_heads": 2, "chunk_size": 2.0}, "chunk_size must be an int"),
]


@pytest.mark.parametrize(("cls", "kw", "needle"), CONFIG_CASES, ids=lambda v: str(v)[:30])
def test_config_fields_are_checked_by_type(cls: type, kw: dict[str, Any], needle: str) -> None:
    with pytest.raises((ValueError, TypeError), match=needle):
        cls(**(TINY | kw))


def test_decoder_and_encoder_configs_refuse_bools_and_nan() -> None:
    from attnlab.models import DecoderConfig, EncoderConfig

    base = dict(vocab_size=32, hidden_size=16, num_attention_heads=2, intermediate_size=32)
    with pytest.raises(ValueError, match="num_hidden_layers must be an int"):
        DecoderConfig(**base, num_hidden_layers=True)
    with pytest.raises(ValueError, match="layer_norm_eps"):
        EncoderConfig(**base, num_hidden_layers=1, layer_norm_eps=math.nan)


def test_a_nan_or_negative_init_std_is_refused() -> None:
    from attnlab.train.build import build_model

    for bad in (math.nan, -0.02):
        with pytest.raises(ValueError, match="model.init_std must be"):
            build_model({"kind": "decoder", "init_std": bad}, vocab_size=32, max_length=8, seed=0)


def test_mamba2_folder_saved_by_transformers_reads_its_infinite_limit(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    import attnlab

    c = transformers.Mamba2Config(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_heads=2, head_dim=16,
        n_groups=1, state_size=8, expand=2,
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = transformers.Mamba2ForCausalLM(c).eval()
    theirs.save_pretrained(tmp_path)
    assert "__float__" in (tmp_path / "config.json").read_text()  # what 5.x writes
    ours = attnlab.from_hf(tmp_path)
    assert ours.config.dt_limit == (0.0, math.inf)
    ids = torch.randint(0, 32, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(
            ours(input_ids=ids).logits, theirs(ids).logits, atol=1e-5, rtol=1e-4
        )
    json.loads((tmp_path / "config.json").read_text())


def _recurrent() -> list[Any]:
    torch.manual_seed(0)
    return [
        MambaLM(MambaConfig(**TINY, state_size=4, chunk_size=4)),
        MambaLM(MambaConfig(**TINY, version=2, head_dim=8, state_size=4, chunk_size=4)),
        RWKVLM(RWKVConfig(**TINY, chunk_size=4)),
        RetNetLM(RetNetConfig(**TINY, num_heads=2, chunk_size=4)),
    ]


@pytest.mark.parametrize("i", range(4), ids=["mamba", "mamba2", "rwkv", "retnet"])
def test_recurrent_inputs_are_named(i: int) -> None:
    model = _recurrent()[i].eval()
    with pytest.raises(ValueError, match="input_ids has no tokens"):
        model(input_ids=torch.zeros(1, 0, dtype=torch.long), use_cache=True)
    with pytest.raises(TypeError, match="inputs_embeds is torch.float64, the model's weights"):
        model(inputs_embeds=torch.randn(1, 3, 16, dtype=torch.float64))
    out = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True)
    other = type(model)(model.config).double().eval()
    with pytest.raises(TypeError, match="past_key_values: layer 0 holds torch.float32 states"):
        other(input_ids=torch.tensor([[4]]), past_key_values=out.past_key_values)


def test_masks_and_dtypes_are_named_before_the_kernels() -> None:
    from attnlab import scaled_dot_product_attention as sdpa
    from attnlab.modules import MultiHeadAttention

    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(TypeError, match="attn_mask must be None, a torch.Tensor .* got list"):
        sdpa(q, q, q, attn_mask=[[True] * 3] * 3)
    mha = MultiHeadAttention(embed_dim=8, num_heads=2)
    with pytest.raises(TypeError, match="attn_mask must be None, a torch.Tensor"):
        mha(torch.randn(1, 3, 8), attn_mask=[[True] * 3] * 3)
    with pytest.raises(TypeError, match="query is torch.int64; this module's weights are"):
        mha(torch.ones(1, 3, 8, dtype=torch.long))


def test_encode_refuses_bytes_and_a_truthy_normalize(minilm_path: Path) -> None:
    import attnlab

    model = attnlab.load_embedding_model(minilm_path)
    with pytest.raises(TypeError, match="item 0 is bytes"):
        model.encode([b"bytes"])
    with pytest.raises(TypeError, match="normalize must be True, False or None"):
        model.encode(["a text"], normalize="no")
