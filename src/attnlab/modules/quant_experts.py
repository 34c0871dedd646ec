"""Weight-only quantized MoE experts: each expert's two matrices as int8/int4 layers.

:class:`~attnlab.modules.experts.Experts` stores its weights batched (``w_in [E, F_in, D]``,
``w_out [E, D, F]``) for grouped matmuls; quantized, each expert's matrices become one
:class:`~attnlab.modules.quant_linear.QuantLinear` each (the same layouts and kernels as
every other quantized layer, chosen by measurement per shape). Dispatch sorts the
assignments by expert and runs each expert that received tokens on its rows, then adds
the weighted outputs back, the arithmetic of
:func:`~attnlab.functional.expert_dispatch.moe_dropless` on the dequantized weights.

Shape notation: ``N`` tokens, ``D`` width, ``E`` experts, ``k`` experts per token,
``F`` expert inner width, ``F_in`` = ``2F`` (gated) or ``F``, ``A = N k`` assignments.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab.functional.expert_dispatch import sort_by_expert
from attnlab.functional.routing import ExpertChoice, TokenChoice
from attnlab.modules.activations import get_activation
from attnlab.modules.experts import Experts
from attnlab.modules.linear import LinearSpec, convert_linear
from attnlab.modules.quant_linear import QuantLinear

__all__ = ["QuantExperts"]


class QuantExperts(nn.Module):
    """``E`` experts whose ``w_in``/``w_out`` are quantized layers, one pair per expert.

    Build it with :meth:`from_float`. Inference only: ``dispatch`` ``"dropless"`` or
    ``"reference"`` (the same sums) for token choice, and expert choice; ``"capacity"``
    (a training-time rule that drops tokens) is refused.

    Args:
        w_in: ``E`` layers ``[F_in, D]``.
        w_out: ``E`` layers ``[D, F]``.
        activation: activation name.
        gated: gated (GLU) experts: ``w_in`` rows are gate rows then up rows.
    """

    def __init__(
        self,
        *,
        w_in: list[QuantLinear],
        w_out: list[QuantLinear],
        activation: str = "silu",
        gated: bool = True,
    ) -> None:
        super().__init__()
        if len(w_in) != len(w_out) or not w_in:
            raise ValueError(
                f"w_in and w_out need one layer per expert, got {len(w_in)} and {len(w_out)}"
            )
        self.w_in = nn.ModuleList(w_in)
        self.w_out = nn.ModuleList(w_out)
        self.num_experts = len(w_in)
        self.embed_dim = w_in[0].in_features
        self.hidden_dim = w_out[0].in_features
        self.gated = gated
        self.activation_name = activation
        self.act = get_activation(activation)

    @classmethod
    def from_float(cls, experts: Experts, spec: LinearSpec | str) -> QuantExperts:
        """``experts``' weights quantized expert by expert as ``spec`` says.

        Raises:
            ValueError: a float ``spec``, or a group that does not divide ``D`` or ``F``.
        """
        s = LinearSpec.parse(spec)
        if not s.quantized:
            raise ValueError(f"QuantExperts needs an int8/int4 spec, got {s}")

        def layer(w: Tensor) -> QuantLinear:
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
            lin.weight = nn.Parameter(w.detach().clone(), requires_grad=False)
            q = convert_linear(lin, s)
            assert isinstance(q, QuantLinear)
            return q

        return cls(
            w_in=[layer(w) for w in experts.w_in],
            w_out=[layer(w) for w in experts.w_out],
            activation=experts.activation_name,
            gated=experts.gated,
        )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, embed_dim={self.embed_dim}, "
            f"hidden_dim={self.hidden_dim}, activation={self.activation_name!r}, gated={self.gated}"
        )

    def dequantized(self) -> tuple[Tensor, Tensor]:
        """``(w_in [E, F_in, D], w_out [E, D, F])`` float32: the weights these layers hold."""
        w_in = torch.stack([m.dequantize() for m in self.w_in])  # type: ignore[operator]
        w_out = torch.stack([m.dequantize() for m in self.w_out])  # type: ignore[operator]
        return w_in, w_out

    def _expert(self, e: int, x: Tensor) -> Tensor:
        """Expert ``e`` on ``[n, D]`` rows: ``[n, D]``."""
        h = self.w_in[e](x)  # [n, F_in]
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        out: Tensor = self.w_out[e](h)  # [n, D]
        return out

    def forward(
        self,
        x: Tensor,
        routing: TokenChoice | ExpertChoice,
        *,
        dispatch: str = "dropless",
        capacity: int = 0,
    ) -> tuple[Tensor, Tensor | None]:
        """``[N, D] -> ([N, D], None)``; arguments as :meth:`Experts.forward`.

        Raises:
            ValueError: ``dispatch="capacity"`` or an unknown dispatch.
        """
        if dispatch not in ("dropless", "reference", "capacity"):
            raise ValueError(
                f"dispatch must be 'dropless', 'capacity' or 'reference', got {dispatch!r}"
            )
        if isinstance(routing, ExpertChoice):
            y = torch.zeros_like(x)
            for e in range(self.num_experts):
                tokens = routing.tokens[e]  # [C]
                out = self._expert(e, x[tokens]) * routing.weights[e, :, None].to(x.dtype)
                y = y.index_add(0, tokens, out)
            return y, None
        if dispatch == "capacity":
            raise ValueError(
                "quantized experts run inference dispatch (dropless); dispatch='capacity' "
                f"(capacity {capacity}) drops tokens as training does: use 'dropless'"
            )
        k = routing.experts.shape[1]
        order, counts = sort_by_expert(routing.experts, self.num_experts)  # [A], [E]
        token = order // k  # [A]
        weight = routing.weights.reshape(-1)[order].to(x.dtype)  # [A]
        y = torch.zeros_like(x)
        start = 0
        for e, c in enumerate(counts.tolist()):
            if c:
                rows = token[start : start + c]
                y = y.index_add(0, rows, self._expert(e, x[rows]) * weight[start : start + c, None])
            start += c
        return y, None
