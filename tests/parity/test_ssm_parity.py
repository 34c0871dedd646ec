"""Mamba, Mamba-2 and RWKV-4 against transformers on the same weights (tiny random configs).

transformers runs its PyTorch fallbacks on CPU (sequential scans): an exact peer for
values. Parity runs unpadded (transformers' padding differs by design, see
``attnlab.models.recurrent``); padding is tested against per-row runs in
``tests/models/test_recurrent.py``.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.models.recurrent import RWKVLM, MambaLM
from attnlab.models.recurrent_config import MambaConfig, RWKVConfig

transformers = pytest.importorskip("transformers")

TOL = {"atol": 1e-4, "rtol": 1e-4}


def _hf_models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    tf = transformers
    return {
        "mamba": tf.MambaForCausalLM(
            tf.MambaConfig(vocab_size=97, hidden_size=32, state_size=8, num_hidden_layers=2)
        ),
        "mamba2": tf.Mamba2ForCausalLM(
            tf.Mamba2Config(
                vocab_size=97,
                hidden_size=32,
                state_size=8,
                num_hidden_layers=2,
                num_heads=4,
                head_dim=16,
                n_groups=2,
                chunk_size=8,
            )
        ),
        "rwkv": tf.RwkvForCausalLM(
            tf.RwkvConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, context_length=64)
        ),
    }


@pytest.fixture(scope="module")
def hf_models() -> dict[str, torch.nn.Module]:
    models = _hf_models()
    for m in models.values():
        m.eval()
        with torch.no_grad():  # random init leaves some parameters at round values; perturb
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.02)
    return models


@pytest.mark.parametrize("arch", ["mamba", "mamba2", "rwkv"])
def test_logits_match_transformers(hf_models: dict, arch: str) -> None:
    hf = hf_models[arch]
    ours = attnlab.from_hf(hf)
    assert isinstance(ours, MambaLM | RWKVLM)
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids).logits
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("arch", ["mamba", "mamba2", "rwkv"])
def test_greedy_generation_matches_transformers(hf_models: dict, arch: str) -> None:
    hf = hf_models[arch]
    ours = attnlab.from_hf(hf)
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=32, do_sample=False, min_new_tokens=32)
    got = ours.generate(ids, 32)
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize(
    "config",
    [
        MambaConfig(vocab_size=61, hidden_size=24, num_hidden_layers=2, state_size=4),
        MambaConfig(
            vocab_size=61, hidden_size=24, num_hidden_layers=2, version=2, head_dim=12, n_groups=2
        ),
        RWKVConfig(vocab_size=61, hidden_size=24, num_hidden_layers=2),
    ],
    ids=["mamba", "mamba2", "rwkv"],
)
def test_to_hf_round_trip(config: MambaConfig | RWKVConfig) -> None:
    torch.manual_seed(3)
    ours = (MambaLM if isinstance(config, MambaConfig) else RWKVLM)(config).eval()  # type: ignore[arg-type]
    hf = attnlab.to_hf(ours)
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids).logits, **TOL)
    back = attnlab.from_hf(hf)
    for (k, a), b in zip(ours.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), k
