"""What every model config shares: dict/JSON round trips and token-id checks."""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Self

from attnlab._files import atomic_write_text
from attnlab.functional._checks import check_int


class ConfigBase:
    """Mixin for the config dataclasses (:class:`EncoderConfig`, :class:`DecoderConfig`, ...)."""

    vocab_size: int

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
