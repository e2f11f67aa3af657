"""``enn::fp8_mm``: a dynamically scaled FP8 GEMM, and the FP8 error bound it is judged by.

``enn::fp8_mm(a, b, bias, recipe, a_fmt, b_fmt)`` is ``a @ b (+ bias)`` for ``a`` ``[M, K]`` and
``b`` ``[K, N]`` of one floating dtype (the GEMM's, e.g. autocast's bf16), computed as

1. each operand scaled into its FP8 format's range from its own absolute maximum, taken now
   (dynamic scaling): ``scale = fmax / max(amax, EPS)``, in fp64 then rounded to fp32 as
   torchao does, ``q = clamp(x * scale, -fmax, fmax)`` cast to the format (round to nearest);
2. ``torch._scaled_mm(q_a, q_b, 1 / scale_a, 1 / scale_b)``: FP8 products accumulated in fp32
   (no fast accumulation), the result in the GEMM's dtype; the bias added after.

Recipes (torchao's ``Float8LinearRecipeName``):

``tensorwise``  one scale per operand; forward operands e4m3, a gradient operand e5m2 (its range);
                scales as computed.
``rowwise``     one scale per row of ``a`` and per column of ``b``, i.e. per slice along the
                contraction dimension K, so one outlier costs only its own row's precision;
                every operand e4m3; scales rounded down to a power of two (exact to apply).

The pass (``enn_backend.passes.fp8``) names each operand's format (``a_fmt`` / ``b_fmt``) from its
role in the graph, so one op serves the forward GEMM and both backward GEMMs of a layer; the
backward GEMMs of a linear layer quantize their own operands along their own contraction
dimension, as torchao's rowwise recipe does (for tensorwise a re-scale of the same tensor gives
the same FP8 values as reusing its forward cast).

Safe path (what a pinned node runs, :func:`_safe_path`): the same GEMM in its own dtype,
``addmm(bias, a, b)`` / ``mm(a, b)``: pinning an FP8 GEMM demotes it to the GEMM it replaced.

Reference path (what the guard's eager reference runs, :func:`_reference_path`): FP8 emulated,
the same scales and the same quantization as step 1, then the GEMM of the FP8 values in fp32
(fp64 for fp64 operands: the guard's fp64 judge), the inverse scales applied to its result, the
result rounded to the GEMM's dtype, the bias added after. A correct kernel differs from it only
by the order of its fp32 sums, so the guard's value tolerances apply unchanged and a drift of
the result (a scale off) is a fault; FP8's rounding is not.

Non-finite values: an operand holding NaN or Inf has a NaN or zero scale, and the result is
NaN where it reads that operand (as the high-precision GEMM is NaN/Inf there). A finite operand
always has a finite, non-zero scale (``EPS`` bounds it above by ``fmax / EPS``), so an overflowed
scale can only come from a fault, and shows as NaN/Inf in the result, which the guard screens.

The bound (:func:`error_bound`) states how far a correct FP8 GEMM may be from the exact product.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .pinned import register_reference_path, register_safe_path

RECIPES = ("rowwise", "tensorwise")
FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# Round-to-nearest unit roundoff of each format, 2^-(mantissa bits + 1): e4m3 has 3, e5m2 2.
UNIT_ROUNDOFF = {"e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3}
# Half the spacing of each format's subnormals: the absolute rounding error of a scaled value
# below the smallest normal (e4m3fn: 2^-6, subnormal step 2^-9; e5m2: 2^-14, step 2^-16).
SUBNORMAL_HALF_STEP = {"e4m3": 2.0 ** -10, "e5m2": 2.0 ** -17}
EPS = 1e-12  # torchao's floor on an amax: an all-zero operand gets a finite scale
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def formats_for(recipe: str, a_is_grad: bool, b_is_grad: bool) -> tuple[str, str]:
    """The FP8 format of each operand of a GEMM under ``recipe``: e4m3 everywhere, except a
    gradient operand under ``tensorwise`` (e5m2: gradients need range more than precision)."""
    if recipe not in RECIPES:
        raise ValueError(f"enn::fp8_mm: recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
    grad = "e5m2" if recipe == "tensorwise" else "e4m3"
    return (grad if a_is_grad else "e4m3"), (grad if b_is_grad else "e4m3")


def quantize(x: torch.Tensor, fmt: str, dim: Optional[int], pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, inverse scale)`` of ``x`` in ``fmt``, scaled per slice along ``dim`` (the slices that
    share a scale: one per index of the other dimension) or per tensor (``dim`` None)."""
    f8 = FORMATS[fmt]
    fmax = torch.finfo(f8).max
    x32 = x.float()
    amax = x32.abs().amax() if dim is None else x32.abs().amax(dim=dim, keepdim=True)
    scale = (fmax / torch.clamp(amax.double(), min=EPS)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = torch.clamp(x32 * scale, -fmax, fmax).to(f8)
    return q, scale.reciprocal()


def _check_args(a, b, bias, recipe, a_fmt, b_fmt) -> None:
    op = "enn::fp8_mm"
    torch._check(recipe in RECIPES, lambda: f"{op}: recipe must be one of {RECIPES}, got {recipe!r}")
    torch._check(a_fmt in FORMATS and b_fmt in FORMATS, lambda: f"{op}: formats must be in {tuple(FORMATS)}")
    torch._check(a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0],
                 lambda: f"{op}: a[M, K] and b[K, N] disagree: {tuple(a.shape)} vs {tuple(b.shape)}")
    torch._check(a.dtype == b.dtype and a.dtype in SUPPORTED_DTYPES, lambda: f"{op}: a and b must share a float dtype")
    if bias is not None:
        torch._check(bias.dim() == 1 and bias.shape[0] == b.shape[1], lambda: f"{op}: bias must be [N]")


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, recipe: str, a_fmt: str, b_fmt: str) -> torch.Tensor:
    """``a @ b`` as the module doc says (no bias), in ``a``'s dtype."""
    rowwise = recipe == "rowwise"
    qa, ia = quantize(a, a_fmt, 1 if rowwise else None, pow2=rowwise)  # [M, 1]: one scale per row
    qb, ib = quantize(b, b_fmt, 0 if rowwise else None, pow2=rowwise)  # [1, N]: one scale per column
    qb = qb.t().contiguous().t()  # the kernel reads b column-major
    return torch._scaled_mm(qa.contiguous(), qb, scale_a=ia, scale_b=ib, out_dtype=a.dtype, use_fast_accum=False)


