"""Fine-tune a pretrained model on chat data with LoRA or QLoRA, through the one trainer.

``finetune(FinetuneConfig(model=..., data=...))`` loads the model (a transformers folder
or a ``.gguf`` file) and its tokenizer, optionally holds the frozen base in NF4 (QLoRA,
Dettmers et al., 2023), wraps the target layers in LoRA adapters (Hu et al., 2021),
renders the JSONL rows with the chat template, lets the cost model choose packed or
padded batches, and runs :class:`~attnlab.train.trainer.Trainer` (checkpoints, resume,
bfloat16, gradient checkpointing, metrics and the loss curve are the trainer's). At the
end it writes the adapter in peft's format (``adapter/``), the merged model as a
transformers folder (``merged/``) and, where the GGUF writer exists, ``merged.gguf``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnlab._files import atomic_folder, atomic_write_text
from attnlab._validate import check_int, check_positive_int, check_real
from attnlab.modules.lora import apply_lora, is_linear_like, lora_modules, merge_and_unload
from attnlab.modules.nf4 import quantize_linears
from attnlab.train.allocator import hold_mmap_threshold
from attnlab.train.chat import encode_chat, read_chat_jsonl
from attnlab.train.sft import LAYOUTS, SFTData, choose_layout

__all__ = ["FinetuneConfig", "finetune", "load_pretrained"]

log = logging.getLogger(__name__)

DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


@dataclass
class FinetuneConfig:
    """A fine-tuning run.

    Attributes:
        model: a transformers model folder (config.json, safetensors, tokenizer files)
            or a ``.gguf`` file.
        data: a JSONL file of ``{"messages": [...]}`` or ``{"prompt", "completion"}`` rows.
        out_dir: where metrics, the loss curve, checkpoints and the exports go.
        eval_data: a held-out JSONL file (default: ``heldout_percent`` of ``data``).
        heldout_percent: share of ``data`` held out, chosen by a hash of each row.
        lora_rank, lora_alpha, lora_dropout, rslora: the adapters (α/r scaling, or α/√r).
        targets: comma-separated module names, attnlab's or transformers', or
            ``"all-linear"``.
        qlora: hold the frozen base's linear layers in NF4.
        max_len: tokens per packed row (and the longest example kept whole).
        layout: ``"auto"`` (the cost model chooses), ``"packed"`` or ``"padded"``.
        steps, batch_size, micro_batch_size, lr, warmup_steps, weight_decay, dtype,
        gradient_checkpointing, seed, eval_every, save_every, progress: as in
            :class:`~attnlab.train.config.TrainConfig`.
    """

    model: str
    data: str
    out_dir: str = "runs/finetune"
    eval_data: str | None = None
    heldout_percent: int = 10
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.05
    rslora: bool = False
    targets: str = DEFAULT_TARGETS
    qlora: bool = False
    max_len: int = 512
    layout: str = "auto"
    steps: int = 100
    batch_size: int = 8
    micro_batch_size: int = 0
    lr: float = 2e-4
    warmup_steps: int = 10
    weight_decay: float = 0.0
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    seed: int = 0
    eval_every: int = 0
    eval_batches: int = 1000
    save_every: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        check_positive_int("lora_rank", self.lora_rank)
        check_real("lora_alpha", self.lora_alpha, gt=0.0)
        check_real("lora_dropout", self.lora_dropout, ge=0.0, lt=1.0)
        check_int("max_len", self.max_len, min_value=2)
        check_int("heldout_percent", self.heldout_percent, min_value=1, max_value=99)
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {self.layout!r}")


def _is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def load_pretrained(
    path: str | Path, *, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, Any]:
    """``(attnlab model, transformers tokenizer)`` of a model folder or a ``.gguf`` file.

    A ``.gguf`` file is dequantized to ``dtype`` (QLoRA loads in bfloat16: half the
    memory on the way to NF4); a folder keeps its weights' dtype.

    Raises:
        ValueError: a path that is neither a folder nor a ``.gguf`` file.
    """
    import transformers

    import attnlab

    p = Path(path)
    if p.is_dir():
        return attnlab.from_hf(p), transformers.AutoTokenizer.from_pretrained(str(p))
    if not p.exists():  # the same error as every command's missing model (exit status 1)
        from attnlab.interop.checkpoints import check_model_folder

        check_model_folder(p)
    if not _is_gguf(p):
        raise ValueError(f"model {str(p)!r} is neither a transformers folder nor a .gguf file")
    model = attnlab.from_gguf(p, dtype=dtype)
    if getattr(model, "tokenizer", None) is None:
        raise ValueError(f"{p} holds no tokenizer, which chat fine-tuning needs")
    return model, model.tokenizer


def _split(rows: list[Any], percent: int) -> tuple[list[Any], list[Any]]:
    """Held-out rows by a hash of their content: the same split on every machine."""
    train: list[Any] = []
    held: list[Any] = []
    for r in rows:
        h = int(hashlib.sha1(json.dumps(r, sort_keys=True).encode()).hexdigest()[:8], 16)
        (held if h % 100 < percent else train).append(r)
    return train, held


def _quantizable(model: nn.Module) -> list[str]:
    """The base's linear layers (not the output head), for NF4."""
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and n.rpartition(".")[2] not in ("lm_head",)
    ]


