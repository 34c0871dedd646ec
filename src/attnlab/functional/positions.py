"""Positional encodings as pure functions: sinusoidal, RoPE (and its scalings), ALiBi, T5 buckets.

Shape notation: ``B`` batch, ``H`` heads, ``L`` query length, ``S`` key length,
``h_d`` head dim, ``P`` number of positions.

Every function here is the reference math, written for clarity; the modules in
:mod:`attnlab.modules.positions` own the buffers and call these; ALiBi and T5's bias
reach the scores as score modifiers (:mod:`attnlab.functional.score_mods`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor

from attnlab.functional._checks import check_int, check_positive_int, check_real

__all__ = [
    "ROPE_TYPES",
    "alibi_slopes",
    "apply_rope",
    "check_rope_parameters",
    "dynamic_ntk_base",
    "positions_from_mask",
    "rope_angles",
    "rope_inv_freq",
    "sinusoidal_table",
    "t5_relative_position_bucket",
]

RopeConvention = Literal["half", "interleaved"]
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


# --------------------------------------------------------------------------- sinusoidal


def sinusoidal_table(num_positions: int, dim: int, *, base: float = 10000.0) -> Tensor:
    """The original Transformer's fixed position encodings (Vaswani et al., 2017, sec. 3.5).

    ``PE[pos, 2i] = sin(pos / base^(2i/dim))`` and ``PE[pos, 2i+1] = cos(pos / base^(2i/dim))``.

    Args:
        num_positions: number of positions ``P``.
        dim: encoding width (must be even).
        base: the wavelength base (10000 in the paper).

    Returns:
        float32 ``[P, dim]``.
    """
    if check_positive_int("dim", dim) % 2:
        raise ValueError(f"sinusoidal encodings need a positive even dim, got {dim}")
    check_int("num_positions", num_positions, min_value=0)
    pos = torch.arange(num_positions, dtype=torch.float64)[:, None]  # [P, 1]
    two_i = torch.arange(0, dim, 2, dtype=torch.float64)  # [dim/2]
    angle = pos / base ** (two_i / dim)  # [P, dim/2]
    table = torch.empty(num_positions, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle)
    return table.float()


# --------------------------------------------------------------------------- RoPE


def check_rope_parameters(
    base: object, scaling: object, *, theta_name: str = "rope_theta"
) -> dict[str, Any]:
    """Check RoPE's base and scaling parameters; return the parameters as a dict.

    Pure Python (no tensor is touched): configs call it at construction and
    :func:`rope_inv_freq` on every use, so a bad value is refused where it enters.

    Args:
        base: ``rope_theta``: a finite number >= 1 (below 1 the frequencies exceed one
            radian per token; 0 gives none at all).
        scaling: ``None`` or a transformers-style ``rope_parameters`` mapping: ``factor``
            (finite, >= 1; required except for ``"yarn"``, which derives it),
            ``original_max_position_embeddings`` (positive int), ``low_freq_factor`` and
            ``high_freq_factor`` (``"llama3"``, finite, ``0 < low < high``),
            ``attention_factor``/``beta_fast``/``beta_slow`` (finite, > 0) and
            ``mscale``/``mscale_all_dim`` (finite) for ``"yarn"``.
        theta_name: the name ``base`` has where the user gave it, for messages.

    Raises:
        TypeError: ``scaling`` is not a mapping, or a field is not a number.
        ValueError: an unknown ``rope_type``, a missing field, or a value out of range.
    """
    check_real(theta_name, base, ge=1.0)
    if scaling is None:
        return {}
    if not isinstance(scaling, Mapping):
        raise TypeError(
            f"rope_scaling must be a dict such as {{'rope_type': 'linear', 'factor': 2.0}} or "
            f"None, got {scaling!r} ({type(scaling).__name__})"
        )
    params = dict(scaling)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"unknown RoPE scaling type {rope_type!r} in rope_scaling; accepted: {list(ROPE_TYPES)}"
        )
    if rope_type == "default":
        return params
    factor = params.get("factor")
    if factor is None and rope_type not in ("yarn", "longrope"):
        raise ValueError(
            f"rope_scaling of type {rope_type!r} needs a 'factor' (a number >= 1, the context "
            f"extension), got {params}"
        )
    if factor is not None:
        check_real(f"rope_scaling['factor'] ({rope_type})", factor, ge=1.0)
    if params.get("original_max_position_embeddings") is not None:
        check_int(
            "rope_scaling['original_max_position_embeddings']",
            params["original_max_position_embeddings"],
            min_value=1,
        )
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if key not in params:
                raise ValueError(f"llama3 rope_scaling needs {key!r}; got {params}")
            check_real(f"rope_scaling[{key!r}]", params[key], gt=0.0)
        if not params["high_freq_factor"] > params["low_freq_factor"]:
            raise ValueError(
                "llama3 rope_scaling needs high_freq_factor > low_freq_factor, got "
                f"{params['high_freq_factor']!r} and {params['low_freq_factor']!r}"
            )
    if rope_type == "longrope":
        _check_longrope(params)
    if rope_type == "yarn":
        for key in ("attention_factor", "beta_fast", "beta_slow"):
            if params.get(key) is not None:
                check_real(f"rope_scaling[{key!r}]", params[key], gt=0.0)
        for key in ("mscale", "mscale_all_dim"):
            if params.get(key) is not None:
                check_real(f"rope_scaling[{key!r}]", params[key])
    return params


def _check_longrope(params: Mapping[str, Any]) -> None:
    if params.get("original_max_position_embeddings") is None:
        raise ValueError(
            f"longrope rope_scaling needs 'original_max_position_embeddings'; got {dict(params)}"
        )
    for key in ("short_factor", "long_factor"):
        factors = params.get(key)
        if not isinstance(factors, list | tuple) or not factors:
            raise ValueError(
                f"longrope rope_scaling needs {key!r}, a list of one number per rotated "
                f"feature pair; got {factors!r}"
            )
        for i, f in enumerate(factors):
            check_real(f"rope_scaling[{key!r}][{i}]", f, gt=0.0)
    if len(params["short_factor"]) != len(params["long_factor"]):
        raise ValueError(
            f"longrope short_factor and long_factor differ in length: "
            f"{len(params['short_factor'])} and {len(params['long_factor'])}"
        )
    if params.get("attention_factor") is not None:
        check_real("rope_scaling['attention_factor']", params["attention_factor"], gt=0.0)


def _base_inv_freq(dim: int, base: float) -> Tensor:
    # The same float32 arithmetic as the reference implementations (Llama, transformers).
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim/2]


def rope_inv_freq(
    dim: int,
    *,
    base: float = 10000.0,
    scaling: Mapping[str, Any] | None = None,
    max_position_embeddings: int = 2048,
    seq_len: int | None = None,
) -> tuple[Tensor, float]:
    """Inverse frequencies of rotary embeddings (Su et al., 2021), with optional scaling.

    ``scaling`` follows transformers' ``rope_parameters`` (``rope_type`` and its fields):

    * ``"default"``: ``theta_i = base^(-2i/dim)``.
    * ``"linear"``: position interpolation (Chen et al., 2023): ``theta_i / factor``.
    * ``"dynamic"``: dynamic NTK: the base grows with the current length ``seq_len``
      beyond ``max_position_embeddings``:
      ``base * (factor * seq_len / max_pos - (factor - 1)) ** (dim / (dim - 2))``.
    * ``"yarn"``: YaRN (Peng et al., 2023): interpolation for low frequencies, extrapolation
      for high ones with a linear ramp between ``beta_slow`` and ``beta_fast`` rotations,
      and an attention factor ``0.1 ln(factor) + 1`` on cos/sin.
    * ``"llama3"``: Llama 3's frequency-dependent scaling (Meta, 2024): wavelengths longer
      than ``original_max / low_freq_factor`` are divided by ``factor``, shorter than
      ``original_max / high_freq_factor`` kept, smoothly blended between.
    * ``"longrope"``: LongRoPE (Ding et al., 2024; Phi-3): one rescale factor per
      frequency, ``theta_i / ext_i``, with ``ext = short_factor`` while ``seq_len`` stays
      within ``original_max_position_embeddings`` and ``long_factor`` beyond it; cos and
      sin are multiplied by ``sqrt(1 + ln(f) / ln(original_max))``, ``f = max_pos /
      original_max`` (or ``factor``).

    Args:
        dim: rotary width (the head dim, or the rotated part of it); even.
        base: ``rope_theta``.
        scaling: ``{"rope_type": ..., "factor": ..., ...}`` or None.
        max_position_embeddings: the model's maximum positions (dynamic, yarn and llama3
            fall back to it for ``original_max_position_embeddings``).
        seq_len: the current sequence length (used by ``"dynamic"`` only).

    Returns:
        ``(inv_freq float32 [dim/2], attention_factor)``; cos and sin are multiplied by
        ``attention_factor``.

    Raises:
        ValueError: an odd ``dim``, an unknown ``rope_type`` or missing/invalid fields.
    """
    if check_positive_int("rotary dim", dim) % 2:
        raise ValueError(f"rotary dim must be a positive even int, got {dim!r}")
    params = check_rope_parameters(base, scaling, theta_name="base")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return _base_inv_freq(dim, base), 1.0
    factor = params.get("factor")
    original = int(params.get("original_max_position_embeddings") or max_position_embeddings)
    if rope_type == "linear":
        assert factor is not None
        return _base_inv_freq(dim, base) / factor, 1.0
    if rope_type == "dynamic":
        assert factor is not None
        n = seq_len or max_position_embeddings
        return _base_inv_freq(
            dim, dynamic_ntk_base(dim, base, factor, max_position_embeddings, n)
        ), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(dim, base, params, original), 1.0
    if rope_type == "longrope":
        return _longrope_inv_freq(dim, base, params, original, max_position_embeddings, seq_len)
    return _yarn_inv_freq(dim, base, params, original, max_position_embeddings)


def dynamic_ntk_base(dim: int, base: float, factor: float, trained: int, seq_len: int) -> float:
    """The base dynamic NTK uses for a sequence of ``seq_len`` tokens (bloc97; transformers'
    ``_compute_dynamic_ntk_parameters``): ``base`` up to ``trained`` positions, then
    ``base * (factor * seq_len / trained - (factor - 1)) ** (dim / (dim - 2))``."""
    n = max(seq_len, trained)
    return float(base * ((factor * n / trained) - (factor - 1)) ** (dim / (dim - 2)))


def _llama3_inv_freq(dim: int, base: float, p: Mapping[str, Any], original: int) -> Tensor:
    try:
        factor, low, high = (
            float(p["factor"]),
            float(p["low_freq_factor"]),
            float(p["high_freq_factor"]),
        )
    except KeyError as e:
        raise ValueError(f"llama3 RoPE scaling needs {e.args[0]!r}; got {dict(p)}") from None
    inv_freq = _base_inv_freq(dim, base)
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _longrope_inv_freq(
    dim: int,
    base: float,
    p: Mapping[str, Any],
    original: int,
    max_pos: int,
    seq_len: int | None,
) -> tuple[Tensor, float]:
    factor = float(p.get("factor") or max_pos / original)
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    chosen = p["long_factor"] if seq_len and seq_len > original else p["short_factor"]
    if len(chosen) != dim // 2:
        raise ValueError(
            f"longrope factors have {len(chosen)} entries; the rotary dim {dim} needs {dim // 2}"
        )
    ext = torch.tensor(chosen, dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * base**shape), float(attention_factor)


def _yarn_inv_freq(
    dim: int, base: float, p: Mapping[str, Any], original: int, max_pos: int
) -> tuple[Tensor, float]:
    factor = p.get("factor")
    if factor is None:
        factor = max_pos / original
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength makes `rotations` turns over the original context.
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 = extrapolate (high frequency), 0 = interpolate
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def rope_angles(
    positions: Tensor, inv_freq: Tensor, *, attention_factor: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Cosines and sines of the rotation angles ``position * theta_i``.

    Args:
        positions: integer positions ``[..., S]``.
        inv_freq: ``[h_d/2]``.
        attention_factor: multiplies cos and sin (YaRN's temperature).

    Returns:
        ``(cos, sin)``, float32 ``[..., S, h_d/2]``.
    """
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(torch.float32)  # [.., S, h_d/2]
    return torch.cos(angles) * attention_factor, torch.sin(angles) * attention_factor


