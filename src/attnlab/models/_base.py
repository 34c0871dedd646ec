"""What every model config shares: dict/JSON round trips and token-id checks."""

from __future__ import annotations

import functools
import json
import math
import types
import typing
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Self

from attnlab._files import atomic_write_text
from attnlab.functional._checks import check_int, check_positive_int, check_real


def _kinds(annotation: Any) -> tuple[set[type], bool]:
    """The plain types of a field's annotation (``int | None`` -> ``({int}, True)``)."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    args = typing.get_args(annotation) if union else (annotation,)
    plain = {a for a in args if a in (int, float, bool, str)}
    return plain, type(None) in args


def _has_generic(annotation: Any) -> bool:
    """Whether a union annotation also admits a generic type (``tuple[int, ...]``)."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return False
    return any(typing.get_origin(a) is not None for a in typing.get_args(annotation))


def check_config_fields(config: Any) -> None:
    """The checks every config field gets from its type, before the config's own rules.

    An ``int`` field takes an int and never a bool (``version=True`` is not Mamba-1, a
    count is not ``True``); a ``float`` field a finite real number (infinite only where the
    default is); a ``bool`` field ``True`` or ``False``; a ``str`` field a string; every
    epsilon (a field named ``*eps``/``*epsilon``) is > 0; a tuple of floats (``dt_limit``)
    holds numbers, never NaN. Every config class gets them
    (:meth:`ConfigBase.__init_subclass__`), those added later too.

    Raises:
        TypeError: a value of the wrong type, naming the field.
        ValueError: NaN, an unexpected infinity, or an epsilon <= 0.
    """
    cls = type(config)
    hints = _hints(cls)
    for f in fields(config):
        value = getattr(config, f.name)
        name = f"{cls.__name__}.{f.name}"
        kinds, optional = _kinds(hints.get(f.name))
        if kinds and _has_generic(hints.get(f.name)) and not isinstance(value, tuple(kinds)):
            # e.g. ``int | tuple[int, ...]`` (Longformer's per-layer windows): the tuple
            # form is the config's own rules' business
            continue
        if (value is None and optional) or not kinds:
            _check_float_tuple(name, value, hints.get(f.name))
            continue
        if kinds == {bool}:
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be true or false, got {value!r}")
        elif kinds == {int}:
            check_int(name, value)
        elif kinds in ({float}, {int, float}):
            default = f.default if isinstance(f.default, int | float) else 0.0
            if isinstance(value, float) and math.isinf(value) and math.isinf(default):
                continue
            eps = f.name.endswith(("eps", "epsilon"))
            check_real(name, value, gt=0.0 if eps else None)
        elif kinds == {str} and not isinstance(value, str):
            raise TypeError(f"{name} must be a string, got {value!r} ({type(value).__name__})")


def _check_float_tuple(name: str, value: Any, annotation: Any) -> None:
    if typing.get_origin(annotation) is tuple and float in typing.get_args(annotation):
        ok = isinstance(value, tuple | list) and all(
            isinstance(v, int | float) and not isinstance(v, bool) and not math.isnan(v)
            for v in value
        )
        if not ok:
            raise ValueError(f"{name} must be a tuple of numbers (not NaN), got {value!r}")


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


class ConfigBase:
    """Mixin for the config dataclasses (:class:`EncoderConfig`, :class:`DecoderConfig`, ...).

    Every subclass's ``__post_init__`` runs :func:`check_config_fields` first, so each
    field is checked by its type before the config's own rules read it.
    """

    vocab_size: int

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__post_init__")
        if own is None or getattr(own, "_checks_fields", False):
            return

        @functools.wraps(own)
        def post_init(self: Any) -> None:
            check_config_fields(self)
            own(self)

        post_init._checks_fields = True  # type: ignore[attr-defined]
        cls.__post_init__ = post_init  # type: ignore[attr-defined]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """Build from a dict, rejecting unknown keys by name.

        Raises:
            TypeError: ``data`` is not a dict.
            ValueError: unknown keys, or values the config refuses.
        """
        if not isinstance(data, dict):
            raise TypeError(
                f"{cls.__name__}.from_dict needs a dict of fields, got {type(data).__name__}"
            )
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {unknown}; known: {sorted(known)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        """Write the config as JSON (read it back with ``from_dict(json.load(...))``)."""
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    def _check_positive_ints(self, *names: str) -> None:
        """Each named field is an int > 0 (the message names the field and the value)."""
        for name in names:
            check_positive_int(name, getattr(self, name))

    def _check_token_ids(self, *names: str) -> None:
        """Each named token id, when set, must be in ``[0, vocab_size)``."""
        for name in names:
            tok = getattr(self, name)
            if tok is not None:
                check_int(
                    f"{name} (vocab_size={self.vocab_size})",
                    tok,
                    min_value=0,
                    max_value=self.vocab_size - 1,
                )


def check_kv_heads(config: Any) -> None:
    """An attention config's ``num_key_value_heads`` (default: ``num_attention_heads``,
    MHA): an int > 0 that divides ``num_attention_heads`` (GQA's groups)."""
    heads = config.num_attention_heads
    if config.num_key_value_heads is None:
        config.num_key_value_heads = heads
    kv = config.num_key_value_heads
    check_positive_int("num_key_value_heads", kv)
    if heads % kv != 0:
        raise ValueError(
            f"num_attention_heads ({heads}) must be divisible by num_key_value_heads ({kv})"
        )


def check_model_type(config: Any) -> None:
    """``model_type`` (the transformers architecture a config names) is a str or None."""
    if config.model_type is not None and not isinstance(config.model_type, str):
        raise TypeError(f"model_type must be a str or None, got {config.model_type!r}")
