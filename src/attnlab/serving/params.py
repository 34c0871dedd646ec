"""Per-request sampling parameters of the serving engine, validated where they enter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attnlab._validate import check_int, check_real, check_seed
from attnlab.generation.sampler import SamplingSettings

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


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ParamError(name, f"{name} must be true or false, got {value!r}")
    return value


def _token_ids(name: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, tuple | list):
        raise ParamError(name, f"{name} must be a list of token ids, got {value!r}")
    return tuple(_int(name, t, low=0) for t in value)


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    items: list[Any]
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, tuple | list):
        items = list(value)
    else:
        raise ParamError("logit_bias", f"logit_bias must map token ids to numbers, got {value!r}")
    out: dict[int, float] = {}
    for pair in items:
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise ParamError(
                "logit_bias", f"logit_bias entries must be (token, bias), got {pair!r}"
            )
        tok, bias = pair
        if isinstance(tok, str):  # JSON object keys are strings
            if not tok.strip().isdigit():
                raise ParamError(
                    "logit_bias", f"logit_bias keys must be token ids (integers), got {tok!r}"
                )
            tok = int(tok)
        out[_int("logit_bias", tok, low=0)] = _float("logit_bias", bias, low=-100.0, high=100.0)
    if len(out) > 1024:
        raise ParamError("logit_bias", f"logit_bias has {len(out)} entries; at most 1024")
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded: the OpenAI completion parameters and vLLM's extensions.

    Every field changes the output and is honoured (:mod:`attnlab.generation.sampler`
    applies them, batched over the step).

    Attributes:
        max_tokens: the most tokens to generate per choice.
        temperature: 0 is greedy decoding; otherwise the logits are divided by it. A
            temperature below :data:`~attnlab.generation.sampler.GREEDY_BELOW` (1e-5)
            is greedy too (its distribution is the argmax to float precision, and the
            division would overflow).
        top_p: nucleus sampling mass in ``(0, 1]`` (Holtzman et al., 2020).
        top_k: sample among the ``k`` most likely tokens (Fan et al., 2018), or None.
        min_p: drop tokens less likely than ``min_p`` times the top one (Nguyen et al., 2024).
        presence_penalty, frequency_penalty: in ``[-2, 2]``, over the generated tokens
            (the OpenAI definitions).
        repetition_penalty: in ``(0, 10]``, over prompt and generated tokens (Keskar et
            al., 2019; vLLM's extension); 1 is off.
        logit_bias: ``(token id, bias in [-100, 100])`` pairs added to the logits.
        seed: seeds choice ``i``'s generator with ``seed + i`` (reproducible samples),
            an int in ``[0, 2**63 - 1]``.
        stop: strings that end a choice; the text stops before the first one.
        stop_token_ids: token ids that end a choice (as EOS does).
        include_stop_str_in_output: keep the stop string (or stop token's text) in the text.
        n: choices per prompt; they share the prompt's KV blocks (copy-on-write).
        logprobs: return the log-probability of each chosen token and of the
            ``logprobs`` most likely ones (0..20), or None.
        ignore_eos: keep going after the end-of-sequence token.
        min_tokens: EOS and ``stop_token_ids`` cannot end a choice before this many
            tokens (and stop strings are not looked for).
        skip_special_tokens: leave special tokens out of the text.
        grammar: a compiled grammar (:class:`~attnlab.generation.grammar.Grammar`) the
            output must follow, or None.

    Raises:
        ParamError: a value out of range; its ``param`` names the field.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    n: int = 1
    logprobs: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    grammar: Any = field(default=None, compare=False)
    settings: SamplingSettings = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        _int("max_tokens", self.max_tokens, low=1)
        _float("temperature", self.temperature, low=0.0, high=2.0)
        _float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        if self.top_k is not None:
            _int("top_k", self.top_k, low=1)
        _float("min_p", self.min_p, low=0.0, high=1.0)
        _float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _float("repetition_penalty", self.repetition_penalty, low=0.0, high=10.0, low_open=True)
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.seed is not None:  # choice i is seeded seed + i <= 2**63 + 15: torch takes it
            try:
                check_seed("seed", self.seed)
            except ValueError as e:
                raise ParamError("seed", str(e)) from None
        object.__setattr__(
            self, "stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids)
        )
        _int("n", self.n, low=1, high=16)
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, low=0, high=20)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            _bool(name, getattr(self, name))
        _int("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
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
        settings = SamplingSettings(
            temperature=float(self.temperature),
            top_k=self.top_k or 0,
            top_p=float(self.top_p),
            min_p=float(self.min_p),
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(self.repetition_penalty),
            logit_bias=dict(self.logit_bias),
            logprobs=self.logprobs,
        )
        object.__setattr__(self, "settings", settings)

    @property
    def greedy(self) -> bool:
        """Whether the next token is the argmax (a temperature below 1e-5)."""
        return self.settings.greedy