def _peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def prepare_model(model: nn.Module, config: FinetuneConfig) -> nn.Module:
    """Float32 master weights, NF4 base (QLoRA), adapters on the targets, frozen rest."""
    from attnlab.interop.peft import resolve_targets

    units = resolve_targets(model, config.targets)  # by the float layers' names
    if config.qlora:
        quantize_linears(model, _quantizable(model))  # NF4 from the weights as loaded
    model = model.float()  # master weights (and what stays float in QLoRA) in float32
    apply_lora(
        model,
        units,
        rank=config.lora_rank,
        alpha=config.lora_alpha,
        dropout=config.lora_dropout,
        use_rslora=config.rslora,
    )
    if config.gradient_checkpointing:
        cfg = getattr(model, "config", None)
        if cfg is None or not hasattr(cfg, "gradient_checkpointing"):
            raise ValueError(f"{type(model).__name__} has no gradient checkpointing switch")
        cfg.gradient_checkpointing = True
    return model.train()


def _counts(model: nn.Module) -> dict[str, int]:
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
            trainable += p.numel() if p.requires_grad else 0
    quantized = sum(  # NF4: two weights per byte of codes
        2 * int(getattr(m, "codes").numel())  # noqa: B009
        for m in model.modules()
        if is_linear_like(m) and hasattr(m, "codes")
    )
    return {"trainable": trainable, "total": total + quantized}


