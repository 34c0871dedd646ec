"""The advisor's rule about state-space models: when does a recurrent state beat a KV cache?

A decoder's KV cache grows by ``2 * layers * kv_heads * head_dim`` elements per token; a
Mamba of the same width carries a fixed state (Gu & Dao, 2023). With two Mamba blocks per
Transformer layer (a Mamba block has about half a Transformer layer's parameters, the
paper's pairing), the state is ``2 * layers * E * (N + K - 1)`` elements per sequence,
``E = 2 D``. The crossover context is the state divided by the cache's bytes per token.
A Jamba-style hybrid (Lieber et al., 2024: one attention layer in eight) keeps an eighth
of the cache plus the Mamba layers' states.
"""

from __future__ import annotations

from attnlab.analysis.advice_plan import Recommendation
from attnlab.analysis.arch import ArchSpec
from attnlab.analysis.cost import human_bytes
from attnlab.analysis.cost_recurrent import state_bytes
from attnlab.models.recurrent_config import MambaConfig

__all__ = ["state_space_comparison", "state_space_recommendation"]


def state_space_comparison(
    spec: ArchSpec, *, seq_len: int, batch_size: int, bytes_per_element: int
) -> dict[str, float]:
    """Numbers of the comparison: KV cache, Mamba state, hybrid, crossover context."""
    kv_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * bytes_per_element
    kv = kv_per_token * seq_len * batch_size
    mamba = MambaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=2 * spec.num_layers,
    )
    st = state_bytes(mamba, batch_size=batch_size) * bytes_per_element // 4
    attn_layers = max(1, spec.num_layers // 8)
    hybrid = (
        kv * attn_layers / spec.num_layers + st * (spec.num_layers - attn_layers) / spec.num_layers
    )
    return {
        "kv_cache_bytes": kv,
        "state_bytes": st,
        "hybrid_bytes": hybrid,
        "crossover_tokens": st / (kv_per_token * batch_size),
    }


def state_space_recommendation(
    spec: ArchSpec, *, seq_len: int, batch_size: int, bytes_per_element: int, task: str
) -> Recommendation | None:
    """A ``state_space`` :class:`~attnlab.analysis.advisor.Recommendation` for causal LMs, else None."""
    if not spec.causal or not spec.lm_head:
        return None
    c = state_space_comparison(
        spec, seq_len=seq_len, batch_size=batch_size, bytes_per_element=bytes_per_element
    )
    ratio = c["kv_cache_bytes"] / max(c["state_bytes"], 1)
    reason = (
        f"at {seq_len} tokens the KV cache takes {human_bytes(c['kv_cache_bytes'])}; a Mamba of the "
        f"same width ({2 * spec.num_layers} blocks, state 16) carries {human_bytes(c['state_bytes'])} "
        f"at any length, smaller than the cache beyond {c['crossover_tokens']:.0f} tokens"
    )
    if ratio > 1:
        reason += (
            f" ({ratio:.1f}x less here); a Jamba-style hybrid (1 attention layer in 8) "
            f"{human_bytes(c['hybrid_bytes'])}. Mamba/RWKV/RetNet are attnlab.models.recurrent; "
            "their quality at a given size is the open question, their memory is not"
        )
        long_context = seq_len >= 2048 and ratio >= 4
        choice = (
            "consider Mamba or a hybrid"
            if long_context and task in ("generation", "long-document", "realtime")
            else "attention (the cache is still small at this length)"
        )
    else:
        reason += f": attention's cache is the smaller one here ({1 / ratio:.1f}x)"
        choice = "attention (the KV cache is smaller at this length)"
    return Recommendation("state_space", choice, reason)