@torch.library.custom_op("enn::fp8_mm", mutates_args=())
def fp8_mm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], recipe: str, a_fmt: str,
           b_fmt: str) -> torch.Tensor:
    """``a @ b + bias`` as a dynamically scaled FP8 GEMM (see the module doc)."""
    _check_args(a, b, bias, recipe, a_fmt, b_fmt)
    out = fp8_matmul(a, b, recipe, a_fmt, b_fmt)
    return out if bias is None else out + bias.to(out.dtype)


@fp8_mm.register_fake
def _fp8_mm_fake(a, b, bias, recipe, a_fmt, b_fmt):
    _check_args(a, b, bias, recipe, a_fmt, b_fmt)
    return a.new_empty((a.shape[0], b.shape[1]))


def _setup_context(ctx, inputs, output) -> None:
    a, b, bias, recipe, a_fmt, b_fmt = inputs
    ctx.recipe, ctx.a_fmt, ctx.b_fmt = recipe, a_fmt, b_fmt
    ctx.has_bias = bias is not None
    ctx.save_for_backward(a, b)


def _backward(ctx, grad):
    """The gradients as FP8 GEMMs of the same recipe: ``grad @ b.T`` and ``a.T @ grad``, the
    incoming gradient in the recipe's gradient format."""
    a, b = ctx.saved_tensors
    g_fmt = formats_for(ctx.recipe, True, False)[0]
    ga = gb = gbias = None
    if ctx.needs_input_grad[0]:
        ga = fp8_mm(grad, b.t(), None, ctx.recipe, g_fmt, ctx.b_fmt)
    if ctx.needs_input_grad[1]:
        gb = fp8_mm(a.t(), grad, None, ctx.recipe, ctx.a_fmt, g_fmt)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        gbias = grad.sum(0)
    return ga, gb, gbias, None, None, None


fp8_mm.register_autograd(_backward, setup_context=_setup_context)


@register_safe_path("enn.fp8_mm.default")
def _safe_path(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], recipe: str, a_fmt: str,
               b_fmt: str) -> torch.Tensor:
    """What a pinned enn::fp8_mm runs: the GEMM it replaced, in its own dtype."""
    return torch.mm(a, b) if bias is None else torch.addmm(bias.to(a.dtype), a, b)


@register_reference_path("enn.fp8_mm.default")
def _reference_path(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], recipe: str, a_fmt: str,
                    b_fmt: str) -> torch.Tensor:
    """What the guard's reference runs for enn::fp8_mm: FP8 emulated (the module doc), in ``a``'s dtype."""
    rowwise = recipe == "rowwise"
    qa, ia = quantize(a, a_fmt, 1 if rowwise else None, pow2=rowwise)
    qb, ib = quantize(b, b_fmt, 0 if rowwise else None, pow2=rowwise)
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    out = ((qa.to(acc) @ qb.to(acc)) * ia.to(acc) * ib.to(acc)).to(a.dtype)
    return out if bias is None else out + bias.to(out.dtype)


