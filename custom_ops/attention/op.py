"""The ops ``enn::attention`` and ``enn::attention_backward``: checks, dispatch to a backend's
kernels, dead-row handling, fake implementations and the autograd formula."""

from __future__ import annotations

import math
from typing import Optional

import torch

from .backends import BACKENDS, LSE_BACKWARD, MASKED_ROWS, Backend
from .kernels import BWD, FWD, explicit_bwd, explicit_fwd, recompute_bwd, recompute_fwd
from .masks import dead_rows, dropout_scale, full_bias, normalize_mask, saturated_counts

def _fix_rows(out: torch.Tensor, dead: Optional[torch.Tensor], masked_rows: str) -> torch.Tensor:
    if dead is None:
        return out
    fill = 0.0 if masked_rows == "zero" else float("nan")
    return torch.where(dead, torch.full((), fill, dtype=out.dtype, device=out.device), out)


def _check(q, k, v, backend, masked_rows, dropout_p, seed):
    if backend not in BACKENDS:
        raise ValueError(f"enn::attention: unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if masked_rows not in MASKED_ROWS:
        raise ValueError(f"enn::attention: masked_rows must be one of {MASKED_ROWS}, got {masked_rows!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"enn::attention: dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p and (backend != Backend.EXPLICIT or seed is None or seed.numel() != 1 or seed.is_floating_point()):
        raise ValueError("enn::attention: dropout_p > 0 needs backend 'explicit' and an integer seed tensor (one "
                         f"element) to draw the mask from; got backend {backend!r}, seed {seed!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[1] % k.shape[1]:
        raise ValueError(f"enn::attention: want 4-D q/k/v with Hq % Hkv == 0, got {tuple(q.shape)}, {tuple(k.shape)}")


@torch.library.custom_op("enn::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
              mask: Optional[torch.Tensor], alibi: Optional[torch.Tensor], scale: float, causal: bool,
              window: int, dropout_p: float, masked_rows: str, backend: str, seed: Optional[torch.Tensor] = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """dropout(softmax(q kᵀ · scale + bias + alibi, masked)) v on the chosen backend; returns (out, lse)."""
    _check(q, k, v, backend, masked_rows, dropout_p, seed)
    mask, causal = normalize_mask(q, k, mask, causal, window)
    fwd = FWD.get(backend)
    if dropout_p:
        out, lse = explicit_fwd(q, k, v, bias, mask, alibi, scale, causal, window, dropout_scale(q, k, dropout_p, seed))
    elif fwd is not None:
        out, lse = fwd(q, k, v, bias, mask, alibi, scale, causal, window)
    else:
        out, lse = recompute_fwd(q, k, v, bias, mask, alibi, scale, causal, window, backend)
    out = _fix_rows(out, dead_rows(q, k, bias, mask, causal, window), masked_rows)
    return out.contiguous(), lse.contiguous()


@attention.register_fake
def _attention_fake(q, k, v, bias, mask, alibi, scale, causal, window, dropout_p, masked_rows, backend, seed=None):
    b, hq, tq, _ = q.shape
    out = q.new_empty((b, hq, tq, v.shape[-1]))
    if backend in FWD:
        return out, q.new_empty((b, hq, tq), dtype=torch.float32)
    return out, q.new_empty((0,), dtype=torch.float32)


@torch.library.custom_op("enn::attention_backward", mutates_args=())
def attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       bias: Optional[torch.Tensor], mask: Optional[torch.Tensor], alibi: Optional[torch.Tensor],
                       out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool, window: int,
                       masked_rows: str, backend: str, bias_grad: bool, dropout_p: float = 0.0,
                       seed: Optional[torch.Tensor] = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv, dbias) of :func:`attention`; dbias is empty unless ``bias_grad``.
    With dropout, the mask is drawn again from ``seed``: the forward's.

    Rows whose keys are all masked: with ``masked_rows="eager"`` the forward gave NaN there and
    eager autograd gives NaN for the whole ``dv`` of that (batch, kv-head) while those rows add
    nothing to ``dq`` / ``dk``; enn reproduces exactly that. With ``"zero"`` they add nothing.
    """
    mask, causal = normalize_mask(q, k, mask, causal, window)
    dead = dead_rows(q, k, bias, mask, causal, window)
    g = grad_out if dead is None else grad_out.masked_fill(dead, 0.0)
    fb = full_bias(q, k, bias, mask, alibi, causal, window) if backend in LSE_BACKWARD and bias is not None else None
    if fb is not None:
        g = (g.float() / saturated_counts(fb)).to(g.dtype)
    if dead is not None:
        out = out.masked_fill(dead, 0.0)  # the forward's NaN fix-up must not leak into the kernels
    _check(q, k, v, backend, masked_rows, dropout_p, seed)
    if dropout_p:
        dq, dk, dv, db = explicit_bwd(g, q, k, v, bias, mask, alibi, out, lse, scale, causal, window,
                                       dropout_scale(q, k, dropout_p, seed))
    elif backend in BWD and not (bias_grad and backend == Backend.CPU_FLASH):
        dq, dk, dv, db = BWD[backend](g, q, k, v, bias, mask, alibi, out, lse, scale, causal, window)
        if bias_grad and db is None:  # pragma: no cover - cpu_flash with bias grad is routed to explicit
            raise RuntimeError("enn::attention_backward: backend gave no bias gradient")
    elif backend in BWD:
        dq, dk, dv, db = explicit_bwd(g, q, k, v, bias, mask, alibi, out,
                                       explicit_fwd(q, k, v, bias, mask, alibi, scale, causal, window)[1],
                                       scale, causal, window)
    else:
        dq, dk, dv, db = recompute_bwd(g, q, k, v, bias, mask, alibi, out, lse, scale, causal, window, backend)
    if dead is not None and masked_rows == "eager":
        hkv = k.shape[1]
        bad = dead.expand(q.shape[0], q.shape[1], *dead.shape[2:]).flatten(2).any(-1)  # [B, Hq]
        bad = bad.view(q.shape[0], hkv, -1).any(-1).view(q.shape[0], hkv, 1, 1)
        dv = dv.masked_fill(bad, float("nan"))
    if bias_grad and bias is not None:
        dbias = (db if db is not None else torch.zeros_like(bias)).to(bias.dtype).contiguous()
    else:
        dbias = q.new_empty((0,))
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dbias


@attention_backward.register_fake
def _attention_backward_fake(grad_out, q, k, v, bias, mask, alibi, out, lse, scale, causal, window,
                             masked_rows, backend, bias_grad, dropout_p=0.0, seed=None):
    dbias = torch.empty_like(bias, memory_format=torch.contiguous_format) if (bias_grad and bias is not None) else q.new_empty((0,))
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format), dbias)


def _setup_context(ctx, inputs, output):
    q, k, v, bias, mask, alibi, scale, causal, window, dropout_p, masked_rows, backend, seed = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, bias, mask, alibi, out, lse, seed)
    ctx.args = (scale, causal, window, masked_rows, backend, dropout_p)
    ctx.bias_grad = bias is not None and bias.is_floating_point() and bias.requires_grad


def _backward(ctx, grad_out, grad_lse):
    q, k, v, bias, mask, alibi, out, lse, seed = ctx.saved_tensors
    scale, causal, window, masked_rows, backend, dropout_p = ctx.args
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, dbias = attention_backward(grad_out, q, k, v, bias, mask, alibi, out, lse, scale, causal,
                                           window, masked_rows, backend, ctx.bias_grad, dropout_p, seed)
    return dq, dk, dv, (dbias if ctx.bias_grad else None), None, None, None, None, None, None, None, None, None


attention.register_autograd(_backward, setup_context=_setup_context)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def OPCHECK_SAMPLES() -> dict:
    """Samples for tests/test_opcheck.py: both ops, fp32 and bf16, optional tensors present and
    absent, grouped-query K/V, and inputs that require grad (the op has an autograd formula)."""
    g = torch.Generator().manual_seed(0)

    def t(*shape, dtype=torch.float32, grad=False):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad)

    b, h, hkv, tt, d = 2, 4, 2, 6, 8
    keep = torch.rand(b, 1, 1, tt, generator=g) > 0.3
    slopes = torch.rand(h, generator=g)
    fwd = []
    for dtype in (torch.float32, torch.bfloat16):
        for backend in ("explicit", "cpu_flash"):
            grad = dtype == torch.float32
            q, k, v = t(b, h, tt, d, dtype=dtype, grad=grad), t(b, hkv, tt, d, dtype=dtype, grad=grad), t(b, hkv, tt, d, dtype=dtype, grad=grad)
            fwd.append(((q, k, v, None, None, None, 0.35, True, 0, 0.0, "eager", backend), {}))
            fwd.append(((q, k, v, t(1, h, tt, tt, dtype=dtype, grad=grad), keep, None, 0.35, False, 0, 0.0, "zero", backend), {}))
            fwd.append(((q, k, v, None, None, slopes, 0.35, True, 3, 0.0, "eager", backend), {}))
    seed = torch.tensor(1234)  # dropout: the mask drawn from the seed, the backward's the same
    q, k, v = t(b, h, tt, d, grad=True), t(b, hkv, tt, d, grad=True), t(b, hkv, tt, d, grad=True)
    fwd.append(((q, k, v, None, keep, None, 0.35, True, 0, 0.25, "eager", "explicit", seed), {}))
    q, k, v = t(b, h, tt, d), t(b, hkv, tt, d), t(b, hkv, tt, d)
    bias = t(1, h, tt, tt)
    out, lse = attention(q, k, v, bias, keep, None, 0.35, False, 0, 0.0, "eager", "explicit")
    bwd = [((t(b, h, tt, d), q, k, v, bias, keep, None, out, lse, 0.35, False, 0, "eager", "explicit", True), {}),
           ((t(b, h, tt, d), q, k, v, None, None, None, out, lse, 0.35, True, 0, "eager", "cpu_flash", False), {}),
           ((t(b, h, tt, d), q, k, v, bias, keep, None, out, lse, 0.35, False, 0, "eager", "explicit", True, 0.25,
             seed), {})]
    return {"enn::attention": fwd, "enn::attention_backward": bwd}
