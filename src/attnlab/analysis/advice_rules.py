"""Rules of the advisor that stand alone: the KV heads of a decoder, and a mixed layout.

* :func:`kv_heads_rule`: for decoders the KV cache is the memory that grows with every
  token, so the advisor picks the most KV heads whose cache fits a quarter of the memory
  left after the weights (GQA/MQA for real-time work, as the tutorial says); encoders
  keep MHA;
* :func:`layout_recs`: a pretrained local/global layout (Gemma 2/3, ModernBERT) is
  costed as it is, and its windows are reported per kind of layer.
"""

from __future__ import annotations

from attnlab.analysis.advice_plan import Plan, Recommendation, gib
from attnlab.analysis.arch import ArchSpec
from attnlab.analysis.cost import estimate, human_flops

__all__ = ["kv_heads_rule", "layout_recs"]


def layout_recs(
    spec: ArchSpec, best: Plan, budget: int, generative: bool
) -> tuple[str, str, Recommendation]:
    """The attention and window recommendations for a mixed local/global layout."""
    assert spec.layer_windows is not None
    local = [w for w in spec.layer_windows if w is not None]
    sizes = ", ".join(str(w) for w in sorted(set(local)))
    attn = f"the model's local/global layers ({len(local)} of {spec.num_layers} local)"
    reason = (
        f"a pretrained layout, costed as it is: {gib(best.report.activation_bytes)} of "
        f"activations, {gib(best.bytes)} in all, within your {gib(budget)}"
        if best.bytes <= budget
        else f"a pretrained layout, costed as it is: {gib(best.bytes)} over your {gib(budget)}"
    )
    why = (
        f"local layers see {sizes} keys, global ones all: {best.density:.1%} of the score "
        "matrix on average"
        + (f"; the KV cache at this length is {gib(best.kv_bytes)}" if generative else "")
    )
    return attn, reason, Recommendation("window", f"{sizes} on local layers", why)


def kv_heads_rule(
    spec: ArchSpec,
    *,
    task: str,
    generative: bool,
    batch_size: int,
    seq_len: int,
    budget: int,
    device: str,
) -> tuple[Recommendation, ArchSpec]:
    """KV heads: for decoders the cache is the memory that grows with every token; an
    encoder keeps MHA. Returns the recommendation and the spec with the chosen heads."""
    h = spec.num_heads
    kv_rec: Recommendation
    if generative:
        options = sorted({h, *(k for k in (8, 4, 2, 1) if h % k == 0)}, reverse=True)
        dt0 = "bfloat16" if device == "cuda" else "float32"
        caches = {
            k: estimate(
                spec.with_(num_kv_heads=k),
                batch_size=batch_size,
                seq_len=seq_len,
                mode="decode",
                dtype=dt0,
            ).kv_cache_bytes
            for k in options
        }
        weights = estimate(spec, seq_len=1, dtype=dt0).parameter_bytes
        room = budget - weights
        pick = next((k for k in options if caches[k] <= 0.25 * room), options[-1])
        why_rule = ""
        if task == "realtime" and pick == h and h > 1:
            # the tutorial's rule (MQA/GQA for real-time); the numbers say how far to go
            pick = next(k for k in options if k < h and h // k <= 4)
            why_rule = "; the tutorial's real-time rule (GQA/MQA) applies: decoding reads the whole cache for every token"
        kv_reason = (
            f"KV cache for {batch_size} x {seq_len} tokens in {dt0}: "
            + ", ".join(f"{k} kv heads {gib(c)}" for k, c in caches.items())
            + f"; {pick} keeps it within a quarter of the {gib(max(room, 0))} left after the weights"
            + why_rule
        )
        kind = "MHA" if pick == h else "MQA" if pick == 1 else "GQA"
        kv_rec = Recommendation("kv_heads", f"{pick} of {h} ({kind})", kv_reason)
        spec = spec.with_(num_kv_heads=pick)
    else:
        dense_mha = estimate(spec, batch_size=batch_size, seq_len=seq_len)
        gqa = estimate(
            spec.with_(num_kv_heads=max(1, h // 4)), batch_size=batch_size, seq_len=seq_len
        )
        saved = dense_mha.flops - gqa.flops
        kv_rec = Recommendation(
            "kv_heads",
            f"{h} of {h} (MHA)",
            f"an encoder keeps no KV cache; GQA with {max(1, h // 4)} kv heads would save only "
            f"{human_flops(saved)} ({saved / dense_mha.flops:.0%}) of a forward and gives up "
            "pretrained MHA checkpoints",
        )
    return kv_rec, spec
