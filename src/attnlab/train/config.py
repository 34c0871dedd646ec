"""The training run's configuration: one TOML/JSON file, sections as dataclasses.

```toml
steps = 200
batch_size = 16            # sequences per optimizer step, over all processes
micro_batch_size = 8       # per process and forward; accumulation makes up the rest
dtype = "bfloat16"         # autocast on the CPU (float32 master weights)

[model]                    # kind + architecture + any field of its config class
kind = "decoder"           # decoder | encoder (masked LM) | seq2seq
arch = "llama"             # decoder: llama, gpt2, bloom, mistral; seq2seq: t5, transformer
hidden_size = 128

[data]
source = "stdlib"          # stdlib | files | synthetic
tokenizer = "bytes"        # bytes | bpe
seq_len = 256

[optim]
lr = 1e-3
warmup_steps = 20
```

Overrides use dotted keys (``--set optim.lr=3e-4``, ``--set steps=50``); values are read
as TOML literals, so ``3e-4``, ``true`` and ``"text"`` mean what they say, and a bare
word is taken as a string.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Self

from attnlab._files import atomic_write_text
from attnlab._validate import check_seed
from attnlab.functional._checks import check_int, check_positive_int, check_probability, check_real

__all__ = [
    "DataConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "apply_overrides",
    "load_config",
]

MODEL_KINDS = ("decoder", "encoder", "seq2seq", "custom")
SOURCES = ("stdlib", "files", "synthetic")
TOKENIZERS = ("bytes", "bpe")
TASKS = ("copy", "associative_recall", "selective_copy", "induction")
DTYPES = ("float32", "bfloat16")
PARALLEL = ("auto", "ddp", "fsdp")


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _non_negative_int(name: str, value: object) -> None:
    check_int(name, value, min_value=0)


def _positive_float(name: str, value: object) -> None:
    check_real(name, value, gt=0.0)


class _Section:
    """``from_dict`` that names unknown keys, shared by the sections."""

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> Self:
        if not isinstance(data, dict):
            raise TypeError(f"[{where}] must be a table, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown keys in [{where}]: {unknown}; known: {sorted(known)}")
        return cls(**data)


@dataclass
class DataConfig(_Section):
    """Where the training text comes from and how it is cut.

    Attributes:
        source: ``"stdlib"`` (the Python standard library's ``.py`` files), ``"files"``
            (``paths``: files or folders of text) or ``"synthetic"`` (``task``).
        paths: files or folders for ``source="files"``.
        tokenizer: ``"bytes"`` (UTF-8 bytes, vocabulary 256) or ``"bpe"`` (a byte-level
            BPE trained with ``tokenizers`` on the training split).
        bpe_vocab_size: the BPE's vocabulary.
        seq_len: tokens per packed row.
        document_mask: attend only within each document of a packed row (the
            ``document`` pattern, positions restarting per document).
        heldout_percent: share of the files kept out of training (chosen by a hash of
            their path, so the split is the same on every machine).
        max_train_bytes: read at most this many bytes of training text (0 = all).
        max_eval_bytes: at most this many bytes of held-out text.
        task: the synthetic task: ``"copy"``, ``"associative_recall"``,
            ``"selective_copy"`` or ``"induction"``.
        num_symbols: the synthetic tasks' alphabet.
        task_length: the synthetic tasks' size (sequence to copy, key-value pairs,
            context length).
        mlm_probability: share of tokens masked for the encoder's masked-LM objective.
    """

    source: str = "stdlib"
    paths: list[str] = field(default_factory=list)
    tokenizer: str = "bytes"
    bpe_vocab_size: int = 4096
    seq_len: int = 256
    document_mask: bool = True
    heldout_percent: int = 5
    max_train_bytes: int = 8_000_000
    max_eval_bytes: int = 400_000
    task: str = "copy"
    num_symbols: int = 16
    task_length: int = 16
    mlm_probability: float = 0.15

    def __post_init__(self) -> None:
        _choice("data.source", self.source, SOURCES)
        _choice("data.tokenizer", self.tokenizer, TOKENIZERS)
        _choice("data.task", self.task, TASKS)
        for name in ("bpe_vocab_size", "seq_len", "num_symbols", "task_length"):
            check_positive_int(f"data.{name}", getattr(self, name))
        for name in ("max_train_bytes", "max_eval_bytes"):
            _non_negative_int(f"data.{name}", getattr(self, name))
        check_int("data.heldout_percent", self.heldout_percent, min_value=1, max_value=99)
        check_probability("data.mlm_probability", self.mlm_probability)
        if self.source == "files" and not self.paths:
            raise ValueError("data.source = 'files' needs data.paths (files or folders)")
        if not isinstance(self.paths, list) or not all(isinstance(p, str) for p in self.paths):
            raise TypeError(f"data.paths must be a list of strings, got {self.paths!r}")


@dataclass
class OptimConfig(_Section):
    """AdamW (Loshchilov & Hutter, 2019) with linear warmup and cosine decay.

    Attributes:
        lr: peak learning rate.
        min_lr_ratio: the cosine ends at ``lr * min_lr_ratio``.
        warmup_steps: linear warmup from 0.
        weight_decay: decoupled weight decay (not applied to biases, norms, embeddings' rows
            of 1-d parameters).
        beta1, beta2, eps: AdamW's.
        grad_clip: clip the global gradient norm to this (0 = off).
    """

    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        _positive_float("optim.lr", self.lr)
        _positive_float("optim.eps", self.eps)
        for name in ("min_lr_ratio", "beta1", "beta2"):
            check_real(f"optim.{name}", getattr(self, name), ge=0.0, le=1.0)
        _non_negative_int("optim.warmup_steps", self.warmup_steps)
        for name in ("weight_decay", "grad_clip"):
            check_real(f"optim.{name}", getattr(self, name), ge=0.0)


@dataclass
class ParallelConfig(_Section):
    """How several processes share the work (only read under ``torchrun``).

    Attributes:
        strategy: ``"ddp"`` (DistributedDataParallel), ``"fsdp"`` (FSDP2's
            ``fully_shard``, each layer and then the root) or ``"auto"`` (ddp).
        backend: process-group backend: ``"gloo"`` (CPU), ``"nccl"`` (GPUs) or
            ``"auto"`` (nccl with CUDA, else gloo).
        param_dtype: FSDP2 mixed precision: parameters' dtype in the forward/backward
            (``"float32"`` or ``"bfloat16"``).
        reduce_dtype: FSDP2 mixed precision: gradient reduction dtype.
    """

    strategy: str = "auto"
    backend: str = "auto"
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"

    def __post_init__(self) -> None:
        _choice("parallel.strategy", self.strategy, PARALLEL)
        _choice("parallel.backend", self.backend, ("auto", "gloo", "nccl"))
        _choice("parallel.param_dtype", self.param_dtype, DTYPES)
        _choice("parallel.reduce_dtype", self.reduce_dtype, DTYPES)


@dataclass
class TrainConfig:
    """A training run.

    Attributes:
        model: ``kind`` (decoder/encoder/seq2seq), ``arch`` (the config preset) and any
            field of that config class; ``vocab_size`` comes from the data.
        data: :class:`DataConfig`.
        optim: :class:`OptimConfig`.
        parallel: :class:`ParallelConfig`.
        steps: optimizer steps.
        batch_size: sequences per optimizer step over all processes.
        micro_batch_size: sequences per forward on one process (0 = all of its share).
        dtype: ``"float32"`` or ``"bfloat16"`` (autocast; the weights stay float32).
        compile: ``torch.compile`` the forward and backward of a micro step.
        seed: seeds the weights, the data order and dropout.
        eval_every: evaluate on the held-out split every this many steps (0 = at the end).
        eval_batches: held-out batches per evaluation.
        log_every: write a metrics line every this many steps.
        save_every: save a checkpoint every this many steps (0 = at the end only).
        out_dir: where metrics, the loss curve, checkpoints and the final model go.
        progress: show a progress bar (tqdm) on the terminal.
        device: ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``
            for a single process; under torchrun each process takes its ``LOCAL_RANK``'s GPU
            with NCCL, or the CPU with gloo.
        export: at the end, save the model (and tokenizer) to ``out_dir/model``, a folder
            ``attnlab generate --model`` loads.
    """

    model: dict[str, Any] = field(default_factory=lambda: {"kind": "decoder", "arch": "llama"})
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    steps: int = 100
    batch_size: int = 8
    micro_batch_size: int = 0
    dtype: str = "float32"
    compile: bool = False
    seed: int = 0
    eval_every: int = 0
    eval_batches: int = 4
    log_every: int = 1
    save_every: int = 0
    out_dir: str = "runs/train"
    progress: bool = True
    device: str = "auto"
    export: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.model, dict):
            raise TypeError(f"[model] must be a table, got {type(self.model).__name__}")
        kind = self.model.get("kind", "decoder")
        _choice("model.kind", kind, MODEL_KINDS)
        for name in ("steps", "batch_size", "eval_batches", "log_every"):
            check_positive_int(name, getattr(self, name))
        for name in ("micro_batch_size", "eval_every", "save_every"):
            _non_negative_int(name, getattr(self, name))
        check_seed("seed", self.seed)
        if self.micro_batch_size and self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of micro_batch_size "
                f"({self.micro_batch_size})"
            )
        _choice("dtype", self.dtype, DTYPES)
        for name in ("compile", "progress", "export"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.device, str) or not (
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")
        ):
            raise ValueError(
                f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}"
            )
        if not isinstance(self.out_dir, str) or not self.out_dir:
            raise ValueError(f"out_dir must be a non-empty path, got {self.out_dir!r}")

    @property
    def model_kind(self) -> str:
        return str(self.model.get("kind", "decoder"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from nested dicts, naming any unknown key."""
        if not isinstance(data, dict):
            raise TypeError(f"a training config must be a table, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown training config keys {unknown}; known: {sorted(known)}")
        kw = dict(data)
        sections: dict[str, type[_Section]] = {
            "data": DataConfig,
            "optim": OptimConfig,
            "parallel": ParallelConfig,
        }
        for name, section in sections.items():
            if name in kw:
                kw[name] = section.from_dict(kw[name], name)
        if "model" in kw:
            kw["model"] = dict(kw["model"])
        return cls(**kw)

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word: a string


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``["optim.lr=3e-4", "steps=10"]`` applied to a nested dict (a new one is returned).

    Raises:
        ValueError: an override without ``=`` or with an empty key.
    """
    out = json.loads(json.dumps(data))
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects key=value (e.g. optim.lr=3e-4), got {item!r}")
        parts = key.strip().split(".")
        node = out
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"--set {key}: {part!r} is not a section")
            node = child
        node[parts[-1]] = _parse_value(value.strip())
    return out


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a TOML or JSON file (or start from the defaults), apply ``overrides``, validate.

    Raises:
        ValueError: a missing or unreadable file, an unknown extension, unknown keys,
            invalid values.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {str(p)!r} does not exist")
        try:
            if p.suffix == ".toml":
                data = tomllib.loads(p.read_text())
            elif p.suffix == ".json":
                data = json.loads(p.read_text())
            else:
                raise ValueError(
                    f"config file {str(p)!r}: expected a .toml or .json file, got {p.suffix!r}"
                )
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"config file {str(p)!r} is not valid: {e}") from e
    return TrainConfig.from_dict(apply_overrides(data, overrides or []))
