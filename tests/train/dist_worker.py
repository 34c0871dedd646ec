"""Run by the distributed tests under ``torchrun --nproc-per-node 2`` (gloo, loopback).

Usage: ``python -m torch.distributed.run --standalone --nproc-per-node 2 dist_worker.py MODE OUT``

* ``ring``: ring attention on each rank's chunk of seeded inputs, forward and backward;
  writes ``OUT/ring-RANK.safetensors``.
* ``train``: the trainer with DDP, FSDP2 (float32) and FSDP2 (bfloat16 policy) for a few
  steps each, then a distributed checkpoint; writes ``OUT/STRATEGY/metrics.jsonl`` etc.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)


def ring(out: Path) -> None:
    from safetensors.torch import save_file

    from attnlab.train.ring_attention import ring_attention, sequence_chunk

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 64, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 64, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 64, 8, generator=g, dtype=torch.float64)
    dout = torch.randn(2, 4, 64, 8, generator=g, dtype=torch.float64)
    result = {}
    for causal in (False, True):
        parts = [
            sequence_chunk(t, dim=2, rank=rank, world_size=world).clone().requires_grad_(True)
            for t in (q, k, v)
        ]
        o = ring_attention(*parts, is_causal=causal)
        o.backward(sequence_chunk(dout, dim=2, rank=rank, world_size=world))
        name = "causal" if causal else "full"
        result[f"{name}.out"] = o.detach()
        for t, n in zip(parts, "qkv"):
            assert t.grad is not None
            result[f"{name}.d{n}"] = t.grad
    save_file({k: v.contiguous() for k, v in result.items()}, str(out / f"ring-{rank}.safetensors"))
    dist.destroy_process_group()


def train(out: Path) -> None:
    from attnlab.train import TrainConfig, Trainer

    config = json.loads((out / "config.json").read_text())
    runs = {
        "ddp": {"strategy": "ddp"},
        "fsdp": {"strategy": "fsdp"},
        "fsdp-bf16": {"strategy": "fsdp", "param_dtype": "bfloat16"},
    }
    for name, parallel in runs.items():
        cfg = TrainConfig.from_dict(
            config
            | {"parallel": parallel | {"backend": "gloo"}, "out_dir": str(out / name)}
            | {"export": name == "fsdp"}
        )
        trainer = Trainer(cfg)
        trainer.train()
    dist.destroy_process_group()


if __name__ == "__main__":
    {"ring": ring, "train": train}[sys.argv[1]](Path(sys.argv[2]))
