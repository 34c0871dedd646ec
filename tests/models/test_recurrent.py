"""Mamba, Mamba-2, RWKV and RetNet language models: decoding with the recurrent state
equals the parallel forward at every step, left padding equals each row alone, the
states follow the cache protocol, and bad inputs are rejected by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnlab.cache.recurrent import MambaState, RetentionState, RWKVState
from attnlab.models.recurrent import RWKVLM, MambaLM, RecurrentLM, RetNetLM
from attnlab.models.recurrent_config import MambaConfig, RetNetConfig, RWKVConfig

V = 53


def _models() -> dict[str, RecurrentLM]:
    torch.manual_seed(0)
    return {
        "mamba": MambaLM(
            MambaConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, chunk_size=4)
        ),
        "mamba2": MambaLM(
            MambaConfig(
                vocab_size=V,
                hidden_size=16,
                num_hidden_layers=2,
                version=2,
                head_dim=8,
                state_size=8,
                n_groups=2,
                chunk_size=4,
            )
        ),
        "rwkv": RWKVLM(RWKVConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, chunk_size=4)),
        "retnet": RetNetLM(
            RetNetConfig(
                vocab_size=V, hidden_size=16, num_hidden_layers=2, num_heads=2, chunk_size=4
            )
        ),
        "retnet-parallel": RetNetLM(
            RetNetConfig(
                vocab_size=V, hidden_size=16, num_hidden_layers=2, num_heads=2, form="parallel"
            )
        ),
    }


MODELS = _models()
NAMES = list(MODELS)
TOL = {"atol": 1e-10, "rtol": 1e-10}


@pytest.fixture(params=NAMES)
def model(request: pytest.FixtureRequest) -> RecurrentLM:
    return MODELS[request.param].double().eval()


def test_decoding_step_by_step_equals_the_parallel_forward(model: RecurrentLM) -> None:
    ids = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache()
        parts = [model(ids[:, :6], past_key_values=cache, use_cache=True).logits]
        for t in range(6, 13):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            assert out.past_key_values is cache and cache.length == t + 1
            parts.append(out.logits)
    torch.testing.assert_close(torch.cat(parts, 1), full, **TOL)


def test_left_padding_equals_each_row_alone(model: RecurrentLM) -> None:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (3, 10), generator=g)
    pads = [0, 3, 6]
    mask = torch.ones(3, 10, dtype=torch.long)
    for row, p in enumerate(pads):
        mask[row, :p] = 0
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        for row, p in enumerate(pads):
            alone = model(ids[row : row + 1, p:]).logits
            torch.testing.assert_close(batch[row : row + 1, p:], alone, **TOL)
    gen = model.generate(ids, 6, attention_mask=mask)
    for row, p in enumerate(pads):
        alone = model.generate(ids[row : row + 1, p:], 6)
        assert gen[row, 10:].tolist() == alone[0, 10 - p :].tolist()


def test_state_is_constant_in_size_and_follows_the_protocol(model: RecurrentLM) -> None:
    ids = torch.randint(0, V, (3, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        short, long_ = model.new_cache(), model.new_cache()
        model(ids[:, :5], past_key_values=short)
        model(ids, past_key_values=long_)
        assert short.length == 5 and long_.length == 40
        sizes = [layer.nbytes() for layer in short.layers]
        assert sizes == [layer.nbytes() for layer in long_.layers] and min(sizes) > 0
        # select rows: row 2 then row 0 continue as they would alone
        for layer in long_.layers:
            layer.select(torch.tensor([2, 0]))
        nxt = torch.randint(0, V, (2, 1), generator=torch.Generator().manual_seed(4))
        picked = model(nxt, past_key_values=long_).logits
        ref = model.new_cache()
        model(ids[[2, 0]], past_key_values=ref)
        torch.testing.assert_close(picked, model(nxt, past_key_values=ref).logits, **TOL)
        long_.reset()
        assert long_.length == 0 and all(layer.nbytes() == 0 for layer in long_.layers)


def test_labels_give_the_shifted_cross_entropy(model: RecurrentLM) -> None:
    ids = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    labels[0, :3] = -100
    out = model(ids, labels=labels)
    want = F.cross_entropy(
        out.logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    torch.testing.assert_close(out.loss, want)
    out.loss.backward()
    assert model.embed_tokens.weight.grad is not None
    model.zero_grad(set_to_none=True)


def test_states_have_the_documented_shapes() -> None:
    m = MODELS["mamba"].float()
    cache = m.new_cache()
    m(torch.zeros(2, 3, dtype=torch.long), past_key_values=cache)
    s = cache.layers[0]
    assert isinstance(s, MambaState) and s.conv is not None and s.ssm is not None
    assert s.conv.shape == (2, 3, 32) and s.ssm.shape == (2, 32, 16)
    r = MODELS["rwkv"].float()
    cache = r.new_cache()
    r(torch.zeros(2, 3, dtype=torch.long), past_key_values=cache)
    st = cache.layers[0]
    assert isinstance(st, RWKVState) and st.num is not None and st.num.shape == (2, 16)
    n = MODELS["retnet"].float()
    cache = n.new_cache()
    n(torch.zeros(2, 3, dtype=torch.long), past_key_values=cache)
    rs = cache.layers[0]
    assert (
        isinstance(rs, RetentionState) and rs.state is not None and rs.state.shape == (2, 2, 8, 16)
    )


def test_bad_inputs_are_rejected_by_name() -> None:
    m = MODELS["mamba"].float()
    with pytest.raises(ValueError, match="token ids"):
        m(torch.tensor([[V]]))
    with pytest.raises(ValueError, match="attention_mask covers"):
        m(torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 4))
    cache = m.new_cache()
    m(torch.zeros(2, 3, dtype=torch.long), past_key_values=cache)
    with pytest.raises(ValueError, match="batch size 1 does not match the state's batch size 2"):
        m(torch.zeros(1, 1, dtype=torch.long), past_key_values=cache)
    with pytest.raises(ValueError, match="layer states"):
        m(
            torch.zeros(1, 1, dtype=torch.long),
            past_key_values=MODELS["rwkv"].new_cache().__class__(layers=[]),
        )
    with pytest.raises(ValueError, match="version"):
        MambaConfig(version=3)
    with pytest.raises(ValueError, match="n_groups"):
        MambaConfig(hidden_size=32, version=2, head_dim=16, n_groups=3)
    with pytest.raises(ValueError, match="chunk_size"):
        RWKVConfig(chunk_size=0)
    with pytest.raises(ValueError, match="form"):
        RetNetConfig(form="recurrent")
    with pytest.raises(TypeError, match="MambaConfig"):
        MambaLM(RWKVConfig())  # type: ignore[arg-type]
