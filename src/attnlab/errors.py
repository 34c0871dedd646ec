"""The exception types attnlab raises beyond ``ValueError`` and ``TypeError``.

Both subclass ``ValueError``, so ``except ValueError`` keeps catching them; they exist so
that a caller (the ``attnlab`` command above all) can tell a damaged file or a model that
computed NaN from an argument that is out of range. See ``docs/errors.md``.
"""

from __future__ import annotations

__all__ = ["ModelFileError", "NonFiniteError"]


class ModelFileError(ValueError):
    """A model folder or one of its files is missing, damaged or malformed.

    The message names the file and what is wrong with it. The ``attnlab`` command exits
    with status 1 on it (the argument was well formed; the file it names is not).
    """


class NonFiniteError(ValueError):
    """A computation produced NaN or infinity where a decision needs finite numbers.

    Raised, for example, by decoding when the logits of a step hold NaN (the message
    names the step and the rows). The ``attnlab`` command exits with status 1 on it.
    """
