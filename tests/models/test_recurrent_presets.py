"""Mamba, Mamba-2, RWKV-4 and RetNet as presets of the one decoder shell: a DecoderLM of
``mamba``/``mamba2``/``rwkv``/``retention`` layers with the recurrent model's weights computes its
logits (padded batches and cached decoding included) and generates its tokens; the
retention mixer mixes with attention in one layout, and its cached decoding equals its
forward."""

from __future__ import annotations

import pytest
import torch

from attnlab.cache.kv_cache import DynamicKVCache
from attnlab.cache.recurrent import Mamba2State, MambaState, RetentionState, RWKVState
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import LayerSpec
from attnlab.models.linear_layout import LinearLayerConfig
from attnlab.models.recurrent import RWKVLM, MambaLM, RetNetLM
from attnlab.models.recurrent_config import MambaConfig, RetNetConfig, RWKVConfig
from attnlab.models.recurrent_presets import (
    as_decoder,
    mamba_decoder_config,
    retnet_decoder_config,
)

V = 61
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _perturbed(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():  # norms start at 1: perturb every weight
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _retnet(**kw: object) -> RetNetLM:
    torch.manual_seed(0)
    cfg = RetNetConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=2, num_heads=2, chunk_size=4, **kw
    )
    return _perturbed(RetNetLM(cfg))  # type: ignore[return-value]


def _mamba(version: int, **kw: object) -> MambaLM:
    torch.manual_seed(0)
    extra: dict[str, object] = (
        {"head_dim": 8, "state_size": 8, "n_groups": 2} if version == 2 else {}
    )
    cfg = MambaConfig(
        vocab_size=V,
        hidden_size=16,
        num_hidden_layers=2,
        version=version,
        chunk_size=4,
        **extra,
        **kw,
    )
    return _perturbed(MambaLM(cfg))  # type: ignore[return-value]


def _assert_same_function(preset: DecoderLM, ours: torch.nn.Module) -> None:
    """Logits of a plain and a left-padded batch, and cached decoding, equal ``ours``'."""
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        torch.testing.assert_close(preset(ids).logits, ours(ids).logits, **TOL)
        torch.testing.assert_close(
            preset(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits, **TOL
        )
        cache = preset.new_cache()
        steps = [preset(ids[:, :5], past_key_values=cache).logits]
        steps += [preset(ids[:, t : t + 1], past_key_values=cache).logits for t in range(5, 11)]
    torch.testing.assert_close(torch.cat(steps, 1), ours(ids).logits, **TOL)
    start = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(2))
    assert torch.equal(preset.generate(start, max_new_tokens=16), ours.generate(start, 16))  # type: ignore[operator]


@pytest.mark.parametrize(
    ("version", "kw", "state"),
    [
        (1, {}, MambaState),
        (1, {"use_bias": True, "tie_word_embeddings": False}, MambaState),
        (2, {}, Mamba2State),
        (2, {"dt_limit": (0.01, 2.0)}, Mamba2State),
    ],
    ids=["mamba", "mamba-bias-untied", "mamba2", "mamba2-dt-limit"],
)
def test_the_mamba_preset_computes_mambas_logits(
    version: int, kw: dict[str, object], state: type
) -> None:
    ours = _mamba(version, **kw)
    preset = as_decoder(ours)
    assert preset.num_parameters() == ours.num_parameters()
    assert [type(c) for c in preset.new_cache().layers] == [state] * 2
    _assert_same_function(preset, ours)


@pytest.mark.parametrize(
    "kw",
    [{}, {"hidden_act": "swish", "scale_embedding": True, "tie_word_embeddings": True}],
    ids=["gelu", "swish-scaled-tied"],
)
def test_the_retnet_preset_computes_retnets_logits(kw: dict[str, object]) -> None:
    ours = _retnet(**kw)
    preset = as_decoder(ours)
    assert preset.num_parameters() == ours.num_parameters()
    assert [type(c) for c in preset.new_cache().layers] == [RetentionState] * 2
    _assert_same_function(preset, ours)


