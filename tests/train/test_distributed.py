"""Two processes (torchrun, gloo on loopback) equal one: DDP, FSDP2 with and without a
bfloat16 mixed-precision policy, distributed checkpoints resharded 2 -> 1, and ring
attention equal to single-process attention, forward and backward."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

import attnlab
from attnlab.train import TrainConfig, Trainer

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("dist_worker.py")
CONFIG: dict[str, Any] = {
    "model": {
        "kind": "decoder",
        "arch": "llama",
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
    },
    "data": {"source": "synthetic", "task": "copy", "task_length": 6, "num_symbols": 8},
    "steps": 20,
    "batch_size": 4,
    "progress": False,
    "export": False,
    "eval_batches": 1,
    "optim": {"lr": 3e-3, "warmup_steps": 2},
}


def _torchrun(mode: str, out: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    env.pop("PYTEST_XDIST_WORKER", None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(WORKER), mode, str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _losses(folder: Path) -> list[float]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


def _one_process(out: Path, **kw: Any) -> list[float]:
    Trainer(TrainConfig.from_dict(CONFIG | {"out_dir": str(out)} | kw)).train()
    return _losses(out)


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    (out / "config.json").write_text(json.dumps(CONFIG))
    _torchrun("train", out)
    return out


def test_ddp_and_fsdp_equal_one_process(two_process_runs: Path, tmp_path: Path) -> None:
    one = _one_process(tmp_path / "one")
    assert len(one) == 20
    for name in ("ddp", "fsdp"):
        two = _losses(two_process_runs / name)
        assert len(two) == 20
        assert max(abs(a - b) for a, b in zip(one, two)) <= 1e-5, name


def test_fsdp_bfloat16_policy_equals_one_process_with_the_same_policy(
    two_process_runs: Path, tmp_path: Path
) -> None:
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        parallel = {"strategy": "fsdp", "param_dtype": "bfloat16", "backend": "gloo"}
        one = _one_process(tmp_path / "one", parallel=parallel)
    finally:
        dist.destroy_process_group()
    two = _losses(two_process_runs / "fsdp-bf16")
    assert max(abs(a - b) for a, b in zip(one, two)) <= 1e-3


def test_distributed_checkpoint_loads_in_one_process(
    two_process_runs: Path, tmp_path: Path
) -> None:
    """Saved by 2 FSDP ranks (each its shards), loaded (resharded) by 1 plain process."""
    trainer = Trainer(TrainConfig.from_dict(CONFIG | {"out_dir": str(tmp_path)}))
    trainer.load(two_process_runs / "fsdp" / "checkpoints" / "step-20")
    assert trainer.step == 20 and trainer.samples == 80
    gathered = attnlab.from_hf(two_process_runs / "fsdp" / "model")  # full weights at the end
    for (name, a), b in zip(trainer.model.state_dict().items(), gathered.state_dict().values()):
        assert torch.equal(a, b), name
    assert trainer.optimizer.state_dict()["state"][0]["step"] == 20
    trainer.train()  # and it continues (nothing left: evaluates, saves)


def test_ring_attention_equals_single_process_attention(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    _torchrun("ring", tmp_path)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 64, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 64, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 64, 8, generator=g, dtype=torch.float64)
    dout = torch.randn(2, 4, 64, 8, generator=g, dtype=torch.float64)
    parts = [load_file(str(tmp_path / f"ring-{r}.safetensors")) for r in range(2)]
    for causal in (False, True):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, enable_gqa=True)
        ref.backward(dout)
        name = "causal" if causal else "full"
        for key, want in (("out", ref), ("dq", qq.grad), ("dk", kk.grad), ("dv", vv.grad)):
            got = torch.cat([p[f"{name}.{key}"] for p in parts], dim=2)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=f"{name} {key}")


def test_ring_attention_needs_a_process_group() -> None:
    from attnlab.train.ring_attention import ring_attention, sequence_chunk

    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="needs a process group"):
        ring_attention(x, x, x)
    with pytest.raises(ValueError, match=r"sequence length 4 must be divisible .* \(3\)"):
        sequence_chunk(x, dim=2, rank=0, world_size=3)
