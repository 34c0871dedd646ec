"""Cost against sequence length: the tutorial's table, done with the cost model.

The tutorial's ``estimate_complexity(seq_len, 768, 12)`` prints ``n² · d`` for
``n = 128 ... 2048``: the multiply-adds of one ``QKᵀ`` product. :func:`scaling_table`
puts that column next to what the cost model says for a whole model of the same sizes
(BERT-base: 12 layers, hidden 768, 12 heads), from 128 to 32768 tokens, for three
variants that change one thing each:

* ``dense``: full attention, every head with its own keys and values (MHA);
* ``sliding``: a causal window of 512 keys (the tutorial's ``window_size``; Beltagy et
  al., 2020; Jiang et al., 2023), on a backend that skips the masked tiles;
* ``gqa``: 4 key/value heads for the 12 query heads (Ainslie et al., 2023).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from attnlab.analysis.arch import ArchSpec, describe, preset
from attnlab.analysis.cost import estimate

__all__ = ["SEQ_LENS", "ScalingRow", "scaling_table", "tutorial_variants"]

#: The tutorial's lengths (128 ... 2048), extended to 32768.
SEQ_LENS: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass
class ScalingRow:
    """One variant at one length. FLOPs are one forward pass of one sequence.

    Attributes:
        variant: ``"dense"``, ``"sliding"``, ``"gqa"`` (or a name you gave).
        seq_len: tokens.
        tutorial_n2d: the tutorial's ``n² · d``.
        attention_flops_per_layer: QKᵀ and weights·V FLOPs one layer executes.
        forward_flops: the whole model's forward FLOPs.
        score_matrix_bytes: one layer's float32 ``H x n x n`` score matrix, if built.
        inference_activations_materialised: peak activations, score matrix built.
        inference_activations_tiled: peak activations, tiled attention.
        training_activations_tiled: training activations, tiled attention, no checkpointing.
        training_activations_tiled_checkpointed: the same with per-layer checkpointing.
        kv_cache_bytes: float16 KV cache while decoding the token after ``n`` (a sliding
            window keeps only its window).
    """

    variant: str
    seq_len: int
    tutorial_n2d: int
    attention_flops_per_layer: float
    forward_flops: float
    score_matrix_bytes: int
    inference_activations_materialised: int
    inference_activations_tiled: int
    training_activations_tiled: int
    training_activations_tiled_checkpointed: int
    kv_cache_bytes: int


def tutorial_variants(
    base: ArchSpec | None = None, *, window: int = 512, kv_heads: int = 4
) -> dict[str, ArchSpec]:
    """``dense``, ``sliding`` and ``gqa`` versions of ``base`` (default: the tutorial's sizes).

    Raises:
        ValueError: ``kv_heads`` that does not divide the heads, a window below 1.
    """
    base = preset("tutorial") if base is None else base
    if window <= 0:
        raise ValueError(f"window must be >= 1, got {window}")
    if base.num_heads % kv_heads:
        raise ValueError(f"kv_heads ({kv_heads}) must divide num_heads ({base.num_heads})")
    return {
        "dense": base.with_(name=f"{base.name} dense"),
        "sliding": base.with_(name=f"{base.name} sliding {window}", causal=True, window=window),
        "gqa": base.with_(name=f"{base.name} GQA {kv_heads} kv heads", num_kv_heads=kv_heads),
    }


def scaling_table(
    variants: dict[str, Any] | None = None,
    seq_lens: tuple[int, ...] | list[int] = SEQ_LENS,
    *,
    backend: str = "tiled",
    batch_size: int = 1,
) -> list[ScalingRow]:
    """Cost of each variant at each length (rows ordered by variant, then length).

    Args:
        variants: name -> config/model/:class:`ArchSpec` (default :func:`tutorial_variants`).
        seq_lens: lengths.
        backend: backend costed for the FLOP columns (default ``"tiled"``: skips masked
            tiles, builds no score matrix).
        batch_size: sequences.
    """
    variants = tutorial_variants() if variants is None else variants
    rows: list[ScalingRow] = []
    for name, cfg in variants.items():
        spec = describe(cfg)
        for n in seq_lens:
            inf = estimate(spec, batch_size=batch_size, seq_len=n, backend=backend)
            mat = estimate(spec, batch_size=batch_size, seq_len=n, backend="reference")
            train = estimate(
                spec, batch_size=batch_size, seq_len=n, mode="training", backend=backend
            )
            kv = estimate(
                spec,
                batch_size=batch_size,
                seq_len=n,
                mode="decode",
                dtype="float16",
                cache="sliding" if spec.window else "contiguous",
            )
            attn = (
                inf.by_component["attention_scores"].matmul_flops
                + inf.by_component["attention_v"].matmul_flops
            ) / spec.num_layers
            rows.append(
                ScalingRow(
                    variant=name,
                    seq_len=n,
                    tutorial_n2d=n * n * spec.hidden_size,
                    attention_flops_per_layer=attn,
                    forward_flops=inf.flops,
                    score_matrix_bytes=mat.score_matrix_bytes,
                    inference_activations_materialised=mat.activation_bytes,
                    inference_activations_tiled=inf.activation_bytes,
                    training_activations_tiled=train.activation_variants["tiled"],
                    training_activations_tiled_checkpointed=train.activation_variants[
                        "tiled+checkpointing"
                    ],
                    kv_cache_bytes=kv.kv_cache_bytes,
                )
            )
    return rows
