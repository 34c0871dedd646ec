"""The KV-cache term of the cost model for quantized caches (int8/int4/int2, KIVI layout).

Counts what :class:`attnlab.cache.quantized.QuantizedKVCache` holds: per token and
key/value head, the levels (``bits / 8`` bytes an element) and float32 statistics (keys
per channel: a scale and a zero point per channel for each group of 32 tokens; values per
token: one pair a token; int8 is symmetric, a scale only), plus the float window of the
newest tokens in the model dtype.
"""

from __future__ import annotations

from attnlab.analysis.arch import ArchSpec

__all__ = ["check_kv_dtype", "kv_cache_bytes", "quantized_kv_bytes"]


def check_kv_dtype(kv_dtype: str | None, mode: str, cache: str) -> str | None:
    """``kv_dtype`` validated against the mode and cache (None for a float cache)."""
    if kv_dtype is None or kv_dtype == "float":
        return None
    from attnlab.cache.quantized import KV_DTYPES

    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {['float', *KV_DTYPES]}, got {kv_dtype!r}")
    if mode != "decode" or cache != "dynamic":
        raise ValueError(
            f"kv_dtype={kv_dtype!r} applies to mode='decode' with a dynamic cache (the "
            f"quantized KV cache grows), got mode={mode!r}, cache={cache!r}"
        )
    return kv_dtype


def quantized_kv_bytes(
    spec: ArchSpec,
    layers: int,
    batch_size: int,
    slots: int,
    context: int,
    kv_dtype: str,
    bytes_per_element: int,
    *,
    residual: int = 32,
    group: int = 32,
) -> int:
    """Bytes of a :class:`~attnlab.cache.quantized.QuantizedKVCache` per model holding
    ``context`` tokens in ``slots`` allocated slots: the levels and statistics of every
    slot, and the float window in the model dtype (values: the newest ``residual``
    tokens; keys: those and the partial group, ``residual <= n < residual + group``)."""
    from attnlab.cache.quantized import kv_bytes_per_token

    heads = layers * batch_size * spec.num_kv_heads
    slots = -(-slots // group) * group  # key groups are allocated whole
    stored = kv_bytes_per_token(kv_dtype, spec.head_dim, group=group) * slots
    key_tail = context if context <= residual else context - (context - residual) // group * group
    window = spec.head_dim * (key_tail + min(context, residual)) * bytes_per_element
    return int(heads * (stored + window))


def kv_cache_bytes(
    spec: ArchSpec,
    groups: list[tuple[int, int]],
    *,
    batch_size: int,
    context: int,
    kv_dtype: str | None,
    bytes_per_element: int,
    cross_len: int = 0,
) -> int:
    """Bytes of the decoding KV caches of a model.

    Args:
        spec: the architecture.
        groups: ``(layers, slots per sequence)`` for each group of self-attention layers.
        batch_size: sequences.
        context: tokens in the cache after the step.
        kv_dtype: a quantized cache's dtype (:func:`quantized_kv_bytes`), or None for
            ``bytes_per_element`` per element.
        bytes_per_element: the model dtype's.
        cross_len: an encoder-decoder's source tokens, whose cross-attention caches
            (one per decoder layer) stay in the model dtype.
    """
    total = 0
    for n, slots in groups:
        if kv_dtype is not None:
            total += quantized_kv_bytes(
                spec, n, batch_size, slots, context, kv_dtype, bytes_per_element
            )
        else:
            total += 2 * n * batch_size * spec.kv_dim * slots * bytes_per_element
    if cross_len:
        total += (
            2 * spec.num_decoder_layers * batch_size * spec.kv_dim * cross_len * bytes_per_element
        )
    return total
