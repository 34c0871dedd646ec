"""Named training runs (``attnlab train --preset NAME``).

* ``stdlib-bytes``: a byte-level Llama-style decoder (4 layers, width 192, 1.8 M
  parameters, 500 steps of 16 x 256 bytes) on the Python standard library's source, about
  10 minutes on two idle CPU cores, float32 (this project's AVX2 CPUs run bfloat16 matmuls
  about 30x slower than float32). The folder it saves is what ``attnlab generate --model``
  loads.
* ``stdlib-bpe``: the same decoder on a byte-level BPE (vocabulary 4096) trained on the
  training split.
* ``copy``, ``associative-recall``, ``selective-copy``, ``induction``: the synthetic
  tasks on a 2-layer decoder, a minute or two each.
* ``tiny``: a few steps of a tiny model on a slice of the stdlib (tests, smoke runs).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DESCRIPTIONS", "PRESETS", "preset"]

_DECODER = {
    "kind": "decoder",
    "arch": "llama",
    "hidden_size": 192,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "intermediate_size": 512,
    "tie_word_embeddings": True,
}


def _task(task: str, length: int) -> dict[str, Any]:
    return {
        "model": {
            "kind": "decoder",
            "arch": "llama",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 192,
        },
        "data": {"source": "synthetic", "task": task, "task_length": length, "num_symbols": 16},
        "steps": 600,
        "batch_size": 32,
        "optim": {"lr": 3e-3, "warmup_steps": 30, "weight_decay": 0.0},
        "eval_every": 100,
        "out_dir": f"runs/{task}",
    }


PRESETS: dict[str, dict[str, Any]] = {
    "stdlib-bytes": {
        "model": _DECODER,
        "data": {"source": "stdlib", "tokenizer": "bytes", "seq_len": 256},
        "steps": 500,
        "batch_size": 16,
        "optim": {"lr": 2e-3, "warmup_steps": 40},
        "eval_every": 100,
        "eval_batches": 16,
        "save_every": 200,
        "out_dir": "runs/stdlib-bytes",
    },
    "stdlib-bpe": {
        "model": _DECODER,
        "data": {"source": "stdlib", "tokenizer": "bpe", "bpe_vocab_size": 4096, "seq_len": 128},
        "steps": 500,
        "batch_size": 16,
        "optim": {"lr": 2e-3, "warmup_steps": 40},
        "eval_every": 100,
        "eval_batches": 16,
        "save_every": 200,
        "out_dir": "runs/stdlib-bpe",
    },
    "copy": _task("copy", 16),
    "associative-recall": _task("associative_recall", 8),
    "selective-copy": _task("selective_copy", 8),
    "induction": _task("induction", 32),
    "tiny": {
        "model": {
            "kind": "decoder",
            "arch": "llama",
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 64,
        },
        "data": {
            "source": "stdlib",
            "seq_len": 64,
            "max_train_bytes": 100_000,
            "max_eval_bytes": 20_000,
        },
        "steps": 4,
        "batch_size": 4,
        "eval_batches": 2,
        "out_dir": "runs/tiny",
    },
}


#: One line per preset, shown by ``attnlab train --list-presets``.
DESCRIPTIONS: dict[str, str] = {
    "stdlib-bytes": "byte-level Llama-style decoder (4 layers, width 192) on the Python "
    "standard library, 500 steps, about 10 minutes on two CPU cores",
    "stdlib-bpe": "the stdlib-bytes decoder on a byte-level BPE (vocabulary 4096) trained on the "
    "training split",
    "copy": "2-layer decoder on the synthetic copy task (length 16), 600 steps",
    "associative-recall": "2-layer decoder on synthetic associative recall (length 8), 600 steps",
    "selective-copy": "2-layer decoder on synthetic selective copying (length 8), 600 steps",
    "induction": "2-layer decoder on the synthetic induction task (length 32), 600 steps",
    "tiny": "a few steps of a tiny decoder on a slice of the stdlib (tests, smoke runs)",
}


def preset(name: str) -> dict[str, Any]:
    """The named preset's config dict (a copy).

    Raises:
        ValueError: an unknown name (the known ones are listed).
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    import copy

    return copy.deepcopy(PRESETS[name])
