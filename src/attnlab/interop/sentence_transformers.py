"""Reading a sentence-transformers model folder: pooling, normalisation, maximum length, tokenizer.

A sentence-transformers folder (Reimers & Gurevych, 2019, "Sentence-BERT") is a
transformers folder plus a few JSON files that say how token states become one
vector per text:

* ``modules.json``: the module pipeline, e.g. ``Transformer -> Pooling -> Normalize``;
* ``1_Pooling/config.json`` (the Pooling module's ``path``): ``pooling_mode`` (a mode or
  a list of modes, concatenated in that order), or in older folders the flags
  ``pooling_mode_cls_token``, ``pooling_mode_max_tokens``, ``pooling_mode_mean_tokens``,
  ``pooling_mode_mean_sqrt_len_tokens`` (concatenated in that order);
* ``sentence_bert_config.json``: ``max_seq_length``, the truncation length (256 for
  all-MiniLM-L6-v2, whose model has 512 positions).

Only the standard library and, for the tokenizer, the ``tokenizers`` package are needed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from attnlab.models.embedding import POOLING_MODES, SentenceSettings

__all__ = ["attach_sentence_settings", "load_tokenizer", "read_sentence_settings"]

log = logging.getLogger(__name__)

_FLAG = {
    "cls": "pooling_mode_cls_token",
    "max": "pooling_mode_max_tokens",
    "mean": "pooling_mode_mean_tokens",
    "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
}
_NEW_NAMES = {"mean_sqrt_len_tokens": "mean_sqrt_len"}
_UNSUPPORTED = ("pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def read_sentence_settings(folder: str | Path) -> SentenceSettings:
    """Read pooling, normalisation and ``max_seq_length`` from a sentence-transformers folder.

    A folder without ``modules.json`` or without a Pooling module gets mean pooling
    without normalisation (what sentence-transformers itself does for a plain
    transformers folder), and ``source`` says so.

    Raises:
        ValueError: the folder does not exist, a JSON file is malformed, or the pooling
            config asks for a mode attnlab does not implement (weighted mean, last token).
    """
    from attnlab.interop.checkpoints import check_model_folder

    folder = check_model_folder(folder)
    max_len: int | None = None
    sbert = folder / "sentence_bert_config.json"
    if sbert.is_file():
        value = _read_json(sbert).get("max_seq_length")
        max_len = int(value) if value is not None else None
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return SentenceSettings(
            max_seq_length=max_len,
            source=f"no modules.json in {folder}: mean pooling, not normalised",
        )
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ValueError(
            f"{modules_file} must hold a list of modules, got {type(modules).__name__}"
        )
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    normalize = "Normalize" in kinds
    pooling_entry = next((m for m, k in zip(modules, kinds) if k == "Pooling"), None)
    config_file = (
        folder / str(pooling_entry.get("path", "")) / "config.json" if pooling_entry else None
    )
    if config_file is None or not config_file.is_file():
        return SentenceSettings(
            normalize=normalize,
            max_seq_length=max_len,
            source=f"no pooling config in {folder}: mean pooling",
        )
    cfg = _read_json(config_file)
    modes = _pooling_modes(cfg, config_file)
    if not modes:
        return SentenceSettings(
            normalize=normalize,
            max_seq_length=max_len,
            source=f"{config_file} sets no pooling mode: mean pooling",
        )
    return SentenceSettings(
        pooling=modes, normalize=normalize, max_seq_length=max_len, source=str(config_file)
    )


def _pooling_modes(cfg: dict[str, Any], path: Path) -> tuple[str, ...]:
    """Modes from either config format: ``pooling_mode`` (a name or a list, concatenated in
    that order) or the older ``pooling_mode_*_tokens`` flags (in :data:`POOLING_MODES` order)."""
    if "pooling_mode" in cfg:
        raw = cfg["pooling_mode"]
        names = [raw] if isinstance(raw, str) else list(raw)
        modes = tuple(_NEW_NAMES.get(str(n), str(n)) for n in names)
    else:
        unsupported = [k for k in _UNSUPPORTED if cfg.get(k)]
        if unsupported:
            raise ValueError(
                f"{path} asks for {unsupported}; attnlab implements the pooling modes "
                f"{POOLING_MODES}"
            )
        modes = tuple(m for m in POOLING_MODES if cfg.get(_FLAG[m]))
    bad = [m for m in modes if m not in POOLING_MODES]
    if bad:
        raise ValueError(
            f"{path} asks for pooling mode(s) {bad}; attnlab implements {POOLING_MODES}"
        )
    return modes


def load_tokenizer(folder: str | Path) -> Any:
    """The fast tokenizer of a model folder (``tokenizer.json``), without padding or truncation.

    Raises:
        ImportError: the ``tokenizers`` package is missing (the ``hf`` extra).
        ValueError: the folder has no ``tokenizer.json``.
    """
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(
            f"{folder} has no tokenizer.json; pass token ids, or a tokenizer with tokenizer="
        )
    try:
        from tokenizers import Tokenizer
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("tokenizing text needs tokenizers: pip install 'attnlab[hf]'") from e
    tok = Tokenizer.from_file(str(path))
    tok.no_padding()
    tok.no_truncation()
    return tok


def attach_sentence_settings(model: Any, folder: Path) -> None:
    """Give an encoder loaded from ``folder`` its sentence settings and tokenizer (when present).

    Called by :func:`attnlab.from_hf` on folders; ``model.encode`` then needs no arguments
    beyond the texts. A folder without ``tokenizer.json`` (or without the ``tokenizers``
    package) leaves ``model.tokenizer`` as None: ``encode`` then takes token ids, or a
    ``tokenizer=``.
    """
    model.sentence_settings = read_sentence_settings(folder)
    if (folder / "tokenizer.json").is_file():
        try:
            model.tokenizer = load_tokenizer(folder)
        except ImportError:
            log.info("tokenizers is not installed: %s loaded without its tokenizer", folder)
