"""Training data: packed text (bytes or BPE) and synthetic tasks, in a deterministic order.

Shape notation: ``B`` rows, ``L`` tokens per row.

The training stream is a function of the sample index: sample ``i`` of a text corpus is
row ``perm_e[i mod N]`` of epoch ``e = i // N`` (a permutation drawn from the seed and the
epoch); a synthetic batch is drawn from a generator seeded with the seed and the index
of its first sample. So the data position saved in a checkpoint is one integer, and a
global batch is the same whatever the number of processes that share it.

Text documents are packed back to back into rows of ``seq_len`` tokens; with
``document_mask`` each row carries document ids (the ``document`` pattern), positions
restart at each document, and the first token of a document is not a target (nothing
before it in the row may predict it).
"""

from __future__ import annotations

import hashlib
import logging
import math
import sysconfig
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnlab._validate import derive_seed
from attnlab.functional.losses import IGNORE_INDEX
from attnlab.train.config import DataConfig
from attnlab.train.synthetic import make_task, task_vocab_size
from attnlab.train.tokenizer import TextTokenizer, build_tokenizer

__all__ = ["Batch", "SyntheticData", "TextData", "build_data", "stdlib_files"]

log = logging.getLogger(__name__)


@dataclass
class Batch:
    """One batch, laid out for the model kind it was made for.

    Attributes:
        input_ids: ``[B, L]`` (the encoder's source for seq2seq).
        labels: ``[B, L']`` targets, ``-100`` where nothing is predicted (decoders shift
            them inside the loss).
        doc_ids: ``[B, L]`` document of each token (packed text with document masks).
        position_ids: ``[B, L]`` positions restarting at each document.
        attention_mask: ``[B, L]`` 1 for tokens, 0 for padding (padded batches).
        num_targets: targets the loss counts (after the decoder's shift).
        num_bytes: UTF-8 bytes those targets stand for (text only; bits per byte).
    """

    input_ids: Tensor
    labels: Tensor
    doc_ids: Tensor | None = None
    position_ids: Tensor | None = None
    attention_mask: Tensor | None = None
    num_targets: int = 0
    num_bytes: int = 0

    def rows(self, start: int, stop: int, token_bytes: Tensor | None, kind: str) -> Batch:
        """Rows ``[start, stop)``, with their own target and byte counts."""
        kw: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                kw[f.name] = v[start:stop]
        return _counted(Batch(**kw), token_bytes, kind)


def _targets(labels: Tensor, kind: str) -> Tensor:
    """The labels the loss counts: shifted left for a decoder."""
    return labels[:, 1:] if kind == "decoder" else labels


def _counted(batch: Batch, token_bytes: Tensor | None, kind: str) -> Batch:
    t = _targets(batch.labels, kind)
    keep = t != IGNORE_INDEX
    n_bytes = int(token_bytes[t[keep]].sum()) if token_bytes is not None else 0
    return replace(batch, num_targets=int(keep.sum()), num_bytes=n_bytes)


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files (site-packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "__pycache__" not in p.parts and p.is_file()
    )


def _bucket(path: Path, root: Path | None) -> int:
    """0..99 from a hash of the path (relative to ``root``): the same split everywhere."""
    name = str(path.relative_to(root)) if root is not None else path.name
    return int(hashlib.sha1(name.encode()).hexdigest()[:8], 16) % 100


