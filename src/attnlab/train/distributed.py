"""Several processes, one trainer: ``torch.distributed`` set up from ``torchrun``'s environment.

The trainer runs the same code with 1 or N processes. Under ``torchrun`` (``WORLD_SIZE``
and friends in the environment) it joins the process group and wraps the model:

* ``ddp``: :class:`~torch.nn.parallel.DistributedDataParallel` (Li et al., 2020) keeps a
  full replica per process and averages the gradients;
* ``fsdp``: FSDP2's :func:`~torch.distributed.fsdp.fully_shard` (Zhao et al., 2023) on
  each layer and then on the root shards parameters, gradients and optimizer state over
  the processes, with a :class:`~torch.distributed.fsdp.MixedPrecisionPolicy`.

Every process builds the same global batch from the shared data stream and takes its own
contiguous rows, so N processes see exactly what one process sees.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from attnlab.train.config import ParallelConfig

__all__ = ["DistContext", "setup_distributed", "wrap_model"]

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class DistContext:
    """Where this process stands: ``rank`` of ``world_size``, its device, the strategy."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    strategy: str = "none"  # none | ddp | fsdp
    owns_group: bool = False  # this module started the process group

    @property
    def enabled(self) -> bool:
        return self.strategy != "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False


def setup_distributed(parallel: ParallelConfig, device: str = "auto") -> DistContext:
    """Join the process group when launched by ``torchrun`` (or one is already set up).

    A single process without ``torchrun`` gets ``strategy="none"``: no group, no wrapper,
    on ``device`` (``"auto"``: CUDA when available).

    Raises:
        ValueError: a CUDA device asked for where there is none.
    """
    launched = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    if not dist.is_initialized() and not launched:
        name = device
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        if name.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: CUDA is not available here; use 'cpu'")
        return DistContext(device=torch.device(name))
    owns = False
    if not dist.is_initialized():
        backend = parallel.backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
        owns = True
    where = torch.device("cpu")
    if dist.get_backend() == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        where = torch.device("cuda", local)
    strategy = "fsdp" if parallel.strategy == "fsdp" else "ddp"
    return DistContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        device=where,
        strategy=strategy,
        owns_group=owns,
    )


def _layer_lists(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: members of the model's ModuleLists.

    Empty when blocks share a parameter (T5's relative bias is shared by a stack's
    layers): a parameter belongs to one FSDP unit, so such a model is sharded as a whole.
    """
    blocks = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    seen: set[int] = set()
    for block in blocks:
        ids = {id(p) for p in block.parameters()}
        if ids & seen:
            return []
        seen |= ids
    return blocks


def wrap_model(model: nn.Module, ctx: DistContext, parallel: ParallelConfig) -> nn.Module:
    """The model as the strategy runs it (the model itself without a process group).

    Returns:
        The DDP wrapper, or the model made an FSDP2 module in place, or ``model``.
    """
    model.to(ctx.device)
    if ctx.strategy == "none":
        if parallel.param_dtype != "float32":
            log.warning("parallel.param_dtype applies to FSDP only; ignored in one process")
        return model
    if ctx.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(
        param_dtype=_DTYPES[parallel.param_dtype], reduce_dtype=_DTYPES[parallel.reduce_dtype]
    )
    for block in _layer_lists(model):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model