def apply_rope(
    x: Tensor, cos: Tensor, sin: Tensor, *, convention: RopeConvention = "half"
) -> Tensor:
    """Rotate pairs of features of ``x`` by the angles whose cos/sin are given (Su et al., 2021).

    Two conventions pair the features differently:

    * ``"half"`` (GPT-NeoX, Llama): feature ``i`` pairs with ``i + h_d/2``;
    * ``"interleaved"`` (the paper, GPT-J): feature ``2i`` pairs with ``2i + 1``.

    Each pair ``(a, b)`` becomes ``(a cos - b sin, a sin + b cos)``. Only the first
    ``2 * cos.shape[-1]`` features rotate (partial rotary); the rest pass through.

    Args:
        x: ``[B, H, S, h_d]``.
        cos: ``[B or 1, S, r/2]`` (broadcast over heads), as from :func:`rope_angles`.
        sin: like ``cos``.
        convention: ``"half"`` or ``"interleaved"``.

    Returns:
        ``x`` rotated, same shape and dtype.
    """
    if convention not in ("half", "interleaved"):
        raise ValueError(f"RoPE convention must be 'half' or 'interleaved', got {convention!r}")
    r = 2 * cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    c = cos.unsqueeze(-3).to(x.dtype)  # [B, 1, S, r/2]
    s = sin.unsqueeze(-3).to(x.dtype)
    if convention == "half":
        a, b = rot[..., : r // 2], rot[..., r // 2 :]
        out = torch.cat((a * c - b * s, a * s + b * c), dim=-1)  # [B, H, S, r]
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)  # [B, H, S, r]
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


