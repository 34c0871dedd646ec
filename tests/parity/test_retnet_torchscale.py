"""RetNet against PyPI torchscale 0.3.0's ``RetNetDecoder`` on mapped weights.

torchscale 0.3.0 imports ``fairscale`` (for ``checkpoint_wrapper``/``wrap``) and ``timm``
(for ``drop_path``) at module level, and pins versions of both that do not install beside
this torch. Neither is used by a RetNet forward without activation checkpointing, FSDP or
drop-path, so the test provides stand-ins that only satisfy those imports (identity
wrappers; drop-path rate 0). torchscale is installed with ``--no-deps`` by the Makefile.

torchscale rescales retention for numerical range (rows of the decay matrix and of
``QK^T`` divided by their sums); the per-head RMS norm cancels those scales up to its
epsilon, so the comparison runs with a small epsilon. torchscale computes its RMS norms
and GLU activation in float32 even for float64 inputs, so the models agree to float32
rounding (1e-5), not to float64's.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from attnlab.models.recurrent import RetNetLM
from attnlab.models.recurrent_config import RetNetConfig

pytest.importorskip("torchscale")


@pytest.fixture(scope="module")
def torchscale_retnet() -> types.ModuleType:
    stubs = {}
    fairscale, fairscale_nn = types.ModuleType("fairscale"), types.ModuleType("fairscale.nn")
    fairscale_nn.checkpoint_wrapper = lambda module, **kw: module  # type: ignore[attr-defined]
    fairscale_nn.wrap = lambda module, **kw: module  # type: ignore[attr-defined]
    fairscale.nn = fairscale_nn  # type: ignore[attr-defined]
    timm = types.ModuleType("timm")
    timm_models, timm_layers = (
        types.ModuleType("timm.models"),
        types.ModuleType("timm.models.layers"),
    )

    def no_drop_path(
        x: torch.Tensor, drop_prob: float = 0.0, training: bool = False
    ) -> torch.Tensor:
        if drop_prob:
            raise NotImplementedError("drop_path is stubbed for this test")
        return x

    timm_layers.drop_path = no_drop_path  # type: ignore[attr-defined]
    timm.models, timm_models.layers = timm_models, timm_layers  # type: ignore[attr-defined]
    for name, mod in {
        "fairscale": fairscale,
        "fairscale.nn": fairscale_nn,
        "timm": timm,
        "timm.models": timm_models,
        "timm.models.layers": timm_layers,
    }.items():
        if name not in sys.modules:
            stubs[name] = mod
    sys.modules.update(stubs)
    try:
        from torchscale.architecture import retnet
    finally:
        for name in stubs:
            sys.modules.pop(name, None)
    return retnet


def _pair(retnet: types.ModuleType, chunkwise: bool) -> tuple[torch.nn.Module, RetNetLM]:
    from torchscale.architecture.config import RetNetConfig as TSConfig

    torch.manual_seed(0)
    args = TSConfig(
        decoder_embed_dim=32,
        decoder_value_embed_dim=64,
        decoder_retention_heads=4,
        decoder_ffn_embed_dim=48,
        decoder_layers=2,
        vocab_size=61,
        recurrent_chunk_size=4,
        chunkwise_recurrent=chunkwise,
        layernorm_eps=1e-12,
    )
    theirs = retnet.RetNetDecoder(args, embed_tokens=torch.nn.Embedding(61, 32)).double().eval()
    ours = (
        RetNetLM(
            RetNetConfig(
                vocab_size=61,
                hidden_size=32,
                num_hidden_layers=2,
                num_heads=4,
                value_dim=64,
                intermediate_size=48,
                norm_eps=1e-12,
                chunk_size=4,
            )
        )
        .double()
        .eval()
    )
    names = {"norm_f.": "layer_norm.", "lm_head.": "output_projection."}
    state = {}
    for key in ours.state_dict():
        theirs_key = next((v + key[len(k) :] for k, v in names.items() if key.startswith(k)), key)
        state[key] = theirs.state_dict()[theirs_key]
    ours.load_state_dict(state)
    return theirs, ours


@pytest.mark.parametrize("chunkwise", [False, True], ids=["parallel", "chunkwise"])
def test_logits_match_torchscale(torchscale_retnet: types.ModuleType, chunkwise: bool) -> None:
    theirs, ours = _pair(torchscale_retnet, chunkwise)
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(ids)[0]
        got = ours(ids).logits
        cache = ours.new_cache()
        steps = torch.cat(
            [ours(ids[:, t : t + 1], past_key_values=cache).logits for t in range(12)], 1
        )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(steps, want, atol=1e-5, rtol=1e-5)