def _collect(config: DataConfig) -> tuple[list[Path], Path | None]:
    if config.source == "stdlib":
        return stdlib_files(), Path(sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for item in config.paths:
        p = Path(item)
        if p.is_dir():
            found += sorted(q for q in p.rglob("*") if q.is_file())
        elif p.is_file():
            found.append(p)
        else:
            raise ValueError(f"data.paths: {item!r} is neither a file nor a folder")
    return found, None


def _read(files: list[Path], limit: int) -> list[str]:
    texts: list[str] = []
    total = 0
    for p in files:
        if limit and total >= limit:
            break
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text:
            texts.append(text)
            total += len(text.encode("utf-8"))
    return texts


def _pack(docs: list[list[int]], seq_len: int) -> tuple[Tensor, Tensor]:
    """Documents back to back, cut into rows: ``(ids [N, L], doc_ids [N, L])``."""
    ids = torch.tensor([t for d in docs for t in d], dtype=torch.long)
    doc = torch.repeat_interleave(
        torch.arange(len(docs)), torch.tensor([len(d) for d in docs], dtype=torch.long)
    )
    n = ids.numel() // seq_len
    if n == 0:
        raise ValueError(
            f"the text holds {ids.numel()} tokens, fewer than one row of data.seq_len={seq_len}"
        )
    ids = ids[: n * seq_len].view(n, seq_len)
    doc = doc[: n * seq_len].view(n, seq_len)
    return ids, doc - doc[:, :1]  # documents numbered from 0 in each row


class TextData:
    """Packed text for ``kind``: next-token (decoder), masked tokens (encoder), or
    first half -> second half of each row (seq2seq).

    Args:
        config: the data section.
        kind: ``"decoder"``, ``"encoder"`` or ``"seq2seq"``.
        seed: the order's seed.
    """

    def __init__(self, config: DataConfig, *, kind: str, seed: int) -> None:
        self.config, self.kind, self.seed = config, kind, seed
        files, root = _collect(config)
        held = [p for p in files if _bucket(p, root) < config.heldout_percent]
        train = [p for p in files if _bucket(p, root) >= config.heldout_percent]
        # a pseudo-random but fixed file order, so that a byte limit takes a mixed sample
        train.sort(key=lambda p: hashlib.sha1(str(p).encode()).hexdigest())
        train_texts = _read(train, config.max_train_bytes)
        held_texts = _read(held, config.max_eval_bytes)
        if not train_texts or not held_texts:
            raise ValueError(
                f"data: {len(train_texts)} training and {len(held_texts)} held-out documents "
                f"from {len(files)} files; both splits need text (check data.paths and "
                "data.heldout_percent)"
            )
        self.tokenizer: TextTokenizer = build_tokenizer(
            config.tokenizer,
            train_texts,
            vocab_size=config.bpe_vocab_size,
            with_mask=kind == "encoder",
        )
        self.vocab_size = self.tokenizer.vocab_size
        self.token_bytes: Tensor | None = self.tokenizer.token_bytes()
        self.train_ids, self.train_docs = _pack(
            self.tokenizer.encode_batch(train_texts), config.seq_len
        )
        self.eval_ids, self.eval_docs = _pack(
            self.tokenizer.encode_batch(held_texts), config.seq_len
        )
        self.train_files, self.heldout_files = len(train), len(held)
        self._perms: dict[int, Tensor] = {}
        log.info(
            "text data: %d training rows, %d held-out rows of %d tokens",
            len(self.train_ids),
            len(self.eval_ids),
            config.seq_len,
        )

    @property
    def max_length(self) -> int:
        return self.config.seq_len

    def _perm(self, epoch: int) -> Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(derive_seed(self.seed, epoch))
            self._perms = {epoch: torch.randperm(len(self.train_ids), generator=g)}
        return self._perms[epoch]

    def train_batch(self, start: int, count: int) -> Batch:
        """Samples ``[start, start + count)`` of the training stream."""
        n = len(self.train_ids)
        rows = torch.stack([self._perm(i // n)[i % n] for i in range(start, start + count)])  # [B]
        return self._make(self.train_ids[rows], self.train_docs[rows], start)

    def eval_batches(self, count: int, batch_size: int) -> list[Batch]:
        """The first ``count`` held-out batches, in file order (the same every time)."""
        out = []
        for i in range(count):
            lo = i * batch_size
            if lo >= len(self.eval_ids):
                break
            hi = min(lo + batch_size, len(self.eval_ids))
            out.append(self._make(self.eval_ids[lo:hi], self.eval_docs[lo:hi], -1 - i))
        return out

    def _make(self, ids: Tensor, docs: Tensor, salt: int) -> Batch:
        if self.kind == "decoder":
            batch = self._causal(ids, docs)
        elif self.kind == "encoder":
            batch = self._masked(ids, salt)
        else:
            half = ids.shape[1] // 2
            batch = Batch(input_ids=ids[:, :half], labels=ids[:, half:])
        return _counted(batch, self.token_bytes, self.kind)

    def _causal(self, ids: Tensor, docs: Tensor) -> Batch:
        if not self.config.document_mask:
            return Batch(input_ids=ids, labels=ids.clone())
        starts = torch.ones_like(docs, dtype=torch.bool)
        starts[:, 1:] = docs[:, 1:] != docs[:, :-1]  # [B, L] first token of a document
        labels = ids.masked_fill(starts, IGNORE_INDEX)
        labels[:, 0] = ids[:, 0]  # never a target after the shift anyway
        idx = torch.arange(ids.shape[1]).expand_as(ids)
        first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
        return Batch(input_ids=ids, labels=labels, doc_ids=docs, position_ids=idx - first)

    def _masked(self, ids: Tensor, salt: int) -> Batch:
        """BERT's masking (Devlin et al., 2019): of the chosen tokens, 80 % become
        ``[MASK]``, 10 % a random token, 10 % stay."""
        g = torch.Generator().manual_seed(derive_seed(self.seed, salt))
        chosen = torch.rand(ids.shape, generator=g) < self.config.mlm_probability
        action = torch.rand(ids.shape, generator=g)
        random_ids = torch.randint(0, self.vocab_size - 1, ids.shape, generator=g)
        labels = ids.masked_fill(~chosen, IGNORE_INDEX)
        assert self.tokenizer.mask_token_id is not None
        out = torch.where(chosen & (action < 0.8), self.tokenizer.mask_token_id, ids)
        out = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_ids, out)
        return Batch(input_ids=out, labels=labels)


class SyntheticData:
    """A synthetic task (:mod:`attnlab.train.synthetic`) as batches for ``kind``.

    Decoders read ``prompt + answer`` and are scored on the answer; seq2seq models read
    the prompt and produce the answer; encoders see the answer masked.
    """

    EVAL_SALT = 1 << 40

    def __init__(self, config: DataConfig, *, kind: str, seed: int) -> None:
        self.config, self.kind, self.seed = config, kind, seed
        self.vocab_size = task_vocab_size(config.num_symbols) + (1 if kind == "encoder" else 0)
        self.mask_token_id = self.vocab_size - 1
        self.token_bytes: Tensor | None = None
        self.tokenizer: TextTokenizer | None = None
        prompt, answer = self._draw(1, 0)
        self.max_length = prompt.shape[1] + answer.shape[1]

    def _draw(self, count: int, salt: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(derive_seed(self.seed, salt))
        c = self.config
        return make_task(
            c.task, count, length=c.task_length, num_symbols=c.num_symbols, generator=g
        )

    def train_batch(self, start: int, count: int) -> Batch:
        return self._make(*self._draw(count, start))

    def eval_batches(self, count: int, batch_size: int) -> list[Batch]:
        return [self._make(*self._draw(batch_size, self.EVAL_SALT + i)) for i in range(count)]

    def _make(self, prompt: Tensor, answer: Tensor) -> Batch:
        if self.kind == "seq2seq":
            batch = Batch(input_ids=prompt, labels=answer)
        elif self.kind == "encoder":
            masked = torch.full_like(answer, self.mask_token_id)
            ignore = torch.full_like(prompt, IGNORE_INDEX)
            batch = Batch(
                input_ids=torch.cat([prompt, masked], 1), labels=torch.cat([ignore, answer], 1)
            )
        else:
            ids = torch.cat([prompt, answer], 1)
            labels = ids.clone()
            labels[:, : prompt.shape[1]] = IGNORE_INDEX
            batch = Batch(input_ids=ids, labels=labels)
        return _counted(batch, None, self.kind)


def build_data(config: DataConfig, *, kind: str, seed: int) -> TextData | SyntheticData:
    """The dataset the config describes."""
    if config.source == "synthetic":
        return SyntheticData(config, kind=kind, seed=seed)
    return TextData(config, kind=kind, seed=seed)


def bits_per_byte(nats: float, num_bytes: int) -> float:
    """Total loss in nats over the bytes it covers, in bits per byte."""
    return nats / math.log(2) / num_bytes if num_bytes else float("nan")