# --------------------------------------------------------------------------- ALiBi


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi head slopes (Press et al., 2022, sec. 3).

    For ``n`` a power of two the slopes are the geometric sequence ``2^(-8/n), 2^(-16/n),
    ..., 2^(-8)``. Otherwise, with ``m`` the largest power of two below ``n``, the slopes
    are those of ``m`` heads followed by the first ``n - m`` odd-indexed slopes of ``2m``
    heads (every other one), as the paper's reference code does.

    Returns:
        float32 ``[num_heads]``.
    """
    check_positive_int("num_heads", num_heads)

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    m = 2 ** math.floor(math.log2(num_heads))
    slopes = geometric(m)
    if m < num_heads:
        slopes += geometric(2 * m)[0::2][: num_heads - m]
    return torch.tensor(slopes, dtype=torch.float32)


# --------------------------------------------------------------------------- T5


def t5_relative_position_bucket(
    relative_position: Tensor,
    *,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> Tensor:
    """T5's bucket of a relative position ``key - query`` (Raffel et al., 2020, sec. 2.1).

    Half of the buckets (or all, when not bidirectional) hold exact small distances;
    the rest cover distances up to ``max_distance`` logarithmically; farther distances
    share the last bucket. Bidirectional attention uses separate buckets for keys after
    the query; causal attention maps keys after the query to bucket 0.

    Args:
        relative_position: integer ``key_pos - query_pos``, any shape.
        bidirectional: encoder (True) or decoder self-attention (False).
        num_buckets: number of buckets.
        max_distance: distance from which all positions share a bucket.

    Returns:
        Long tensor of bucket indices in ``[0, num_buckets)``, same shape.
    """
    buckets = torch.zeros_like(relative_position, dtype=torch.long)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = -torch.minimum(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    large = max_exact + (
        torch.log(distance.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    large = torch.minimum(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(is_small, distance.long(), large)


# --------------------------------------------------------------------------- padding


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids of a left-padded batch: ``cumsum(mask) - 1``, padding set to 1.

    The convention of transformers' ``generate`` (and so of its checkpoints' users):
    the first real token of each row is position 0 whatever its padding.

    Args:
        attention_mask: ``[B, T]`` of 1 (token) / 0 (padding).

    Returns:
        Long ``[B, T]``.
    """
    m = attention_mask.long()
    return (m.cumsum(-1) - 1).masked_fill(m == 0, 1)
