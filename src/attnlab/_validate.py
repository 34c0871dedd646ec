"""Checks of the numbers a user gives attnlab: type, finiteness and range.

Torch-free, so that torch-free code (the cost model, the CLI's ``estimate``) uses the
same checks as the rest; :mod:`attnlab.functional._checks` re-exports them next to the
tensor checks, and is where library code imports them from. Every check raises
``ValueError`` (or ``TypeError`` for the wrong type) naming the argument, the value
given and what is accepted.
"""

from __future__ import annotations

import math
import numbers

__all__ = [
    "SEED_MAX",
    "check_int",
    "check_positive_int",
    "check_probability",
    "check_real",
    "check_seed",
    "derive_seed",
]

#: The largest seed attnlab accepts: seeds are ints in ``[0, 2**63 - 1]`` (a non-negative
#: int64, as the OpenAI API and numpy take them). ``torch.Generator.manual_seed`` accepts
#: up to ``2**64 - 1``, so a seed plus a small offset (choice ``i`` of a request seeded
#: ``seed + i``, a dropout stream ``seed + 1``) still fits; larger mixes go through
#: :func:`derive_seed`.
SEED_MAX = 2**63 - 1


def _got(value: object) -> str:
    """``value`` as a message shows it: its repr, with the type when the type is the fault."""
    if isinstance(value, bool | str | bytes) or not isinstance(value, numbers.Number):
        return f"{value!r} ({type(value).__name__})"
    return repr(value)


def check_int(
    name: str, value: object, *, min_value: int | None = None, max_value: int | None = None
) -> int:
    """Return ``value`` if it is an int (not a bool) in ``[min_value, max_value]``.

    Integral numpy scalars are accepted and returned as ``int``.

    Raises:
        ValueError: a non-integer (a float, a string, a bool) or a value out of range; the
            message names ``name``, the value and the accepted range.
    """
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    n = int(value) if ok else 0  # type: ignore[call-overload]
    if (
        not ok
        or (min_value is not None and n < min_value)
        or (max_value is not None and n > max_value)
    ):
        if min_value is not None and max_value is not None:
            accepted = f"an int in [{min_value}, {max_value}]"
        elif min_value == 1:
            accepted = "a positive int"
        elif min_value is not None:
            accepted = f"an int >= {min_value}"
        elif max_value is not None:
            accepted = f"an int <= {max_value}"
        else:
            accepted = "an int"
        raise ValueError(f"{name} must be {accepted}, got {_got(value)}")
    return n


def check_positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int > 0 (not a bool), else raise ``ValueError`` naming it."""
    return check_int(name, value, min_value=1)


def check_real(
    name: str,
    value: object,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
) -> float:
    """Return ``value`` as a float if it is a finite real number within the given bounds.

    ``gt``/``ge`` and ``lt``/``le`` are open and closed lower and upper bounds. NaN and
    infinity are always refused: every number a user gives attnlab is finite.

    Raises:
        TypeError: not a real number (a string, a bool, a tensor, None); the message names
            ``name``, the value and its type.
        ValueError: NaN, infinity or a value outside the bounds.
    """
    lo, hi = (gt if gt is not None else ge), (lt if lt is not None else le)
    if lo is not None and hi is not None:
        bounds = (
            f"in {'(' if gt is not None else '['}{lo:g}, {hi:g}{')' if lt is not None else ']'}"
        )
        accepted = f"a finite number {bounds}"
    elif lo is not None:
        bounds = f"{'>' if gt is not None else '>='} {lo:g}"
        accepted = f"a finite number {bounds}"
    elif hi is not None:
        bounds = f"{'<' if lt is not None else '<='} {hi:g}"
        accepted = f"a finite number {bounds}"
    else:
        bounds = accepted = "a finite number"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {accepted}, got {_got(value)}")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be {accepted}, got {value!r}")
    if (
        (gt is not None and not x > gt)
        or (ge is not None and not x >= ge)
        or (lt is not None and not x < lt)
        or (le is not None and not x <= le)
    ):
        raise ValueError(f"{name} must be {bounds}, got {value!r}")
    return x


def check_probability(name: str, value: object) -> float:
    """Return ``value`` if it is a number in [0, 1), else raise naming it.

    Raises:
        TypeError: not a real number.
        ValueError: NaN, or outside ``[0, 1)``.
    """
    return check_real(name, value, ge=0.0, lt=1.0)


def check_seed(name: str, value: object) -> int:
    """Return ``value`` if it is a seed: an int (not a bool) in ``[0, SEED_MAX]``.

    The one check of every seed a user gives attnlab (training and distillation configs,
    ``--seed`` of every command, a request's ``seed``), so that a seed out of range is
    refused where it enters instead of failing later in torch as "Overflow when unpacking
    long long".

    Raises:
        ValueError: not an int, a bool, negative, or above :data:`SEED_MAX`; the message
            names ``name``, the value and the accepted range.
    """
    return check_int(name, value, min_value=0, max_value=SEED_MAX)


def derive_seed(seed: int, *salts: int) -> int:
    """A seed for a sub-stream of ``seed`` (an epoch, a batch, a choice), in torch's range.

    Mixes ``seed`` with each salt as ``seed * 1_000_003 + salt`` and reduces the result
    modulo ``2**63``, so any seed that :func:`check_seed` accepts, and any salts, give a
    value ``torch.Generator.manual_seed`` takes. Deterministic: the same arguments give the
    same seed on every machine.
    """
    out = seed
    for salt in salts:
        out = (out * 1_000_003 + salt) % (SEED_MAX + 1)
    return out % (SEED_MAX + 1)
