"""Lowerings of enn's precision-guarded ops (``enn_backend.custom_ops.precision``).

Each op is built from Inductor's own lowerings of ATen ops, on an fp32 copy of its
inputs, with one cast back to the input dtype at the end. Inductor's scheduler then
fuses the whole op (both reductions and the pointwise tail) into one kernel, exactly
as it fuses a decomposed ``aten._softmax``; the fp32 conversions happen in registers.
Without these lowerings the ops would run as extern kernels (correct, not fused).
"""

from __future__ import annotations

import torch

from enn_backend import compat

aten, prims = torch.ops.aten, torch.ops.prims
_LOW = (torch.float16, torch.bfloat16)


def _L(op):
    return compat.inductor_lowering(op)


def _f32(x):
    return _L(prims.convert_element_type.default)(x, torch.float32) if x.get_dtype() in _LOW else x


def _cast(x, dtype):
    return x if x.get_dtype() == dtype else _L(prims.convert_element_type.default)(x, dtype)


def _sum(x, dims):
    return _L(aten.sum.dim_IntList)(x, dims, True)


def _ndim_dim(x, dim: int) -> int:
    return dim % max(len(x.get_size()), 1)


def lower_softmax(x, dim: int):
    dim = _ndim_dim(x, dim)
    x32 = _f32(x)
    m = _L(aten.amax.default)(x32, [dim], True)
    zero = _L(aten.full.default)(list(m.get_size()), 0.0, dtype=m.get_dtype(), device=m.get_device())
    m = _L(aten.where.self)(_L(aten.isinf.default)(m), zero, m)  # all -inf row: NaN like eager
    e = _L(aten.exp.default)(_L(aten.sub.Tensor)(x32, m))
    s = _sum(e, [dim])
    y = _cast(_L(aten.div.Tensor)(e, s), x.get_dtype())
    lse = _L(aten.add.Tensor)(m, _L(aten.log.default)(s))
    return y, lse


def lower_softmax_backward(grad, x, lse, dim: int):
    dim = _ndim_dim(x, dim)
    y = _L(aten.exp.default)(_L(aten.sub.Tensor)(_f32(x), lse))
    g = _f32(grad)
    gy = _sum(_L(aten.mul.Tensor)(g, y), [dim])
    out = _L(aten.mul.Tensor)(y, _L(aten.sub.Tensor)(g, gy))
    return _cast(out, x.get_dtype())


def lower_rms_norm(x, weight, eps: float):
    last = len(x.get_size()) - 1
    x32 = _f32(x)
    ms = _L(aten.mean.dim)(_L(aten.mul.Tensor)(x32, x32), [last], True)
    rstd = _L(aten.rsqrt.default)(_L(aten.add.Scalar)(ms, eps))
    y = _L(aten.mul.Tensor)(x32, rstd)
    if weight is not None:
        y = _L(aten.mul.Tensor)(y, _f32(weight))
    return _cast(y, x.get_dtype()), rstd


def lower_rms_norm_backward(grad, x, weight, rstd):
    size = x.get_size()
    last = len(size) - 1
    n = size[-1]
    x32, g = _f32(x), _f32(grad)
    xhat = _L(aten.mul.Tensor)(x32, rstd)
    gxhat = _L(aten.mul.Tensor)(g, _f32(weight)) if weight is not None else g
    dot = _L(aten.div.Tensor)(_sum(_L(aten.mul.Tensor)(gxhat, xhat), [last]), n)
    gx = _L(aten.mul.Tensor)(rstd, _L(aten.sub.Tensor)(gxhat, _L(aten.mul.Tensor)(xhat, dot)))
    gx = _cast(gx, x.get_dtype())
    if weight is not None:
        gw = _L(aten.mul.Tensor)(g, xhat)
        if last:
            gw = _L(aten.sum.dim_IntList)(gw, list(range(last)), False)
        gw = _cast(gw, weight.get_dtype())
    else:
        gw = _L(aten.full.default)([n], 0.0, dtype=x.get_dtype(), device=x.get_device())
    return gx, gw


# op -> its lowering (collected by enn_backend.lowerings)
LOWERINGS = {
    torch.ops.enn.softmax.default: lower_softmax,
    torch.ops.enn.softmax_backward.default: lower_softmax_backward,
    torch.ops.enn.rms_norm.default: lower_rms_norm,
    torch.ops.enn.rms_norm_backward.default: lower_rms_norm_backward,
}
