"""Precision-guarded ops: ``enn::softmax`` and ``enn::rms_norm`` (fp32 math, low-precision I/O).

Why ops and not decompositions: a decomposition runs *below* autograd, so the
backward still uses what autograd saved, i.e. the forward output rounded to
fp16/bf16. For softmax that rounding is what costs the gradient of a peaked row
(logits ~ randn*50, 256 classes: relative gradient error vs fp64 of 5.4e-3 with
ATen's backward in bf16 vs 1.6e-3 here; fp16: 9.6e-4 vs 2.7e-4). These ops save the *input* plus one
fp32 statistic per row instead of the rounded output, and the backward recomputes
the normalized values in fp32:

======================  ===================================  ===============================
op                      saved for backward                   memory vs ATen
======================  ===================================  ===============================
enn::softmax            x (input dtype) + lse (fp32, 1/row)   same tensor size + one float/row
enn::rms_norm           x, weight + rstd (fp32, 1/row)        same as aten._fused_rms_norm
======================  ===================================  ===============================

Every forward and backward accumulates in fp32 and casts its result back once.
Inductor lowers all four ops (``enn_backend.lowerings.precision``) to its own IR,
so each still fuses into one kernel; outside enn they run these eager bodies.

Public helpers: :func:`softmax` and :func:`rms_norm` (differentiable).
"""

from __future__ import annotations

from typing import Optional

import torch

_LOW = (torch.float16, torch.bfloat16)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in _LOW else t


# --------------------------------------------------------------------- softmax
@torch.library.custom_op("enn::softmax", mutates_args=())
def softmax_fwd(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(x, dim) in fp32, cast back to x.dtype; also the fp32 log-sum-exp (keepdim)."""
    x32 = _f32(x)
    m = x32.amax(dim, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # all -inf row: NaN like eager, no inf-inf
    e = torch.exp(x32 - m)
    s = e.sum(dim, keepdim=True)
    return (e / s).to(x.dtype), (m + torch.log(s)).to(x32.dtype)


@softmax_fwd.register_fake
def _softmax_fake(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = list(x.shape)
    if x.dim():
        shape[dim] = 1
    return torch.empty_like(x), x.new_empty(shape, dtype=_f32(x).dtype)


@torch.library.custom_op("enn::softmax_backward", mutates_args=())
def softmax_bwd(grad: torch.Tensor, x: torch.Tensor, lse: torch.Tensor, dim: int) -> torch.Tensor:
    """d softmax: y = exp(x - lse) recomputed in fp32; grad_x = y * (g - sum(g * y))."""
    y = torch.exp(_f32(x) - lse)
    g = _f32(grad)
    return (y * (g - (g * y).sum(dim, keepdim=True))).to(x.dtype)


@softmax_bwd.register_fake
def _softmax_bwd_fake(grad: torch.Tensor, x: torch.Tensor, lse: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.empty_like(x)


def _softmax_setup(ctx, inputs, output) -> None:
    x, dim = inputs
    ctx.dim = dim
    ctx.set_materialize_grads(False)  # lse is rarely used: its gradient stays None, not zeros
    ctx.save_for_backward(x, output[1])


def _softmax_backward(ctx, grad_y, grad_lse):
    x, lse = ctx.saved_tensors
    gx = softmax_bwd(grad_y, x, lse, ctx.dim) if grad_y is not None else torch.zeros_like(x)
    if grad_lse is not None:  # d lse / dx = softmax(x)
        gx = gx + (torch.exp(_f32(x) - lse) * grad_lse).to(x.dtype)
    return gx, None


softmax_fwd.register_autograd(_softmax_backward, setup_context=_softmax_setup)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax with fp32 accumulation and an fp32-exact backward (see module doc)."""
    return torch.ops.enn.softmax(x, dim)[0]


# --------------------------------------------------------------------- rms_norm
@torch.library.custom_op("enn::rms_norm", mutates_args=())
def rms_norm_fwd(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim in fp32, cast back to x.dtype; also rstd (fp32, keepdim)."""
    x32 = _f32(x)
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    y = x32 * rstd
    if weight is not None:
        y = y * _f32(weight)
    return y.to(x.dtype), rstd


@rms_norm_fwd.register_fake
def _rms_norm_fake(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=_f32(x).dtype)


@torch.library.custom_op("enn::rms_norm_backward", mutates_args=())
def rms_norm_bwd(grad: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor],
                 rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of RMSNorm (input, weight) in fp32; the weight gradient is zeros when weight is None."""
    x32, g = _f32(x), _f32(grad)
    xhat = x32 * rstd
    gxhat = g * _f32(weight) if weight is not None else g
    n = x.shape[-1]
    gx = rstd * (gxhat - xhat * (gxhat * xhat).sum(-1, keepdim=True) / n)
    if weight is not None:
        gw = (g * xhat).reshape(-1, n).sum(0).to(weight.dtype)
    else:
        gw = x.new_zeros((n,))
    return gx.to(x.dtype), gw


@rms_norm_bwd.register_fake
def _rms_norm_bwd_fake(grad, x, weight, rstd):
    n = x.shape[-1]
    return torch.empty_like(x), x.new_empty((n,), dtype=weight.dtype if weight is not None else x.dtype)


def _rms_setup(ctx, inputs, output) -> None:
    x, weight, _eps = inputs
    ctx.has_weight = weight is not None
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, weight, output[1])


def _rms_backward(ctx, grad_y, grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    if grad_y is None:
        grad_y = torch.zeros_like(x)
    gx, gw = rms_norm_bwd(grad_y, x, weight if ctx.has_weight else None, rstd)
    if grad_rstd is not None:  # d rstd / dx = -rstd^3 * x / n
        n = x.shape[-1]
        gx = gx + (-(rstd ** 3) * _f32(x) / n * grad_rstd).to(x.dtype)
    return gx, (gw if ctx.has_weight else None), None


rms_norm_fwd.register_autograd(_rms_backward, setup_context=_rms_setup)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim with fp32 accumulation (see module doc)."""
    return torch.ops.enn.rms_norm(x, weight, eps)[0]


def OPCHECK_SAMPLES() -> dict:
    """Samples for tests/test_opcheck.py: fp32 / bf16 / fp16, weight present and absent, and
    inputs that require grad (the forward ops have autograd formulas)."""
    g = torch.Generator().manual_seed(0)

    def t(*shape, dtype=torch.float32, grad=False):
        return (torch.randn(*shape, generator=g) * 3).to(dtype).requires_grad_(grad)

    out: dict = {"enn::softmax": [], "enn::softmax_backward": [], "enn::rms_norm": [], "enn::rms_norm_backward": []}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        grad = dtype == torch.float32
        x = t(4, 6, dtype=dtype, grad=grad)
        out["enn::softmax"] += [((x, -1), {}), ((x, 0), {})]
        _, lse = softmax_fwd(x.detach(), -1)
        out["enn::softmax_backward"].append(((t(4, 6, dtype=dtype), x.detach(), lse, -1), {}))
        w = t(6, dtype=dtype, grad=grad)
        out["enn::rms_norm"] += [((x, w, 1e-6), {}), ((x, None, 1e-5), {})]
        _, rstd = rms_norm_fwd(x.detach(), w.detach(), 1e-6)
        out["enn::rms_norm_backward"] += [((t(4, 6, dtype=dtype), x.detach(), w.detach(), rstd), {}),
                                          ((t(4, 6, dtype=dtype), x.detach(), None, rstd), {})]
    return out
