"""What every model config shares: dict/JSON round trips and token-id checks."""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Self


class ConfigBase:
    """Mixin for the config dataclasses (:class:`EncoderConfig`, :class:`DecoderConfig`, ...)."""

    vocab_size: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """Build from a dict, rejecting unknown keys by name."""
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {unknown}; known: {sorted(known)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        """Write the config as JSON (read it back with ``from_dict(json.load(...))``)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def _check_token_ids(self, *names: str) -> None:
        """Each named token id, when set, must be in ``[0, vocab_size)``."""
        for name in names:
            tok = getattr(self, name)
            if tok is not None and not 0 <= tok < self.vocab_size:
                raise ValueError(f"{name} ({tok}) must be in [0, vocab_size={self.vocab_size})")
