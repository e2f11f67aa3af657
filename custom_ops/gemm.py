"""``enn::gemm_bias_act`` and ``enn::gemm_residual``: a GEMM and its epilogue in one op.

``enn::gemm_bias_act(x, weight, bias, act, kernel="")`` is ``act(x @ weight.T + bias)``;
``enn::gemm_residual(x, weight, bias, residual, kernel="")`` is ``x @ weight.T + bias + residual``.
``x`` is ``[..., K]``, ``weight`` is ``[N, K]`` (the ``nn.Linear`` layout), ``bias`` is ``[N]`` or
``None``, ``residual`` is ``[..., N]``; the result is ``[..., N]`` in the dtype of ``x``.

Activations: ``none`` (the bias family), ``relu``, ``gelu`` (exact, erf), ``gelu_tanh`` (the tanh
approximation) and ``silu``. The two GELUs differ by up to ~5e-4 and are never interchanged.

``kernel`` names the kernel the registry chose when the pass emitted the op (a
:class:`.gemm_policy.GemmKernel` value), so the pass, the lowering and the eager body agree
without choosing again; empty (a direct call) means the rules' choice
(:func:`.gemm_policy.select_kernel`). Kernels, checkers and rules: ``gemm_policy.py``.

Eager ladder: the chosen fused kernel, and on an exception the ATen composite from then on for
that kernel, device, dtype and family (recorded once as an ``exception`` fallback).

Autograd: the backward needs the pre-activation's derivative. For relu it is read off the output
(``out > 0``), so nothing extra is kept. For gelu, gelu_tanh and silu the op does not return the
pre-activation; the backward recomputes it with one extra GEMM (``F.linear(x, weight, bias)``)
instead of keeping an ``[M, N]`` tensor alive between forward and backward (3 GEMMs in backward
instead of 2). enn's pass never relies on it: it rewrites a training graph only where the
backward does not read the pre-activation (see the pass). The residual's gradient is the
output's gradient.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch
import torch.nn.functional as F

from enn_backend.report import FallbackKind, report

from . import gemm_policy as P
from .gemm_policy import (ACT_FN, ACTIVATIONS, EPILOGUE_ACTS, LOW_PRECISION, ONEDNN_POSTOP,  # noqa: F401 (the op's face)
                          SUPPORTED_DTYPES, GemmKernel, GemmProblem, HwCaps, KernelChoice, autotuning, hw_caps,
                          layout_of, problem_of, run_addmm, run_aten, run_cublaslt, run_onednn, run_residual_aten,
                          select_kernel)
from .pinned import register_safe_path

log = logging.getLogger(__name__)

KERNEL_NAMES = ("",) + tuple(k.value for k in GemmKernel)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last]``; the row count spelled out, so that a last dimension of 0 (K = 0) reshapes."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


_FAILED: set[tuple] = set()  # process-wide: the kernels that failed here (a set add is atomic under the GIL)


def _kernel_for(kernel: str, problem: GemmProblem) -> GemmKernel:
    """The kernel an op call runs: the one the pass chose, else the rules'."""
    return GemmKernel(kernel) if kernel else select_kernel(problem).kernel


def _ladder(op: str, kernel: GemmKernel, key: tuple, fused, composite) -> torch.Tensor:
    """``fused()``, and on an exception ``composite()`` from then on for ``key`` (recorded once)."""
    if kernel is not GemmKernel.INDUCTOR and key not in _FAILED:
        try:
            return fused()
        except RuntimeError as exc:
            _FAILED.add(key)
            report().add_fallback(
                FallbackKind.EXCEPTION, node=op, phase="eager",
                reason=f"{kernel.value} kernel raised {type(exc).__name__}: {str(exc).strip()[:200]}",
                action=f"ATen composite for {'/'.join(str(k) for k in key[1:])} from now on")
    return composite()


# --------------------------------------------------------------------------- enn::gemm_bias_act
def _check_args(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act: str, kernel: str = "",
                op: str = "enn::gemm_bias_act") -> None:
    torch._check(act in EPILOGUE_ACTS, lambda: f"{op}: act must be one of {EPILOGUE_ACTS}, got {act!r}")
    torch._check(kernel in KERNEL_NAMES, lambda: f"{op}: kernel must be one of {KERNEL_NAMES}, got {kernel!r}")
    torch._check(weight.dim() == 2, lambda: f"{op}: weight must be [N, K]")
    torch._check(x.dim() >= 1 and x.shape[-1] == weight.shape[1],
                 lambda: f"{op}: x[..., K] and weight[N, K] disagree: {tuple(x.shape)} vs {tuple(weight.shape)}")
    torch._check(x.dtype == weight.dtype, lambda: f"{op}: x and weight dtypes differ")
    if bias is not None:
        torch._check(bias.dim() == 1 and bias.shape[0] == weight.shape[0], lambda: f"{op}: bias must be [N]")


@torch.library.custom_op("enn::gemm_bias_act", mutates_args=())
def gemm_bias_act(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act: str,
                  kernel: str = "") -> torch.Tensor:
    """``act(x @ weight.T + bias)`` with the chosen kernel (see the module doc)."""
    _check_args(x, weight, bias, act, kernel)
    k = _kernel_for(kernel, problem_of(x, weight, bias, act))
    x2, shape = _flat(x), (*x.shape[:-1], weight.shape[0])
    fused = {GemmKernel.CUBLASLT: run_cublaslt, GemmKernel.ONEDNN: run_onednn}.get(k)
    if fused is None:
        k = GemmKernel.INDUCTOR
    return _ladder("enn::gemm_bias_act", k, (k, x.device.type, x.dtype, act),
                   lambda: fused(x2, weight, bias, act).reshape(shape),
                   lambda: run_aten(x2, weight, bias, act).reshape(shape))


