"""Per-request sampling parameters of the serving engine, validated where they enter."""

from __future__ import annotations

from dataclasses import dataclass, field

from attnlab._validate import check_int, check_real

__all__ = ["ParamError", "SamplingParams"]


class ParamError(ValueError):
    """A bad request parameter; ``param`` names the field (the OpenAI error's ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _int(name: str, value: object, *, low: int, high: int | None = None) -> int:
    try:
        return check_int(name, value, min_value=low, max_value=high)
    except ValueError as e:
        raise ParamError(name, str(e)) from None


def _float(name: str, value: object, *, low: float, high: float, low_open: bool = False) -> float:
    try:
        if low_open:
            return check_real(name, value, gt=low, le=high)
        return check_real(name, value, ge=low, le=high)
    except (ValueError, TypeError) as e:
        raise ParamError(name, str(e)) from None


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded (the OpenAI completion parameters, plus ``top_k``).

    Attributes:
        max_tokens: the most tokens to generate per choice.
        temperature: 0 is greedy decoding; otherwise the logits are divided by it.
        top_p: nucleus sampling mass in ``(0, 1]`` (Holtzman et al., 2020).
        top_k: sample among the ``k`` most likely tokens (Fan et al., 2018), or None.
        seed: seeds choice ``i``'s generator with ``seed + i`` (reproducible samples).
        stop: strings that end a choice; the text stops before the first one.
        n: choices per prompt; they share the prompt's KV blocks (copy-on-write).
        logprobs: return the log-probability of each chosen token and of the
            ``logprobs`` most likely ones (0..20), or None.
        ignore_eos: keep going after the end-of-sequence token.

    Raises:
        ParamError: a value out of range; its ``param`` names the field.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    n: int = 1
    logprobs: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _int("max_tokens", self.max_tokens, low=1)
        _float("temperature", self.temperature, low=0.0, high=2.0)
        _float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        if self.top_k is not None:
            _int("top_k", self.top_k, low=1)
        if self.seed is not None:
            _int("seed", self.seed, low=0)
        _int("n", self.n, low=1, high=16)
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, low=0, high=20)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, tuple | list) or not all(
            isinstance(s, str) and s for s in self.stop
        ):
            raise ParamError(
                "stop", f"stop must be a non-empty string or a list of them, got {self.stop!r}"
            )
        if len(self.stop) > 4:
            raise ParamError("stop", f"at most 4 stop strings, got {len(self.stop)}")
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        """Whether the next token is the argmax (temperature 0)."""
        return self.temperature == 0.0
