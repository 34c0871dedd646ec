"""Cost of mixture-of-experts layers: total vs active parameters, FLOPs, all-to-all bytes.

Shape notation: ``T`` tokens, ``D`` width, ``E`` experts, ``k`` experts per token, ``F``
expert inner width, ``F_s`` shared-expert width, ``n`` matrices per expert (3 gated, 2
plain), ``P`` expert-parallel degree (devices the experts are spread over).

Per MoE layer and token (forward, matmuls): the router ``2 D E``, the routed experts
``k * 2 n D F`` and the shared expert ``2 n D F_s`` (+ ``2 D`` for its gate). All ``E``
experts are held, ``k`` are used per token: Mixtral 8x7B is 46.7 B parameters, 12.9 B
active (Jiang et al., 2024).

Expert parallelism (Lepikhin et al., 2020, GShard): with the experts spread over ``P``
devices and the tokens spread evenly, each of the ``T k`` assignments leaves its device
with probability ``(P - 1) / P`` under balanced routing, once to reach its expert
(dispatch) and once to come back (combine): ``2 T k D (P - 1) / P`` elements per MoE
layer in the forward pass; the backward pass moves the same again.
"""

from __future__ import annotations

from attnlab.analysis.arch import ArchSpec, MoESpec
from attnlab.analysis.cost_layers import ELEMENTWISE_FLOPS, activation_flops

__all__ = [
    "active_parameter_count",
    "all_to_all_bytes",
    "moe_layer_flops",
    "moe_layer_parameters",
    "routed_expert_flops",
]


def moe_layer_parameters(d: int, moe: MoESpec, *, active: bool = False) -> int:
    """Parameters of one MoE feed-forward (``active``: those one token uses: ``k`` experts)."""
    n = moe.matrices
    experts = moe.top_k if active else moe.num_experts
    shared = n * d * moe.shared_intermediate_size + (d if moe.shared_gate else 0)
    return d * moe.num_experts + experts * n * d * moe.intermediate_size + shared


def active_parameter_count(spec: ArchSpec, total: int) -> int:
    """Parameters one token uses, given the ``total`` count of ``spec``."""
    if spec.moe is None:
        return total
    d, moe = spec.hidden_size, spec.moe
    idle = moe_layer_parameters(d, moe) - moe_layer_parameters(d, moe, active=True)
    return total - moe.num_layers * idle


def routed_expert_flops(assignments: float, d: int, moe: MoESpec) -> float:
    """Matmul FLOPs of the routed experts for ``assignments`` (token, expert) pairs."""
    return 2.0 * assignments * d * moe.intermediate_size * moe.matrices


def moe_layer_flops(tokens: float, d: int, moe: MoESpec) -> tuple[float, float]:
    """Forward ``(matmul, element-wise)`` FLOPs of one MoE feed-forward on ``tokens``."""
    ew = ELEMENTWISE_FLOPS
    per_unit = activation_flops(moe.activation) + (ew["gate"] if moe.gated else 0)
    mm = 2.0 * tokens * d * moe.num_experts  # router
    mm += routed_expert_flops(tokens * moe.top_k, d, moe)
    mm += 2.0 * tokens * d * moe.shared_intermediate_size * moe.matrices
    if moe.shared_gate:
        mm += 2.0 * tokens * d
    width = moe.top_k * moe.intermediate_size + moe.shared_intermediate_size
    elementwise = tokens * moe.num_experts * ew["softmax"]  # router softmax
    elementwise += tokens * width * per_unit
    elementwise += tokens * d * moe.top_k  # weighting and summing the expert outputs
    return mm, elementwise


def all_to_all_bytes(
    tokens: int,
    d: int,
    moe: MoESpec,
    *,
    parallel: int,
    bytes_per_element: int,
    backward: bool = False,
) -> float:
    """On-paper all-to-all bytes of expert parallelism over ``parallel`` devices: all MoE
    layers, one forward (and backward) pass of ``tokens`` tokens (see the module doc)."""
    if parallel <= 1:
        return 0.0
    per_layer = 2.0 * tokens * moe.top_k * d * (parallel - 1) / parallel * bytes_per_element
    return per_layer * moe.num_layers * (2 if backward else 1)
