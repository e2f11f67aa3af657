"""``enn::attention`` (+ ``enn::attention_backward``): any backend, any mask, eager's masked rows.

What the other kernels cannot take -- boolean masks, biases that may hold -inf, bias gradients,
ALiBi / window structure on a kernel without them -- runs inside enn's custom op
(custom_ops/attention/op.py), which runs the chosen backend (its ``explicit`` fp32 math always
works) and gives a fully masked row eager's NaN, or zeros (``masked_rows="zero"``). The op is
its own safe path's owner: custom_ops/attention/safe_paths.py registers the explicit math for both ops.

With attention dropout (explicit math only: its checker is the one that takes it off CUDA) the
pass emits a seed, ``randint`` in the graph (Inductor's random stream, like its own dropout), that
both ops read: the forward draws the mask from it and the backward draws the same mask again, so
no T x T mask is saved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.fx as fx

from ..emitter import Emitter, Operands
from ..key_padding import DeadRows
from ..problem import AttentionProblem

if TYPE_CHECKING:
    from ..plan import Plan


def check_explicit(p: AttentionProblem) -> tuple[bool, str]:
    return True, "enn's fp32 math: any device, dtype and mask" + (", dropout" if p.dropout else "")

# The seed range: a torch.Generator takes any 64-bit seed; Inductor's randint draws int32 ranges.
_SEED_HIGH = 2**31 - 1


class EnnOpKernel:
    """Emits ``enn::attention`` and, in training, ``enn::attention_backward``."""

    def __init__(self, em: Emitter, plan: "Plan", ops: Operands, grad_in: Optional[fx.Node]) -> None:
        self.em, self.plan, self.ops = em, plan, ops
        st = plan.structure
        self.static = (float(plan.match.scale), st.causal, int(st.window))
        self.out = self.lse = self.seed = None
        self.dead = DeadRows(em, plan.padding, ops.q, ops.k, ops.v, self.static[0]) if plan.padding else None

    @staticmethod
    def reason(plan: "Plan") -> str:
        why = "" if plan.padding is None else "; with " + plan.padding.describe()
        if plan.problem.dropout:
            why += (f"; dropout_p={plan.problem.dropout:g} drawn inside enn::attention from a seed the graph draws "
                    "(eager's values in distribution, not bitwise), the backward redrawing the same mask")
        return why

    def forward(self) -> fx.Node:
        o, (scale, causal, window), p = self.ops, self.static, self.plan.problem.dropout
        if p:
            self.seed = self.em.call(torch.ops.aten.randint.low, (0, _SEED_HIGH, []),
                                     {"dtype": torch.int64, "device": torch.device("cpu")})
        fwd = self.em.call(torch.ops.enn.attention.default,
                           (o.q, o.k, o.v, o.bias, o.mask, o.alibi, scale, causal, window, p, self.plan.masked_rows,
                            self.plan.backend.value) + ((self.seed,) if p else ()))
        self.out, self.lse = self.em.items(fwd, 2)
        return self.out if self.dead is None else self.dead.forward(self.out)

    def backward(self, g: fx.Node, before: fx.Node) -> list[fx.Node]:
        o, (scale, causal, window) = self.ops, self.static
        g_op = g if self.dead is None else self.dead.kernel_grad(g, before)
        b = self.em.call(torch.ops.enn.attention_backward.default,
                         (g_op, o.q, o.k, o.v, o.bias, o.mask, o.alibi, self.out, self.lse, scale, causal, window,
                          self.plan.masked_rows, self.plan.backend.value, self.plan.bias_grad)
                         + ((self.plan.problem.dropout, self.seed) if self.seed is not None else ()), before=before)
        grads = self.em.items(b, 4, before)
        return grads if self.dead is None else self.dead.grads(g, *grads[:3], before) + grads[3:]
