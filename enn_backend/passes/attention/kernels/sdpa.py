"""SDPA's kernels: flash, cuDNN, memory-efficient and math on CUDA, flash on CPU.

Checkers: metadata in, (ok, reason) out. Where no row can be fully masked -- no boolean mask, no
ALiBi / window, at most a provably finite bias (provenance.finite_bias) -- the kernel computes exactly
what was written, and :class:`SdpaKernel` emits its ATen forward and backward ops themselves,
wired as AOT Autograd wires them for ``F.scaled_dot_product_attention`` (the same ops, argument
order and saved outputs): no custom op's per-call cost, and the backward reads the kernel's own
saved statistics (no recompute). So does a causal site whose mask is key padding
(key_padding.py): the kernel takes the ``[B, 1, 1, Tk]`` padding bias with its causal flag, and
:class:`~..key_padding.DeadRows` gives the rows that keep no key eager's values and gradients.
Grouped-query K/V (``Hkv < Hq`` heads, repeated in the graph by ``repeat_kv`` / ``repeat_interleave``):
a kernel that takes them (:attr:`NativeKernel.grouped_kv`) reads the un-repeated K/V and gives
``[B, Hkv, T, D]`` gradients, so the graph's ``[B, Hq, T, D]`` copy dies; the others read the copy
and their gradients are summed back onto the K/V heads.
Otherwise these backends run inside ``enn::attention``
(enn_op.py). The guard's eager reference runs each emitted op's safe path
(custom_ops/attention/safe_paths.py, named per kernel in :data:`NATIVE`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

import torch
import torch.fx as fx

from .... import compat
from ....custom_ops.attention import SATURATED, SATURATED_FLOOR, Backend, floors_saturated
from ....fx_utils import is_call, shape, tensor_dtype, val
from ..emitter import Emitter, Operands
from ..key_padding import DeadRows
from ..problem import AttentionProblem

if TYPE_CHECKING:
    from ..plan import Plan

aten = torch.ops.aten


# ----------------------------------------------------------------------------- checkers
def _cuda(p: AttentionProblem) -> tuple[bool, str]:
    if p.device != "cuda":
        return False, f"CUDA kernel, device is {p.device}"
    if p.dropout and (p.has_mask or p.alibi or p.window > 0 or (p.has_bias and (p.bias_grad or not p.bias_finite))):
        # Such a site runs inside enn::attention, whose CUDA backends recompute the forward in
        # the backward: a second, different dropout draw.
        return False, ("attention dropout goes to an SDPA kernel only as its ATen op (no mask tensor, window, "
                       "ALiBi, or bias that may hold -inf or needs a gradient)")
    return True, ""


def check_flash(p: AttentionProblem) -> tuple[bool, str]:
    ok, why = _cuda(p)
    if not ok:
        return ok, why
    if p.capability < (8, 0):
        return False, f"flash needs sm80+, have sm{p.capability[0]}{p.capability[1]}"
    if not p.low_precision:
        return False, f"flash needs fp16/bf16, have {p.dtype}"
    if p.has_mask or p.has_bias or p.alibi:
        return False, "flash takes no mask or bias tensor"
    if p.window > 0:
        return False, "flash (SDPA) has no sliding window"
    if p.head_dim != p.head_dim_v or p.head_dim > 256 or p.head_dim % 8:
        return False, f"flash needs equal head dims, a multiple of 8, <= 256 (have {p.head_dim}/{p.head_dim_v})"
    return True, "SDPA flash: no mask tensor, fp16/bf16, sm80+"


def check_cudnn(p: AttentionProblem) -> tuple[bool, str]:
    ok, why = _cuda(p)
    if not ok:
        return ok, why
    if p.capability < (9, 0):
        return False, "cuDNN attention is preferred on Hopper (sm90) and newer only"
    if not p.low_precision:
        return False, f"cuDNN attention needs fp16/bf16, have {p.dtype}"
    if p.window > 0 or p.alibi:
        return False, "cuDNN (SDPA) has no sliding window or ALiBi"
    if p.dropout:
        return False, ("attention dropout: cuDNN's is wrong in cuDNN 9.11-9.13 (SDPA refuses it there); "
                       "flash / memory-efficient take it")
    if p.has_mask or (p.has_bias and not p.key_padding):
        return False, ("enn runs cuDNN attention with no mask or bias tensor but a key-padding bias "
                       "(other biases go to memory-efficient)")
    if p.head_dim > 128 or p.head_dim % 8 or p.head_dim != p.head_dim_v:
        return False, f"cuDNN needs equal head dims, a multiple of 8, <= 128 (have {p.head_dim}/{p.head_dim_v})"
    return True, "SDPA cuDNN: Hopper, fp16/bf16" + (", a [B, 1, 1, Tk] key-padding bias" if p.key_padding else "")


def check_efficient(p: AttentionProblem) -> tuple[bool, str]:
    ok, why = _cuda(p)
    if not ok:
        return ok, why
    if p.capability < (5, 0):
        return False, "memory-efficient attention needs sm50+"
    if p.head_dim % 8 or p.head_dim_v % 8:
        return False, "memory-efficient attention needs head dims that are multiples of 8"
    if p.window > 0 and p.tk * p.tq > (1 << 24):
        return False, "sliding window as a mask tensor is quadratic in T; use flex"
    if p.has_bias and p.bias_may_saturate and p.dtype == "float16":
        # A row whose every key is at finfo.min is uniform in eager (the bias absorbs the
        # scores). In bf16 / fp32 enn hands the kernel SATURATED_FLOOR there, which it handles
        # (tests/test_attention_op.py::test_efficient_kernel_on_saturated_rows); fp16 cannot hold a bias that absorbs the scores.
        return False, ("fp16 cannot hold a bias that absorbs the scores: a row masked whole with finfo.min "
                       "(left padding) would not be eager's uniform row")
    return True, "SDPA memory-efficient: masks and bias tensors (with bias gradient)"


def check_math(p: AttentionProblem) -> tuple[bool, str]:
    ok, why = _cuda(p)
    if not ok:
        return ok, why
    if p.dropout:
        return False, "attention dropout: SDPA math runs inside enn::attention, whose backward would draw again"
    return True, "SDPA math on CUDA: any mask; quadratic memory"


def check_cpu_flash(p: AttentionProblem) -> tuple[bool, str]:
    if p.device != "cpu":
        return False, f"CPU kernel, device is {p.device}"
    if p.head_dim != p.head_dim_v:
        return False, "CPU flash needs equal q/k and v head dims"
    if p.bias_grad:
        return False, "CPU flash backward gives no bias gradient"
    if p.dropout:
        return False, "ATen's CPU flash kernel has no dropout"
    return True, "ATen CPU flash kernel"


# ----------------------------------------------------------------------------- the ATen ops
class Call(NamedTuple):
    """What one emitted forward / backward op reads (``saved``: the forward's outputs)."""

    g: Optional[fx.Node]
    q: fx.Node
    k: fx.Node
    v: fx.Node
    bias: Optional[fx.Node]
    causal: bool
    scale: float
    dropout: float  # dropout_p: the kernel draws its own mask (philox seed / offset saved for its backward)
    saved: list
    sizes: Callable[[], tuple[Any, Any]]  # (Tq, Tk), as ints or sym_size nodes


class NativeKernel(NamedTuple):
    forward: Any
    outputs: int  # of the forward op: (out, lse, ...)
    backward: Any
    takes_bias: bool
    forward_args: Callable[[Call], tuple[tuple, dict]]
    backward_args: Callable[[Call], tuple[tuple, dict]]
    safe_paths: tuple[str, ...]  # emitted ops with a safe path (custom_ops/attention/safe_paths.py) for the guard
    # Takes K/V with Hkv heads, Hq a multiple of Hkv (query head h reads K/V head h // (Hq // Hkv)),
    # forward and backward, its dK/dV with Hkv heads; else it needs as many K/V heads as query heads.
    grouped_kv: bool


def _flash_bwd(c: Call) -> tuple[tuple, dict]:
    # Dense (not varlen) batches: the forward's cum_seq outputs are undefined and max_q / max_k
    # are the lengths; AOT Autograd passes them as the literals None / Tq / Tk (the partitioner
    # cannot save a None output), and so does enn.
    tq, tk = c.sizes()
    out, lse, sv = c.saved[0], c.saved[1], c.saved
    return (c.g, c.q, c.k, c.v, out, lse, None, None, tq, tk, c.dropout, c.causal, sv[6], sv[7]), {"scale": c.scale}


def _cudnn_bwd(c: Call) -> tuple[tuple, dict]:
    tq, tk = c.sizes()
    out, lse, sv = c.saved[0], c.saved[1], c.saved
    return (c.g, c.q, c.k, c.v, out, lse, sv[6], sv[7], c.bias, None, None, tq, tk, c.dropout, c.causal), {"scale": c.scale}


# Backend -> its ATen ops. grouped_kv: cuDNN and flash take grouped K/V forward and backward, their
# output and dK/dV equal to the repeated call's (dK/dV summed per group) (bench/results/gpu-h100/gqa_kernels.log,
# H100, torch 2.11); memory-efficient refuses them ("Expected query.size(2) == key.size(2)"); CPU
# flash takes them, forward and backward, on torch 2.11, 2.13 and 2.15 (checked against the
# repeated call; tests/test_attention_gqa.py on the installed torch).
# Not covered by a safe path: the CUDA forward kernels (flash / cuDNN
# return SymInt outputs a pinned op cannot return, and their RNG outputs have no
# device-independent layout): for those the guard's reference is the kernel itself.
NATIVE: dict[Backend, NativeKernel] = {
    Backend.FLASH: NativeKernel(
        aten._scaled_dot_product_flash_attention.default, 8, aten._scaled_dot_product_flash_attention_backward.default,
        False, lambda c: ((c.q, c.k, c.v, c.dropout, c.causal, False), {"scale": c.scale}), _flash_bwd,
        ("aten._scaled_dot_product_flash_attention_backward.default",), grouped_kv=True),
    Backend.CUDNN: NativeKernel(
        aten._scaled_dot_product_cudnn_attention.default, 8, aten._scaled_dot_product_cudnn_attention_backward.default,
        True, lambda c: ((c.q, c.k, c.v, c.bias, True, c.dropout, c.causal, False), {"scale": c.scale}), _cudnn_bwd,
        ("aten._scaled_dot_product_cudnn_attention_backward.default",), grouped_kv=True),
    Backend.EFFICIENT: NativeKernel(
        aten._scaled_dot_product_efficient_attention.default, 4,
        aten._scaled_dot_product_efficient_attention_backward.default, True,
        lambda c: ((c.q, c.k, c.v, c.bias, True, c.dropout, c.causal), {"scale": c.scale}),
        lambda c: ((c.g, c.q, c.k, c.v, c.bias, c.saved[0], c.saved[1], c.saved[2], c.saved[3], c.dropout,
                    [True, True, True, False], c.causal), {"scale": c.scale}),
        ("aten._scaled_dot_product_efficient_attention_backward.default",), grouped_kv=False),
    Backend.CPU_FLASH: NativeKernel(
        aten._scaled_dot_product_flash_attention_for_cpu.default, 2,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default, True,
        lambda c: ((c.q, c.k, c.v, 0.0, c.causal), {"attn_mask": c.bias, "scale": c.scale}),
        lambda c: ((c.g, c.q, c.k, c.v, c.saved[0], c.saved[1], 0.0, c.causal), {"attn_mask": c.bias, "scale": c.scale}),
        ("aten._scaled_dot_product_flash_attention_for_cpu.default",
         "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"), grouped_kv=True),
}


def can_emit(backend: Backend, p: AttentionProblem, bias_last_dim: Any) -> bool:
    """Whether ``backend`` can run as its own ATen op, with no ``enn::attention`` around it.

    That op's Python body exists for what the kernels do not do themselves: boolean masks,
    ALiBi / window structure, the NaN of a row whose keys are all masked. A bias qualifies only
    if it cannot hold -inf (and needs no gradient), in the kernels' alignment (else SDPA pads a copy);
    the key-padding bias is laid out aligned (key_padding.padding_bias).
    """
    kernel = NATIVE.get(backend)
    if kernel is None or p.has_mask or p.alibi or p.window > 0:
        return False
    if not p.has_bias:
        return True
    if not kernel.takes_bias or p.bias_grad or not p.bias_finite:
        return False
    return p.key_padding or (isinstance(bias_last_dim, int) and bias_last_dim % 8 == 0)


# ----------------------------------------------------------------------------- emission
class SdpaKernel:
    """Emits one SDPA kernel's ATen forward and backward ops."""

    def __init__(self, em: Emitter, plan: "Plan", ops: Operands, grad_in: Optional[fx.Node]) -> None:
        self.em, self.plan, self.ops = em, plan, ops
        self.kernel = NATIVE[plan.backend]
        m = plan.match
        self.k, self.v = ops.k, ops.v
        if plan.rep > 1 and not self.kernel.grouped_kv:  # the kernel reads the graph's repeated K/V
            self.k, self.v = (em.cast(t, m.dtype) for t in (m.k, m.v))
        self.bias = self._kernel_bias(ops.bias)
        self.saved: list = []
        self.dead = DeadRows(em, plan.padding, ops.q, ops.k, ops.v, float(m.scale)) if plan.padding else None

    @staticmethod
    def reason(plan: "Plan") -> str:
        why = "; emitted as the ATen kernel itself" + (
            ", with " + plan.padding.describe() if plan.padding is not None else " (no fully-masked row is possible)")
        if plan.rep > 1:
            why += (f"; reads the grouped-query K/V ({plan.problem.heads_kv} heads) itself, no [B, Hq, T, D] copy"
                    if NATIVE[plan.backend].grouped_kv else
                    f"; reads the graph's {plan.rep}x repeated K/V copy ({plan.backend.value} needs as many K/V "
                    "heads as query heads), its K/V gradients summed back per group")
        if plan.padding is not None:
            return why
        if plan.problem.dropout:
            why += (f"; dropout_p={plan.problem.dropout:g} in the kernel, which draws its own mask "
                    "(eager's values in distribution, not bitwise)")
        if plan.problem.bias_may_saturate and floors_saturated(plan.match.dtype):
            why += ("; finfo.min-sized bias values handed to the kernel as -2**100, so rows masked "
                    "whole stay uniform as in eager")
        return why

    def _call(self, g: Optional[fx.Node]) -> Call:
        em, q = self.em, self.ops.q
        return Call(g, q, self.k, self.v, self.bias, self.plan.structure.causal, float(self.plan.match.scale),
                    self.plan.problem.dropout, self.saved, lambda: (em.size(q, 2), em.size(self.k, 2)))

    def forward(self) -> fx.Node:
        args, kwargs = self.kernel.forward_args(self._call(None))
        node = self.em.call(self.kernel.forward, args, kwargs)
        self.saved = self.em.items(node, self.kernel.outputs)
        return self.saved[0] if self.dead is None else self.dead.forward(self.saved[0])

    def backward(self, g: fx.Node, before: fx.Node) -> list[fx.Node]:
        em, g_kernel = self.em, g
        if self.dead is not None:  # the dead rows' gradients are added in closed form below
            g_kernel = self.dead.kernel_grad(g, before)
        elif self.bias is not None:  # a provably finite bias: no dead rows, but maybe saturated ones
            scaled = em.call(aten.div.Tensor, (g, self._saturated_counts(before)), before=before)
            g_kernel = em.cast(scaled, tensor_dtype(g), before)
        args, kwargs = self.kernel.backward_args(self._call(g_kernel))
        dq, dk, dv = em.items(em.call(self.kernel.backward, args, kwargs, before=before), 3, before)
        if self.k is not self.ops.k:  # sum the repeated heads' gradients back onto the K/V heads
            dk, dv = (self._fold_heads(t, before) for t in (dk, dv))
        return [dq, dk, dv] if self.dead is None else self.dead.grads(g, dq, dk, dv, before)

    def _kernel_bias(self, bias: Optional[fx.Node]) -> Optional[fx.Node]:
        """The bias in the kernel's dtype and 4-D shape, as custom_ops.attention.kernel_bias
        makes it. A provably finite bias stays finite (fp32 finfo.min cast to bf16 would be
        -inf). In bf16 / fp32, values at or below SATURATED become SATURATED_FLOOR, which the
        kernels handle in saturated rows (HF's finfo.min there overflows the CUDA
        memory-efficient kernel); in fp16 values are clamped to its range."""
        if bias is None:
            return None
        em, q, k = self.em, self.ops.q, self.k
        dt = tensor_dtype(q)
        if self.plan.padding is None:  # key_padding.padding_bias is in the kernel's dtype and floor already
            if floors_saturated(dt):
                above = em.call(aten.gt.Scalar, (bias, SATURATED))
                bias = em.call(aten.where.ScalarOther, (above, bias, SATURATED_FLOOR))
                if tensor_dtype(bias) != dt:
                    bias = em.call(aten.clamp_max.default, (bias, torch.finfo(dt).max))
            elif tensor_dtype(bias) != dt:
                bias = em.call(aten.clamp_min.default, (bias, torch.finfo(dt).min))
                bias = em.call(aten.clamp_max.default, (bias, torch.finfo(dt).max))
            bias = em.cast(bias, dt)
        while len(shape(bias)) < 4:
            bias = em.call(aten.unsqueeze.default, (bias, 0))
        qs, ks = shape(q), shape(k)
        if list(shape(bias)) != [qs[0], qs[1], qs[2], ks[2]]:
            bias = em.call(aten.expand.default, (bias, [em.size(q, 0), em.size(q, 1), em.size(q, 2), em.size(k, 2)]))
        return bias

    def _saturated_counts(self, before: fx.Node) -> fx.Node:
        """enn::attention's ``saturated_counts`` of the kernel's bias, as graph nodes (see
        custom_ops/attention/masks.py): per query row, the number of keys at the row's largest bias
        when that bias absorbs the scores, else 1. The backward kernels recompute P from the
        saved log-sum-exp and give such rows ``count`` times eager's gradients."""
        em = self.em
        bias = self.bias.args[0] if is_call(self.bias, aten.expand.default) else self.bias  # reduce before broadcasting
        fb = em.cast(bias, torch.float32, before)
        if self.plan.structure.causal:  # keys after the query are dropped by the kernel (top-left aligned)
            full = em.call(aten.full.default, ([em.size(self.ops.q, 2), em.size(self.k, 2)], float("-inf")),
                           {"dtype": torch.float32, "device": val(fb).device}, before=before)
            fb = em.call(aten.add.Tensor, (fb, em.call(aten.triu.default, (full, 1), before=before)), before=before)
        top = em.call(aten.amax.default, (fb, [-1], True), before=before)
        at_top = em.call(aten.eq.Tensor, (fb, top), before=before)
        count = em.call(aten.sum.dim_IntList, (at_top, [-1], True), {"dtype": torch.float32}, before=before)
        saturated = em.call(aten.le.Scalar, (top, SATURATED), before=before)
        return em.call(aten.where.ScalarOther, (saturated, count, 1.0), before=before)

    def _fold_heads(self, g: fx.Node, before: fx.Node) -> fx.Node:
        """[B, Hq, T, D] gradient of repeated K/V -> [B, Hkv, T, D] (head h reads K/V head h // rep)."""
        em, base = self.em, self.ops.k
        b, _, t, d = (em.size(g, i) for i in range(4))
        rep = compat.size_hint(shape(g)[1]) // compat.size_hint(shape(base)[1])
        v5 = em.call(aten.view.default, (g, [b, em.size(base, 1), rep, t, d]), before=before)
        return em.call(aten.sum.dim_IntList, (v5, [2]), before=before)