@gemm_bias_act.register_fake
def _gemm_bias_act_fake(x, weight, bias, act, kernel=""):
    _check_args(x, weight, bias, act, kernel)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, act = inputs[:4]
    ctx.act = act
    ctx.has_bias = bias is not None
    if act in ("relu", "none"):
        # relu'(pre) = (out > 0): the output is all the backward needs besides x and weight
        ctx.save_for_backward(x, weight, output)
    else:
        # the pre-activation is recomputed in backward (one GEMM) rather than kept alive
        ctx.save_for_backward(x, weight, bias)


def _backward(ctx, grad):
    act = ctx.act
    if act == "none":
        x, weight, _ = ctx.saved_tensors
        g = grad
    elif act == "relu":
        x, weight, out = ctx.saved_tensors
        g = torch.where(out > 0, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))
    else:
        x, weight, bias = ctx.saved_tensors
        pre = F.linear(x, weight, bias)
        if act == "silu":
            g = torch.ops.aten.silu_backward(grad, pre)
        else:
            g = torch.ops.aten.gelu_backward(grad, pre, approximate="tanh" if act == "gelu_tanh" else "none")
    gx, gw, gb = _linear_grads(ctx, g, x, weight)
    return gx, gw, gb, None, None


def _linear_grads(ctx, g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor):
    g2 = _flat(g)
    gx = gw = gb = None
    if ctx.needs_input_grad[0]:
        gx = (g2 @ weight).reshape(x.shape)
    if ctx.needs_input_grad[1]:
        gw = g2.t() @ _flat(x)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        gb = g2.sum(0)
    return gx, gw, gb


gemm_bias_act.register_autograd(_backward, setup_context=_setup_context)


@register_safe_path("enn.gemm_bias_act.default")
def _safe_path(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act: str,
               kernel: str = "") -> torch.Tensor:
    """What a pinned enn::gemm_bias_act runs: the unfused ATen GEMM + activation."""
    return ACT_FN[act](F.linear(x, weight, bias))


# --------------------------------------------------------------------------- enn::gemm_residual
def _check_residual(x, weight, bias, residual, kernel) -> None:
    _check_args(x, weight, bias, "none", kernel, op="enn::gemm_residual")
    torch._check(tuple(residual.shape) == (*x.shape[:-1], weight.shape[0]),
                 lambda: f"enn::gemm_residual: residual must be [..., N], got {tuple(residual.shape)}")
    torch._check(residual.dtype == x.dtype, lambda: "enn::gemm_residual: residual and x dtypes differ")


@torch.library.custom_op("enn::gemm_residual", mutates_args=())
def gemm_residual(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                  kernel: str = "") -> torch.Tensor:
    """``x @ weight.T + bias + residual`` with the chosen kernel (see the module doc)."""
    _check_residual(x, weight, bias, residual, kernel)
    k = _kernel_for(kernel, problem_of(x, weight, bias, "none", residual))
    x2, r2, shape = _flat(x), _flat(residual), residual.shape
    if k is not GemmKernel.ADDMM:
        k = GemmKernel.INDUCTOR
    return _ladder("enn::gemm_residual", k, (k, x.device.type, x.dtype, "residual"),
                   lambda: run_addmm(x2, weight, bias, r2).reshape(shape),
                   lambda: run_residual_aten(x2, weight, bias, r2).reshape(shape))


@gemm_residual.register_fake
def _gemm_residual_fake(x, weight, bias, residual, kernel=""):
    _check_residual(x, weight, bias, residual, kernel)
    return residual.new_empty(residual.shape)


def _residual_setup(ctx, inputs, output) -> None:
    x, weight, bias = inputs[:3]
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight)


def _residual_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    gx, gw, gb = _linear_grads(ctx, grad, x, weight)
    return gx, gw, gb, grad if ctx.needs_input_grad[3] else None, None


gemm_residual.register_autograd(_residual_backward, setup_context=_residual_setup)


@register_safe_path("enn.gemm_residual.default")
def _residual_safe_path(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                        kernel: str = "") -> torch.Tensor:
    """What a pinned enn::gemm_residual runs: the unfused ATen GEMM + add."""
    return F.linear(x, weight, bias) + residual


def OPCHECK_SAMPLES() -> dict:
    """Samples for tests/test_opcheck.py: every activation, fp32 and bf16, 2-D and 3-D inputs,
    with and without bias, inputs that require grad (the op has an autograd formula)."""
    g = torch.Generator().manual_seed(0)

    def t(*shape, dtype=torch.float32, grad=False):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad)

    samples, residual = [], []
    for dtype in (torch.float32, torch.bfloat16):
        grad = dtype == torch.float32
        for act in EPILOGUE_ACTS:
            samples.append(((t(5, 8, dtype=dtype, grad=grad), t(6, 8, dtype=dtype, grad=grad), t(6, dtype=dtype, grad=grad), act), {}))
        samples.append(((t(2, 3, 8, dtype=dtype, grad=grad), t(6, 8, dtype=dtype, grad=grad), None, "relu"), {}))
        residual.append(((t(2, 3, 8, dtype=dtype, grad=grad), t(6, 8, dtype=dtype, grad=grad), t(6, dtype=dtype, grad=grad),
                          t(2, 3, 6, dtype=dtype, grad=grad)), {}))
        residual.append(((t(5, 8, dtype=dtype, grad=grad), t(6, 8, dtype=dtype, grad=grad), None,
                          t(5, 6, dtype=dtype, grad=grad), "addmm"), {}))
    return {"enn::gemm_bias_act": samples, "enn::gemm_residual": residual}