# --------------------------------------------------------------------------- the FP8 bound
def error_bound(a: torch.Tensor, b: torch.Tensor, recipe: str, a_fmt: str, b_fmt: str) -> torch.Tensor:
    """A bound, per output element, on ``|fp8_mm(a, b) - a @ b|`` (exact product) for a correct
    FP8 GEMM on these operands at the scales this call uses; fp64, ``[M, N]``.

    With ``u`` a format's unit roundoff (e4m3 2^-4, e5m2 2^-3), ``eta`` half its subnormal step
    (e4m3 2^-10, e5m2 2^-17) and ``s`` an operand's scale for the element (per tensor, or per
    row of ``a`` / column of ``b``), a quantized operand is ``x' = x (1 + d) + e / s`` with
    ``|d| <= u`` and ``|e| <= eta`` (one of the two, so the sum bounds both). Summing the products
    over K, then fp32 accumulation (``gamma_K = K u32 / (1 - K u32)``) and the rounding of the
    result to its dtype (``u_out``)::

        |c' - c| <= (u_a + u_b + u_a u_b) (|a| @ |b|)
                    + (1 + u_b) eta_a / s_a (1 @ |b|) + (1 + u_a) eta_b / s_b (|a| @ 1)
                    + K eta_a eta_b / (s_a s_b)
                    + gamma_K (|a'| @ |b'|) + u_out |c'|

    the last two with ``|a'| <= |a| (1 + u_a) + eta_a / s_a`` (likewise ``b'``). This is a worst
    case: rounding errors of random signs grow as sqrt(K), so typical errors are far below it.
    It bounds what FP8 itself may do; a result beyond it is a faulty kernel, not FP8 rounding.
    """
    ua, ub = UNIT_ROUNDOFF[a_fmt], UNIT_ROUNDOFF[b_fmt]
    ea, eb = SUBNORMAL_HALF_STEP[a_fmt], SUBNORMAL_HALF_STEP[b_fmt]
    rowwise = recipe == "rowwise"
    _, ia = quantize(a, a_fmt, 1 if rowwise else None, pow2=rowwise)
    _, ib = quantize(b, b_fmt, 0 if rowwise else None, pow2=rowwise)
    A, B = a.double().abs(), b.double().abs()
    ia, ib = ia.double(), ib.double()  # 1 / s
    k = a.shape[1]
    ones_a, ones_b = torch.ones_like(A), torch.ones_like(B)
    rounding = (ua + ub + ua * ub) * (A @ B) + (1 + ub) * ea * ia * (ones_a @ B) + (1 + ua) * eb * ib * (A @ ones_b)
    rounding = rounding + k * ea * eb * ia * ib
    u32 = 2.0 ** -24
    gamma = k * u32 / (1 - k * u32)
    Aq, Bq = A * (1 + ua) + ea * ia, B * (1 + ub) + eb * ib
    u_out = torch.finfo(a.dtype).eps / 2
    exact = a.double() @ b.double()
    return rounding + gamma * (Aq @ Bq) + u_out * (exact.abs() + rounding)


@functools.lru_cache(maxsize=64)
def cpu_scaled_mm_works(dtype: torch.dtype, recipe: str) -> tuple[bool, str]:
    """Whether this torch's CPU ``_scaled_mm`` runs the recipe's GEMM with ``dtype`` results:
    (True, "") or (False, why). Probed once per process on a 16 x 16 x 16 GEMM."""
    return probe(torch.device("cpu"), dtype, recipe)


def probe(device: torch.device, dtype: torch.dtype, recipe: str) -> tuple[bool, str]:
    """Run a 16 x 16 x 16 FP8 GEMM of ``recipe`` (forward and gradient formats) on ``device``."""
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(16, 16, generator=g).to(device, dtype)
        b = torch.randn(16, 16, generator=g).to(device, dtype)
        for fa, fb in {formats_for(recipe, False, False), formats_for(recipe, True, False)}:
            out = fp8_matmul(a, b, recipe, fa, fb)
            if not bool(torch.isfinite(out).all()) or out.dtype != dtype:
                return False, f"torch._scaled_mm gave non-finite or {out.dtype} results ({fa} x {fb})"
    except (RuntimeError, TypeError, NotImplementedError, AttributeError) as exc:
        return False, f"torch._scaled_mm raised {type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}"
    return True, ""


def OPCHECK_SAMPLES() -> dict:
    """Samples for tests/test_opcheck.py: both recipes, bf16 and fp32, with and without bias."""
    g = torch.Generator().manual_seed(0)

    def t(*shape, dtype=torch.float32, grad=False):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad)

    samples = []
    for dtype in (torch.float32, torch.bfloat16):
        for recipe in RECIPES:
            samples.append(((t(32, 16, dtype=dtype, grad=True), t(16, 48, dtype=dtype, grad=True),
                             t(48, dtype=dtype, grad=True), recipe, "e4m3", "e4m3"), {}))
            samples.append(((t(16, 32, dtype=dtype), t(32, 16, dtype=dtype), None, recipe,
                             *formats_for(recipe, True, False)), {}))
    return {"enn::fp8_mm": samples}
