"""Mixture-of-experts routing: routers, router noise and the auxiliary losses.

Shape notation: ``N`` tokens (batch and sequence flattened), ``E`` experts, ``k`` experts
per token, ``C`` tokens per expert (capacity), ``D`` width.

Routers (all take router logits ``[N, E]``, computed by a linear gate on the tokens):

* ``"softmax_topk"``: softmax over the experts, keep the ``k`` largest probabilities,
  optionally renormalise them to sum to one (Mixtral, Jiang et al. 2024, renormalises;
  Qwen2-MoE and OLMoE do not by default: transformers' ``norm_topk_prob``).
* ``"topk_softmax"``: keep the ``k`` largest logits, softmax over those only (Shazeer et
  al., 2017, "Outrageously large neural networks", eq. 3-5 without the noise).
* ``"switch"``: top-1 of the softmax, weight = that probability, not renormalised
  (Fedus et al., 2021, "Switch Transformers", sec. 2.1).
* ``"expert_choice"``: each expert takes its ``C`` highest-scoring tokens (Zhou et al.,
  2022, "Mixture-of-Experts with Expert Choice Routing", eq. 1-2). It compares tokens
  with each other across the whole batch, so it is not causal: use it for encoders and
  training, never for autoregressive decoding (a token's output would depend on tokens
  after it and on its batch neighbours).

Token-choice routers decide each token alone, so their result does not depend on the
rest of the batch; capacity *dropping* does (which tokens overflow an expert depends on
what else is in the batch), which is why cached decoding runs dropless.

Losses: the Switch/Mixtral load-balancing loss (Fedus et al., 2021, eq. 4-6; the same
numbers as transformers' ``load_balancing_loss_func``, padding mask included) and the
router z-loss (Zoph et al., 2022, "ST-MoE", eq. 5).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from attnlab.functional._checks import check_positive_int, check_real, check_tensor

__all__ = [
    "ROUTERS",
    "TOKEN_CHOICE_ROUTERS",
    "ExpertChoice",
    "TokenChoice",
    "expert_capacity",
    "expert_choice",
    "input_jitter",
    "load_balancing_loss",
    "logit_noise",
    "route",
    "router_z_loss",
    "token_choice",
]

TOKEN_CHOICE_ROUTERS = ("softmax_topk", "topk_softmax", "switch")
ROUTERS = (*TOKEN_CHOICE_ROUTERS, "expert_choice")


class TokenChoice(NamedTuple):
    """Each token's experts and combine weights.

    Attributes:
        weights: ``[N, k]`` combine weights, float32 (the router's arithmetic precision).
        experts: ``[N, k]`` long expert ids, best first.
    """

    weights: Tensor
    experts: Tensor


class ExpertChoice(NamedTuple):
    """Each expert's tokens and combine weights (expert-choice routing).

    Attributes:
        weights: ``[E, C]`` combine weights, float32.
        tokens: ``[E, C]`` long token ids, highest score first.
    """

    weights: Tensor
    tokens: Tensor


def _check_logits(logits: Tensor) -> None:
    check_tensor("router_logits", logits)
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(
            f"router_logits must be floating [tokens, experts], got {logits.dtype} "
            f"{tuple(logits.shape)}"
        )


def token_choice(
    logits: Tensor, top_k: int, *, router: str = "softmax_topk", normalize: bool = True
) -> TokenChoice:
    """Token-choice top-k routing.

    Args:
        logits: ``[N, E]`` router logits.
        top_k: experts per token ``k``.
        router: ``"softmax_topk"``, ``"topk_softmax"`` or ``"switch"`` (see the module doc).
        normalize: with ``"softmax_topk"``, renormalise the kept probabilities to sum to
            one (Mixtral: True; Qwen2-MoE/OLMoE ``norm_topk_prob`` default: False).

    Returns:
        :class:`TokenChoice` with ``[N, k]`` float32 weights and long expert ids.

    Raises:
        ValueError: an unknown router, ``top_k`` outside ``[1, E]``, or ``"switch"`` with
            ``top_k != 1``.
    """
    _check_logits(logits)
    if router not in TOKEN_CHOICE_ROUTERS:
        raise ValueError(f"router must be one of {list(TOKEN_CHOICE_ROUTERS)}, got {router!r}")
    num_experts = logits.shape[-1]
    check_positive_int("top_k", top_k)
    if top_k > num_experts:
        raise ValueError(f"top_k ({top_k}) must be <= the number of experts ({num_experts})")
    if router == "switch" and top_k != 1:
        raise ValueError(f"the switch router routes each token to 1 expert, got top_k={top_k}")
    if router == "topk_softmax":
        top, experts = torch.topk(logits.float(), top_k, dim=-1)  # [N, k]
        return TokenChoice(torch.softmax(top, dim=-1), experts)
    probs = torch.softmax(logits.float(), dim=-1)  # [N, E]
    weights, experts = torch.topk(probs, top_k, dim=-1)  # [N, k]
    if router == "softmax_topk" and normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return TokenChoice(weights, experts)


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Tokens each expert takes: ``ceil(capacity_factor * k * N / E)`` (Switch, eq. 3).

    Raises:
        ValueError: a non-positive count or a capacity factor that is not > 0.
    """
    check_positive_int("num_experts", num_experts)
    check_positive_int("top_k", top_k)
    check_real("capacity_factor", capacity_factor, gt=0.0)
    return max(1, math.ceil(capacity_factor * top_k * num_tokens / num_experts))


def expert_choice(logits: Tensor, capacity: int) -> ExpertChoice:
    """Expert-choice routing (Zhou et al., 2022): expert ``e`` takes its top-``C`` tokens.

    The scores are the softmax over experts per token (``S = softmax(X W_g)``, eq. 1); each
    expert keeps the ``C`` tokens with the largest score in its column (eq. 2). A token
    may be taken by several experts or by none. Not causal: see the module doc.

    Args:
        logits: ``[N, E]`` router logits.
        capacity: ``C``, at most ``N`` (``expert_capacity(N, E, k, factor)`` with
            ``k`` the average experts per token the paper calls ``c``).

    Returns:
        :class:`ExpertChoice` with ``[E, C]`` float32 weights and long token ids.
    """
    _check_logits(logits)
    check_positive_int("capacity", capacity)
    n = logits.shape[0]
    if capacity > n:
        raise ValueError(f"capacity ({capacity}) must be <= the number of tokens ({n})")
    scores = torch.softmax(logits.float(), dim=-1).t()  # [E, N]
    weights, tokens = torch.topk(scores, capacity, dim=-1)  # [E, C]
    return ExpertChoice(weights, tokens)


def route(
    logits: Tensor, top_k: int, *, router: str, normalize: bool = True, capacity: int = 0
) -> TokenChoice | ExpertChoice:
    """Dispatch on the router's name: :func:`token_choice` or :func:`expert_choice`."""
    if router == "expert_choice":
        return expert_choice(logits, capacity)
    return token_choice(logits, top_k, router=router, normalize=normalize)


def input_jitter(x: Tensor, eps: float, *, generator: torch.Generator | None = None) -> Tensor:
    """Multiply the router's input by ``U(1 - eps, 1 + eps)`` noise (Switch, sec. 2.4; Mixtral's
    ``router_jitter_noise``). Training only; ``eps = 0`` returns ``x``."""
    if eps == 0:
        return x
    noise = torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps, generator=generator)
    return x * noise


