"""The recurrent models' cost model against what runs: FlopCounterMode, the state's
nbytes(), the parameters, and the bytes autograd saves for the backward pass."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from attnlab.analysis.cost_recurrent import estimate_recurrent, state_bytes
from attnlab.models.recurrent import RWKVLM, MambaLM, RecurrentLM, RetNetLM
from attnlab.models.recurrent_config import MambaConfig, RetNetConfig, RWKVConfig

CONFIGS = {
    "mamba": MambaConfig(vocab_size=101, hidden_size=48, num_hidden_layers=2, chunk_size=16),
    "mamba2": MambaConfig(
        vocab_size=101,
        hidden_size=48,
        num_hidden_layers=2,
        version=2,
        head_dim=16,
        state_size=8,
        n_groups=2,
        chunk_size=16,
    ),
    "rwkv": RWKVConfig(vocab_size=101, hidden_size=48, num_hidden_layers=2, chunk_size=16),
    "retnet": RetNetConfig(
        vocab_size=101, hidden_size=48, num_hidden_layers=2, num_heads=3, chunk_size=16
    ),
}


def _build(config: object) -> RecurrentLM:
    torch.manual_seed(0)
    if isinstance(config, MambaConfig):
        return MambaLM(config)
    return RWKVLM(config) if isinstance(config, RWKVConfig) else RetNetLM(config)  # type: ignore[arg-type]


def _saved_bytes(model: RecurrentLM, ids: torch.Tensor) -> int:
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids).logits.float().logsumexp(-1).mean()
    return sum(storages.values())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_estimate_matches_what_runs(name: str) -> None:
    config = CONFIGS[name]
    model = _build(config)
    length = 64
    ids = torch.randint(0, 101, (2, length), generator=torch.Generator().manual_seed(1))
    est = estimate_recurrent(config, batch_size=2, seq_len=length)
    assert est.parameter_count == model.num_parameters()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(ids)
    assert est.forward_matmul_flops == pytest.approx(counter.get_total_flops(), rel=0.03)
    # one decoding step: same FLOPs at any context, and the state as allocated
    cache = model.new_cache()
    with torch.no_grad():
        model(ids, past_key_values=cache)
        with FlopCounterMode(display=False) as step:
            model(ids[:, :1], past_key_values=cache)
    dec = estimate_recurrent(config, batch_size=2, seq_len=length, mode="decode")
    assert dec.forward_matmul_flops == pytest.approx(step.get_total_flops(), rel=0.03)
    assert (
        dec.state_bytes == sum(s.nbytes() for s in cache.layers) == state_bytes(model, batch_size=2)
    )
    assert estimate_recurrent(config, seq_len=10 * length, mode="decode").flops == dec.flops / 2
    # training: activations as autograd saves them
    train = estimate_recurrent(config, batch_size=2, seq_len=length, mode="training")
    assert train.activation_bytes == pytest.approx(_saved_bytes(model.train(), ids), rel=0.1)


def test_estimate_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="MambaConfig"):
        estimate_recurrent(object(), seq_len=4)
    with pytest.raises(ValueError, match="seq_len"):
        estimate_recurrent(CONFIGS["rwkv"], seq_len=0)
    with pytest.raises(ValueError, match="mode"):
        estimate_recurrent(CONFIGS["rwkv"], seq_len=4, mode="serve")  # type: ignore[arg-type]


def test_advise_says_in_numbers_when_a_state_beats_the_cache() -> None:
    from attnlab.analysis.advisor import advise

    long_ = advise("generation", seq_len=16384, memory_gb=8).get("state_space")
    assert long_.choice == "consider Mamba or a hybrid"
    assert "16384 tokens the KV cache takes" in long_.reason and "beyond" in long_.reason
    short = advise("generation", seq_len=512, memory_gb=8).get("state_space")
    assert short.choice.startswith("attention")
    with pytest.raises(KeyError):
        advise("classification", seq_len=512, memory_gb=8).get("state_space")


def test_cli_estimate_reads_a_recurrent_config(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from attnlab.cli.main import main

    path = tmp_path / "mamba.json"
    CONFIGS["mamba"].save(path)
    assert main(["estimate", "--config", str(path), "--seq-len", "4096", "--mode", "decode"]) == 0
    out = capsys.readouterr().out
    assert "mamba (recurrent state, no KV cache)" in out and "the same at any context length" in out
