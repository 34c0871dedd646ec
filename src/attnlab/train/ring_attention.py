"""Ring attention: exact attention over a sequence split across processes (context parallelism).

Shape notation: ``B`` batch, ``H`` heads, ``C`` tokens held by one process (its chunk),
``E`` head dim, ``P`` processes.

Process ``r`` holds the queries, keys and values of tokens ``[r C, (r + 1) C)``. The key/value
chunks travel around the ring of processes: at step ``s`` process ``r`` attends its queries
to the chunk of process ``r - s`` while it sends the chunk it holds to ``r + 1`` and receives
the next one from ``r - 1`` (the transfer overlaps the computation). Each step's partial
result ``(out_s, lse_s)`` comes from the tiled backend's online-softmax forward and is merged
by the log-sum-exp: ``lse = log(e^lse + e^lse_s)``, ``out = out e^(lse_old - lse) +
out_s e^(lse_s - lse)`` (Liu et al., 2023, "Ring attention with blockwise transformers for
near-infinite context"; the merge is FlashAttention's, Dao et al., 2022).

The backward sends the chunks around again, each with the gradient of its keys and values
accumulating as it travels; one more hop brings the finished gradients home. Each step's
contribution is the tiled backend's backward for that chunk, computed with the final
``out`` and ``lse`` (the probabilities of a chunk are ``exp(s - lse)`` with the global
normaliser). With a causal mask a chunk from a later process is skipped entirely and the
diagonal chunk uses the causal pattern. Memory per process is ``O(C)`` plus one tile;
no process ever holds the whole sequence.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from attnlab.backends.blocks import compute_dtype, mask_spec
from attnlab.backends.tiled import BLOCK_K, BLOCK_Q, _tiled_backward, tiled_forward
from attnlab.functional.attention import repeat_kv

__all__ = ["ring_attention", "sequence_chunk"]


def sequence_chunk(x: Tensor, *, dim: int, rank: int, world_size: int) -> Tensor:
    """This process's contiguous chunk of ``x`` along ``dim`` (the sequence).

    Raises:
        ValueError: a sequence length not divisible by ``world_size``.
    """
    n = x.shape[dim]
    if n % world_size:
        raise ValueError(
            f"sequence length {n} must be divisible by the number of processes ({world_size})"
        )
    c = n // world_size
    return x.narrow(dim, rank * c, c)


def _exchange(send: Tensor, group: Any) -> tuple[Tensor, list[Any]]:
    """Start sending ``send`` to the next rank and receiving the previous rank's."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nxt = (
        dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
    )
    prv = (
        dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
    )
    recv = torch.empty_like(send)
    ops = [
        dist.P2POp(dist.isend, send, nxt, group),
        dist.P2POp(dist.irecv, recv, prv, group),
    ]
    return recv, dist.batch_isend_irecv(ops)


def _wait(reqs: list[Any]) -> None:
    for r in reqs:
        r.wait()


def _merge(out: Tensor, lse: Tensor, o: Tensor, l: Tensor) -> tuple[Tensor, Tensor]:
    """Merge two partial softmax results by their log-sum-exps (rows with -inf stay 0)."""
    new = torch.logaddexp(lse, l)  # [N, H, C]
    safe = new.masked_fill(torch.isneginf(new), 0.0)
    a = torch.exp(lse - safe).masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1)
    b = torch.exp(l - safe).masked_fill(torch.isneginf(l), 0.0).unsqueeze(-1)
    return out * a + o * b, new


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, group: Any
    ) -> Tensor:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        dtype = q.dtype
        cdt = compute_dtype(dtype)
        qc, kc, vc = q.to(cdt).contiguous(), k.to(cdt), v.to(cdt)
        e = kc.shape[-1]
        kv = torch.cat([kc, vc], dim=-1).contiguous()  # [N, H, C, E + Ev], one message
        shape = tuple(qc.shape)
        out = torch.zeros(*shape[:-1], vc.shape[-1], dtype=cdt, device=q.device)
        lse = torch.full(shape[:-1], float("-inf"), dtype=cdt, device=q.device)
        for step in range(world):
            src = (rank - step) % world
            reqs: list[Any] = []
            nxt = kv
            if step < world - 1:
                nxt, reqs = _exchange(kv, group)
            if not (causal and src > rank):
                spec = mask_spec(None, causal and src == rank, shape, kv.shape[2])
                o, l = tiled_forward(qc, kv[..., :e], kv[..., e:], spec, scale)
                out, lse = _merge(out, lse, o, l)
            _wait(reqs)
            kv = nxt
        ctx.save_for_backward(qc, kc, vc, out, lse)
        ctx.causal, ctx.scale, ctx.group, ctx.dtype = causal, scale, group, dtype
        return out.to(dtype)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        qc, kc, vc, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        e, ev = kc.shape[-1], vc.shape[-1]
        do = dout.to(qc.dtype).contiguous()
        dq = torch.zeros_like(qc)
        # the travelling message: this chunk's keys, values and their gradients so far
        msg = torch.cat([kc, vc, torch.zeros_like(kc), torch.zeros_like(vc)], dim=-1).contiguous()
        shape = tuple(qc.shape)
        for step in range(world):
            src = (rank - step) % world
            if not (causal and src > rank):
                spec = mask_spec(None, causal and src == rank, shape, msg.shape[2])
                k_s, v_s = msg[..., :e], msg[..., e : e + ev]
                dq_s, dk_s, dv_s, _ = _tiled_backward(
                    qc, k_s, v_s, out, lse, do, spec, scale, BLOCK_Q, BLOCK_K
                )
                dq += dq_s
                msg[..., e + ev : 2 * e + ev] += dk_s
                msg[..., 2 * e + ev :] += dv_s
            msg, reqs = _exchange(msg, group)  # the last hop brings each chunk's grads home
            _wait(reqs)
        dk = msg[..., e + ev : 2 * e + ev]
        dv = msg[..., 2 * e + ev :]
        d = ctx.dtype
        return dq.to(d), dk.to(d), dv.to(d), None, None, None


def ring_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    group: Any = None,
) -> Tensor:
    """Exact attention over a sequence whose chunks live on the processes of ``group``.

    Args:
        query: ``[B, H, C, E]``, this process's chunk (tokens ``[rank C, (rank + 1) C)``).
        key: ``[B, H_kv, C, E]`` (``H_kv`` divides ``H``: grouped-query attention).
        value: ``[B, H_kv, C, Ev]``.
        is_causal: causal attention over the whole sequence (global positions).
        scale: score scale (default ``1/sqrt(E)``).
        group: the process group (default: the world).

    Returns:
        ``[B, H, C, Ev]``: this chunk of the output of attention over all ``P C`` tokens,
        differentiable (the backward is a second trip around the ring).

    Raises:
        ValueError: no process group, or chunks of different shapes.
    """
    if not dist.is_initialized():
        raise ValueError("ring_attention needs a process group (torch.distributed / torchrun)")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"query, key, value must be [B, H, C, E]; got {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)}"
        )
    if key.shape[2] != query.shape[2] or value.shape[2] != query.shape[2]:
        raise ValueError(
            f"every process holds chunks of one length: query {query.shape[2]}, key "
            f"{key.shape[2]}, value {value.shape[2]}"
        )
    h, hkv = query.shape[1], key.shape[1]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hkv})")
    if hkv != h:
        key, value = repeat_kv(key, h // hkv), repeat_kv(value, h // hkv)
    s = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    out: Tensor = _RingAttention.apply(query, key, value, is_causal, s, group)
    return out
