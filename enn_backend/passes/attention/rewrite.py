"""Carry out a :class:`~.plan.Plan`: the kernel's inputs as nodes, its output in place of the
attention's, its gradients in place of the backward region's exits."""

from __future__ import annotations

import torch
import torch.fx as fx

from ...fx_utils import follow_layout, is_call, shape, tensor_dtype
from .emitter import Emitter, Operands
from .key_padding import aligned, padding_bias
from .plan import Plan

aten = torch.ops.aten


def _operands(em: Emitter, plan: Plan) -> Operands:
    """q / k / v (4-D, in the matmul dtype), the bias (terms + finfo.min masks added, or the key-padding
    bias), the keep-mask (boolean masks and-ed) and the ALiBi slopes."""
    m, st = plan.match, plan.structure
    q, k, v = (em.cast(t, m.dtype) for t in (m.q, plan.k, plan.v))
    if m.three_d:
        q, k, v = (em.call(aten.unsqueeze.default, (t, 1)) for t in (q, k, v))
    bias = padding_bias(em, plan.padding, m.dtype) if plan.padding is not None else None
    for term, factor in st.bias:
        t = term if factor == 1.0 else em.call(aten.mul.Tensor, (term, factor))
        if plan.padding is not None:  # a bounded term beside the padding bias (key_padding.take): in its dtype
            t = em.cast(t, m.dtype)
        bias = t if bias is None else em.call(aten.add.Tensor, (bias, t))
    if plan.padding is not None and st.bias:
        bias = aligned(em, bias)
    for cond, keep_when_true, fill, _ in st.floors:  # finfo.min fill: eager averages dead rows; a bias does too
        keep = cond if keep_when_true else em.call(aten.bitwise_not.default, (cond,))
        like = {"dtype": tensor_dtype(m.q), "device": m.q.meta["val"].device}
        zero = em.call(aten.full.default, ([], 0.0), like)
        low = em.call(aten.full.default, ([], fill), like)
        t = em.call(aten.where.self, (keep, zero, low))
        bias = t if bias is None else em.call(aten.add.Tensor, (bias, t))
    mask = None
    for cond, keep_when_true, _, _ in st.keep:
        keep = cond if keep_when_true else (cond.args[0] if is_call(cond, aten.bitwise_not.default)
                                            else em.call(aten.bitwise_not.default, (cond,)))
        mask = keep if mask is None else em.call(aten.bitwise_and.Tensor, (mask, keep))
    if m.three_d:  # a [B, Tq, Tk] bias / mask broadcasts against [B, 1, Tq, Tk]
        if bias is not None and len(shape(bias)) == 3:
            bias = em.call(aten.unsqueeze.default, (bias, 1))
        if mask is not None and len(shape(mask)) == 3:
            mask = em.call(aten.unsqueeze.default, (mask, 1))
    alibi = em.call(aten.view.default, (st.alibi.slopes, [shape(q)[1]])) if st.alibi is not None else None
    return Operands(q, k, v, bias, mask, alibi)


def rewrite(graph: fx.Graph, plan: Plan, mode: object) -> None:
    """Replace the attention (and, in training, its backward region) by the plan's kernel."""
    m, regions = plan.match, plan.regions
    em = Emitter(graph, mode, before=m.out, recompute=m.dropout is None)
    ops = _operands(em, plan)
    first_bwd = regions.first_backward
    grad_in = None
    if regions.grads:
        grad_in = regions.grad_out
        if m.three_d:
            grad_in = em.call(aten.unsqueeze.default, (grad_in, 1), before=first_bwd)
    kernel = plan.kernel(em, plan, ops, grad_in)
    out = kernel.forward()
    if m.three_d:
        out = em.call(aten.squeeze.dim, (out, 1))
    m.out.replace_all_uses_with(out)
    follow_layout(out, mode)
    if not regions.grads:
        return
    parts = kernel.backward(grad_in, first_bwd)
    for idx, exit_node in regions.grads.items():
        if idx < 3:
            g = parts[idx]
            if m.three_d:
                g = em.call(aten.squeeze.dim, (g, 1), before=first_bwd)
        else:
            g = _term_grad(em, plan, parts[3], idx - 3, first_bwd)
        g = em.cast(g, tensor_dtype(exit_node), first_bwd)
        exit_node.replace_all_uses_with(g)
        follow_layout(g, mode)


def _one(size: object) -> bool:
    return isinstance(size, int) and size == 1  # a symbolic size is never 1 (Dynamo specializes 0 / 1)


def _term_grad(em: Emitter, plan: Plan, dbias: fx.Node, j: int, before: fx.Node) -> fx.Node:
    """The gradient of bias term node ``j`` from the kernel's bias gradient (the bias is the sum of
    ``factor * term``): ``factor * dbias``, summed over the axes the term broadcasts along, as
    autograd's ``sum_to_size`` does."""
    term, factor = plan.bias_terms[j]
    if plan.match.three_d and len(shape(dbias)) == 4:  # _operands unsqueezed a [B, Tq, Tk] bias
        dbias = em.call(aten.squeeze.dim, (dbias, 1), before=before)
    have, want = shape(dbias), shape(term)
    lead = len(have) - len(want)
    dims = list(range(lead)) + [lead + i for i, s in enumerate(want) if _one(s) and not _one(have[lead + i])]
    g = em.call(aten.sum.dim_IntList, (dbias, dims, True), before=before) if dims else dbias
    if lead:
        g = em.call(aten.view.default, (g, [em.size(term, i) for i in range(len(want))]), before=before)
    return g if factor == 1.0 else em.call(aten.mul.Tensor, (g, factor), before=before)
