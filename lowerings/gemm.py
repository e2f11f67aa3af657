"""Lowerings of ``enn::gemm_bias_act`` and ``enn::gemm_residual``: the kernel the op's ``kernel``
argument names (the registry's choice when the pass emitted it; the rules' for a direct call).

- ``cublaslt``  an extern call of ``aten._addmm_activation`` (cuBLASLt bias+relu / bias+tanh-GELU
                epilogue) straight from Inductor's generated code, no Python op layer between;
- ``onednn``    an extern call of ``mkldnn._linear_pointwise`` (oneDNN GEMM + post-op). Inductor's
                own lowering of that op is not used: it requires the weight to be a frozen
                constant (``config.freezing``), which enn's weights are not;
- ``inductor``  Inductor IR: Inductor's ``addmm``/``mm`` lowering plus the activation built
                from Inductor's pointwise lowerings, so the scheduler fuses it exactly as it
                fuses ``addmm`` + ``gelu`` in a plain graph (and a GEMM template under
                max-autotune can take it as an epilogue). This is what a model that calls
                ``torch.ops.enn.gemm_bias_act`` itself gets where no fused kernel wins;
- ``addmm``     (``enn::gemm_residual``) Inductor's ``addmm`` lowering with the residual (+ bias)
                as its C operand: the vendor GEMM adds it in its epilogue; ``inductor``: ``mm`` and
                the adds as Inductor pointwise IR.
"""

from __future__ import annotations

import math

import torch

from enn_backend import compat
from enn_backend.custom_ops import gemm as G

aten = torch.ops.aten
prims = torch.ops.prims


def _L(op):
    return compat.inductor_lowering(op)


def _activation_ir(pre, act: str, dtype: torch.dtype):
    """``act(pre)`` from Inductor's pointwise lowerings; low precision computes in fp32 like eager."""
    if act == "none":
        return pre
    if act == "relu":
        return _L(aten.relu.default)(pre)
    low = dtype in G.LOW_PRECISION
    y = _L(prims.convert_element_type.default)(pre, torch.float32) if low else pre
    mul, add = _L(aten.mul.Tensor), _L(aten.add.Tensor)
    if act == "gelu":
        out = mul(mul(y, 0.5), add(_L(aten.erf.default)(mul(y, math.sqrt(0.5))), 1.0))
    elif act == "gelu_tanh":
        inner = mul(add(y, mul(mul(mul(y, y), y), 0.044715)), math.sqrt(2.0 / math.pi))
        out = mul(mul(y, 0.5), add(_L(aten.tanh.default)(inner), 1.0))
    elif act == "silu":
        out = mul(y, _L(aten.sigmoid.default)(y))
    else:  # pragma: no cover - the op's schema check rejects it first
        raise ValueError(f"enn::gemm_bias_act: unknown activation {act!r}")
    return _L(prims.convert_element_type.default)(out, dtype) if low else out


def _problem(x, weight, bias, act: str, residual=None) -> G.GemmProblem:
    dtype = x.get_dtype()
    return G.GemmProblem(
        device_type=x.get_device().type,
        dtype=dtype,
        act=act,
        has_bias=bias is not None,
        bias_dtype_matches=bias is None or bias.get_dtype() == dtype,
        autotune=G.autotuning(),
        residual=residual is not None,
        k=_static(weight.get_size()[1]),
    )


def _static(size) -> int | None:
    """A size known at compile time as an int (K = 0 rules out oneDNN), else None."""
    try:
        return int(size)
    except TypeError:
        return None


def _kernel(kernel: str, problem: G.GemmProblem) -> G.GemmKernel:
    return G.GemmKernel(kernel) if kernel else G.select_kernel(problem).kernel


def lower_gemm_bias_act(x, weight, bias, act: str, kernel: str = ""):
    chosen = _kernel(kernel, _problem(x, weight, bias, act))
    size = list(x.get_size())
    n = weight.get_size()[0]
    x2 = _L(aten.view.default)(x, [-1, size[-1]]) if len(size) != 2 else x
    if chosen is G.GemmKernel.CUBLASLT:
        w_t = _L(aten.permute.default)(weight, [1, 0])
        out = compat.fallback_lowering(aten._addmm_activation.default)(
            bias, x2, w_t, beta=1, alpha=1, use_gelu=(act == "gelu_tanh"))
    elif chosen is G.GemmKernel.ONEDNN:
        attr, scalars, algorithm = G.ONEDNN_POSTOP[act]
        out = compat.fallback_lowering(torch.ops.mkldnn._linear_pointwise.default)(
            x2, weight, bias, attr, scalars, algorithm)
    else:
        w_t = _L(aten.permute.default)(weight, [1, 0])
        if bias is None:
            pre = _L(aten.mm.default)(x2, w_t)
        else:
            pre = _L(aten.addmm.default)(bias, x2, w_t)
        out = _activation_ir(pre, act, x.get_dtype())
    if len(size) != 2:
        out = _L(aten.view.default)(out, [*size[:-1], n])
    return out


def lower_gemm_residual(x, weight, bias, residual, kernel: str = ""):
    chosen = _kernel(kernel, _problem(x, weight, bias, "none", residual))
    size = list(x.get_size())
    n = weight.get_size()[0]
    view = _L(aten.view.default)
    x2 = view(x, [-1, size[-1]]) if len(size) != 2 else x
    r2 = view(residual, [-1, n]) if len(size) != 2 else residual
    w_t = _L(aten.permute.default)(weight, [1, 0])
    add = _L(aten.add.Tensor)
    if chosen is G.GemmKernel.ADDMM:
        out = _L(aten.addmm.default)(r2 if bias is None else add(r2, bias), x2, w_t)
    else:
        pre = _L(aten.mm.default)(x2, w_t) if bias is None else _L(aten.addmm.default)(bias, x2, w_t)
        out = add(pre, r2)
    if len(size) != 2:
        out = view(out, [*size[:-1], n])
    return out


# op -> its lowering (collected by enn_backend.lowerings)
LOWERINGS = {
    torch.ops.enn.gemm_bias_act.default: lower_gemm_bias_act,
    torch.ops.enn.gemm_residual.default: lower_gemm_residual,
}