def finetune(config: FinetuneConfig, *, resume: str | None = None) -> dict[str, Any]:
    """Run ``config``; return its summary (also written to ``out_dir/finetune.json``).

    Raises:
        ValueError: bad data, targets, model path or settings (named).
    """
    from attnlab.train.config import OptimConfig, TrainConfig
    from attnlab.train.trainer import Trainer

    t0 = time.perf_counter()
    mmap_held = hold_mmap_threshold()  # freed activations go back to the system (see allocator)
    model, tok = load_pretrained(
        config.model, dtype=torch.bfloat16 if config.qlora else torch.float32
    )
    rows = read_chat_jsonl(config.data)
    if config.eval_data:
        train_rows, held_rows = rows, read_chat_jsonl(config.eval_data)
    else:
        train_rows, held_rows = _split(rows, config.heldout_percent)
    train = [encode_chat(tok, m) for m in train_rows]
    held = [encode_chat(tok, m) for m in held_rows]
    torch.manual_seed(config.seed)  # the adapters' initialisation is the seed's
    model = prepare_model(model, config)
    lengths = [min(len(e), config.max_len) for e in train]
    choice = choose_layout(
        model, lengths, max_len=config.max_len, batch_size=config.batch_size, layout=config.layout
    )
    log.info("layout %s", choice.reason)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    vocab = int(getattr(model, "config").vocab_size)  # noqa: B009
    data = SFTData(
        train, held, max_len=config.max_len, layout=choice.layout, batch_size=config.batch_size,
        pad_token_id=int(pad or 0), vocab_size=vocab, seed=config.seed, tokenizer=tok,
    )  # fmt: skip
    tc = TrainConfig(
        model={"kind": "custom"},
        optim=OptimConfig(
            lr=config.lr, warmup_steps=config.warmup_steps, weight_decay=config.weight_decay
        ),
        steps=config.steps,
        batch_size=config.batch_size,
        micro_batch_size=config.micro_batch_size,
        dtype=config.dtype,
        seed=config.seed,
        eval_every=config.eval_every,
        eval_batches=config.eval_batches,
        save_every=config.save_every,
        out_dir=config.out_dir,
        progress=config.progress,
        export=False,
    )
    with Trainer(tc, data=data, model=model) as trainer:  # type: ignore[arg-type]
        before = trainer.evaluate() if resume is None else {}
        if before:
            trainer._log({"step": 0, **before})
        t_train = time.perf_counter()
        result = trainer.train(resume=resume)
        train_s = time.perf_counter() - t_train
    peak = _peak_rss_bytes()
    out = Path(config.out_dir)
    exports = export_all(model, tok, out, base=config.model)
    counts = _counts(model)
    summary: dict[str, Any] = {
        "config": asdict(config),
        "layout": choice.layout,
        "layout_reason": choice.reason,
        "padding_share": choice.padding_share,
        "estimated_flops": choice.flops,
        "train_examples": len(train),
        "heldout_examples": len(held),
        "truncated_examples": data.truncated,
        "trainable_params": counts["trainable"],
        "total_params": counts["total"],
        "heldout_loss_before": before.get("eval_loss"),
        "heldout_loss_after": result.eval.get("eval_loss"),
        "train_loss": result.train_loss,
        "steps": result.steps,
        "tokens_per_s": result.tokens_per_s,
        "train_seconds": train_s,
        "wall_seconds": time.perf_counter() - t0,
        "peak_rss_bytes": peak,
        "mmap_threshold_held": mmap_held,
        "exports": exports,
    }
    atomic_write_text(out / "finetune.json", json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def export_all(model: nn.Module, tok: Any, out: Path, *, base: str) -> dict[str, str]:
    """``adapter/`` (peft), ``merged/`` (transformers) and ``merged.gguf`` where possible."""
    import attnlab
    from attnlab.interop.hf import converter_for
    from attnlab.interop.peft import save_peft_adapter

    exports: dict[str, str] = {}
    if converter_for(model) is None:
        log.warning("%s has no transformers equivalent: no peft or merged export", type(model))
        return exports
    save_peft_adapter(model, out / "adapter", base_model_name_or_path=base)
    exports["adapter"] = str(out / "adapter")
    merged = merge_and_unload(copy.deepcopy(model)).eval()
    hf = attnlab.to_hf(merged)
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no bar for one shard
    try:
        with atomic_folder(out / "merged") as tmp:
            hf.save_pretrained(str(tmp))
            tok.save_pretrained(str(tmp))
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    exports["merged"] = str(out / "merged")
    try:
        attnlab.to_gguf(merged, out / "merged.gguf", tokenizer=tok)
    except ValueError as e:  # to_gguf writes Llama-architecture decoders
        log.warning("merged.gguf not written: %s", e)
        exports["gguf_skipped"] = str(e)
    else:
        exports["gguf"] = str(out / "merged.gguf")
    del merged, hf
    assert any(True for _ in lora_modules(model))  # the trained model keeps its adapters
    return exports