@pytest.mark.parametrize(
    "kw", [{}, {"attention_hidden_size": 24, "tie_word_embeddings": True}], ids=["plain", "wide"]
)
def test_the_rwkv_preset_computes_rwkvs_logits(kw: dict[str, object]) -> None:
    torch.manual_seed(0)
    ours = _perturbed(
        RWKVLM(RWKVConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, chunk_size=4, **kw))
    )
    assert isinstance(ours, RWKVLM)
    preset = as_decoder(ours)
    assert preset.num_parameters() == ours.num_parameters()
    assert [type(c) for c in preset.new_cache().layers] == [RWKVState] * 2
    _assert_same_function(preset, ours)


def test_retention_mixes_with_attention() -> None:
    torch.manual_seed(0)
    retention = LayerSpec(mixer="retention", linear=LinearLayerConfig(num_heads=2, chunk_size=4))
    cfg = DecoderConfig(
        vocab_size=V,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=24,
        layers=(retention, LayerSpec(), retention),
    )
    model = DecoderLM(cfg).eval()
    assert [type(c) for c in model.new_cache().layers] == [
        RetentionState,
        DynamicKVCache,
        RetentionState,
    ]
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache()
        steps = [model(ids[:, :4], past_key_values=cache).logits]
        steps += [model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, **TOL)


def test_bad_inputs_are_named() -> None:
    with pytest.raises(TypeError, match="MambaConfig"):
        mamba_decoder_config(RetNetConfig())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="RetNetConfig"):
        retnet_decoder_config(DecoderConfig(vocab_size=V))  # type: ignore[arg-type]
    small = DecoderConfig(
        vocab_size=V,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
    )
    with pytest.raises(TypeError, match="MambaLM, RWKVLM or RetNetLM, got DecoderLM"):
        as_decoder(DecoderLM(small))  # type: ignore[arg-type]


def _rwkv() -> RWKVLM:
    torch.manual_seed(0)
    cfg = RWKVConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, chunk_size=4)
    return _perturbed(RWKVLM(cfg))  # type: ignore[return-value]


@pytest.mark.parametrize(
    "make",
    [lambda: _mamba(1), lambda: _mamba(2), _rwkv, _retnet],
    ids=["mamba", "mamba2", "rwkv", "retnet"],
)
def test_the_recurrent_models_are_decoder_presets_with_their_own_names(make: object) -> None:
    """MambaLM, RWKVLM and RetNetLM are DecoderLMs (one forward, cache and serving step)
    that keep their own config and checkpoint names."""
    from attnlab.interop.hf import converter_for
    from attnlab.models.recurrent_presets import checkpoint_key, shell_key

    model = make()  # type: ignore[operator]
    assert isinstance(model, DecoderLM) and isinstance(model.decoder_config, DecoderConfig)
    assert not isinstance(model.config, DecoderConfig)  # MambaConfig / RetNetConfig
    shell = as_decoder(model).state_dict()
    names = list(model.state_dict())
    assert len(names) == len(shell) and not any(".self_attention." in k for k in names)
    parts = type(model).checkpoint_parts
    assert sorted(shell_key(k, parts) for k in names) == sorted(shell)  # type: ignore[type-var]
    assert all(shell_key(checkpoint_key(k, parts), parts) == k for k in shell)
    # a state dict of checkpoint names loads back (strict), into a new model of the class
    other = type(model)(model.config).eval()
    other.load_state_dict(model.state_dict())
    ids = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(other(ids).logits, model(ids).logits, atol=0, rtol=0)
    # to_hf picks the model's own converter (RetNet has none), never a Llama's
    conv = converter_for(model)
    assert conv is None or issubclass(conv.attnlab_class, type(model))


def test_a_recurrent_decode_step_is_never_compiled() -> None:
    """The compiled decode step runs over a static KV cache: a model whose layers carry a
    recurrent state decodes eagerly by default and refuses compile=True by name."""
    from attnlab.generation.compiled import compile_decision

    model = _mamba(1)
    decision = compile_decision(model, 1000)
    assert not decision.compile and "recurrent state" in decision.reason
    with pytest.raises(ValueError, match="MambaLM has layers that carry a recurrent state"):
        compile_decision(model, 1000, compile=True)