def logit_noise(logits: Tensor, std: float, *, generator: torch.Generator | None = None) -> Tensor:
    """Add ``N(0, std^2)`` noise to router logits (noisy top-k gating, Shazeer et al., 2017,
    eq. 4, with a fixed noise scale). Training only; ``std = 0`` returns ``logits``."""
    if std == 0:
        return logits
    noise = torch.randn(logits.shape, generator=generator, device=logits.device)
    return logits + std * noise.to(logits.dtype)


def _as_layers(router_logits: Tensor | Sequence[Tensor]) -> list[Tensor]:
    layers = [router_logits] if isinstance(router_logits, Tensor) else list(router_logits)
    if not layers:
        raise ValueError("router_logits is empty: pass at least one layer's [tokens, experts]")
    for t in layers:
        _check_logits(t)
    return layers


def load_balancing_loss(
    router_logits: Tensor | Sequence[Tensor],
    num_experts: int,
    top_k: int,
    attention_mask: Tensor | None = None,
) -> Tensor:
    """Switch load-balancing loss ``E * sum_e f_e * P_e`` over all layers' tokens.

    ``f_e`` is the share of top-k assignments that go to expert ``e`` and ``P_e`` the mean
    router probability of ``e`` (Fedus et al., 2021, eq. 4-6), both taken over every
    (non-padding) token of every layer together, as transformers'
    ``load_balancing_loss_func`` does (Mixtral, Qwen2-MoE, OLMoE). The minimum, ``k``, is
    reached by a uniform router.

    Args:
        router_logits: one ``[N, E]`` tensor per MoE layer (or one tensor), ``N = B * L``
            in batch-major order.
        num_experts: ``E``.
        top_k: experts per token.
        attention_mask: optional ``[B, L]`` 1/0 mask; padding tokens are left out.

    Returns:
        A float32 scalar.
    """
    layers = _as_layers(router_logits)
    check_positive_int("num_experts", num_experts)
    check_positive_int("top_k", top_k)
    if layers[0].shape[-1] != num_experts:
        raise ValueError(
            f"router_logits have {layers[0].shape[-1]} experts, num_experts is {num_experts}"
        )
    device = layers[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None
    if attention_mask is not None:
        mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)  # [N]
        if mask.numel() != layers[0].shape[0]:
            raise ValueError(
                f"attention_mask has {mask.numel()} entries, router_logits have "
                f"{layers[0].shape[0]} tokens"
            )
    for logits in layers:
        probs = torch.softmax(logits.float(), dim=-1)  # [N, E]
        experts = torch.topk(probs, top_k, dim=-1).indices  # [N, k]
        w = torch.ones(probs.shape[0], device=device) if mask is None else mask  # [N]
        counts = counts.scatter_add(0, experts.reshape(-1), w.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * w[:, None]).sum(dim=0)
        rows = rows + w.sum()
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))


def router_z_loss(
    router_logits: Tensor | Sequence[Tensor], attention_mask: Tensor | None = None
) -> Tensor:
    """ST-MoE router z-loss: mean over tokens of ``logsumexp(logits)^2`` (Zoph et al., 2022,
    eq. 5), averaged over layers; padding tokens left out when ``attention_mask`` is given."""
    layers = _as_layers(router_logits)
    total = torch.zeros((), dtype=torch.float32, device=layers[0].device)
    for logits in layers:
        z = torch.logsumexp(logits.float(), dim=-1).square()  # [N]
        if attention_mask is None:
            total = total + z.mean()
        else:
            m = attention_mask.reshape(-1).to(z)
            total = total + (z * m).sum() / m.sum().clamp_min(1.0)
    return total / len(layers)
