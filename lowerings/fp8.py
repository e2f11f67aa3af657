"""Lowering of ``enn::fp8_mm`` (``enn_backend.custom_ops.fp8``): the dynamic quantization of both
operands as Inductor IR, and the FP8 GEMM through Inductor's lowering of ``aten._scaled_mm``.

What it computes is what the op's eager kernel (``custom_ops.fp8.fp8_matmul``) computes, step for
step, with the same dtypes:

1. per operand ``x`` (``a`` scaled per row under ``rowwise``, per tensor under ``tensorwise``;
   ``b`` per column / per tensor): ``x32 = float32(x)``, ``amax = max |x32|`` over the slice,
   ``scale = float32(fmax * (1 / max(float64(amax), EPS)))`` (fp64 as eager's ``fmax / t``, which is
   ``t.reciprocal() * fmax``), under ``rowwise`` ``scale = exp2(floor(log2(scale)))``, then
   ``q = fp8(clamp(x32 * scale, -fmax, fmax))`` and the inverse scale ``1 / scale`` (fp32);
2. ``aten._scaled_mm(q_a, q_b, 1 / scale_a, 1 / scale_b, out_dtype=a.dtype,
   use_fast_accum=False)`` with ``q_a`` row-major and ``q_b`` column-major (what the GEMM reads;
   Inductor's lowering checks it): ``q_b`` is computed as ``[N, K]`` contiguous and viewed as its
   transpose, so the transposed copy of ``b`` is the quantizing kernel's own store;
3. the bias, if any, added to the result in the result's dtype.

Steps 1 and 3 are Inductor reduction and pointwise IR: the scheduler generates each operand's
amax and its scale, clamp and cast as fused kernels (on the CPU the quantization of several
operands of a graph shares one kernel), fused with the op that produced the operand where it
can, and the bias add with what reads the result. Step 2 is whatever Inductor's
``tuned_scaled_mm`` picks: cuBLAS or its Triton templates on a GPU; on a CPU its only choice, the
extern call of ``at::_scaled_mm_out`` (torch's CPU FP8 GEMM). Without this lowering the op is an
extern call whose eager body runs each quantization step as its own ATen kernel.

One quantization per value and graph (:class:`_Shared`). GEMMs of one graph that read the same
value quantize it once: the q, k and v projections (and gate and up) of a transformer layer
read one normed activation, and their weight-gradient GEMMs read it again, transposed. Two calls
share an operand's FP8 values and inverse scale when they quantize the same graph value (the
same node of the graph, so the same elements in the same order) in the same format, scaling and
orientation. Under ``tensorwise`` the scale is one amax over all elements, whatever their order,
so two calls that read the same stored elements in different orders -- a gradient ``g`` in its
input-gradient GEMM and ``g.T`` in its weight-gradient GEMM -- share the amax and scale, and each
casts in its own layout. Shared or not, each GEMM gets the values it would get alone: sharing
changes no result, only how many kernels compute it.

On the CPU the result is the eager op's bit for bit (tests/test_fp8.py). On a GPU the
quantization is the same arithmetic in the same dtypes (its log2 and exp2 from Triton's math
library rather than eager's), and a Triton template may sum the fp32 products in another order
than cuBLAS: differences the guard's FP8 reference (``custom_ops.fp8``) already allows.

Fallback: where a call cannot be lowered like that on the running torch (no ``_scaled_mm``
lowering, an FP8 dtype Inductor cannot generate code for on the device, an operand dtype the op
does not take, or ``tuned_scaled_mm`` refusing the call), the op becomes the extern call of its
eager kernel (Inductor's ``FallbackKernel``, as an enn op without a lowering), always correct,
logged at INFO once per reason. A pinned FP8 GEMM is an ``enn::pinned`` node, not this op: this
lowering never sees it.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Optional

import torch

from enn_backend import compat
from enn_backend.custom_ops import fp8 as F8
from enn_backend.report import Count, report

log = logging.getLogger(__name__)

aten, prims = torch.ops.aten, torch.ops.prims
OP = torch.ops.enn.fp8_mm.default
F8_MIN_CAPABILITY = (8, 9)  # Triton's float8_e4m3fn casts (fp8e4nv): Ada, Hopper and later

_logged: set[str] = set()
_lock = threading.Lock()


def _L(op):
    return compat.inductor_lowering(op)


def _cast(x, dtype: torch.dtype):
    return x if x.get_dtype() == dtype else _L(prims.convert_element_type.default)(x, dtype)


def _log_once(reason: str) -> None:
    with _lock:
        if reason in _logged:
            return
        _logged.add(reason)
    log.info("enn: enn::fp8_mm runs as an extern kernel call (not lowered): %s", reason)


def fallback_reasons() -> frozenset[str]:
    """Every reason this process's compiles left an enn::fp8_mm to the extern op (logged once each)."""
    with _lock:
        return frozenset(_logged)


def _scale(x, fmt: str, dim: Optional[int], pow2: bool):
    """The scale of ``x`` in ``fmt`` as IR, exactly ``custom_ops.fp8.quantize``'s: per slice along
    ``dim`` (kept as a size-1 dimension) or per tensor (``dim`` None, 0-dim)."""
    fmax = torch.finfo(F8.FORMATS[fmt]).max
    ax = _L(aten.abs.default)(_cast(x, torch.float32))
    amax = _L(aten.amax.default)(ax, [] if dim is None else [dim], dim is not None)
    amax64 = _L(aten.clamp_min.default)(_cast(amax, torch.float64), F8.EPS)
    # eager's ``fmax / t`` is ``t.reciprocal() * fmax`` (Tensor.__rtruediv__): two fp64 roundings
    scale = _cast(_L(aten.mul.Tensor)(_L(aten.reciprocal.default)(amax64), fmax), torch.float32)
    if pow2:
        scale = _L(aten.exp2.default)(_L(aten.floor.default)(_L(aten.log2.default)(scale)))
    return scale


def _cast_to_fp8(x, scale, fmt: str):
    """``fp8(clamp(float32(x) * scale, -fmax, fmax))`` as IR."""
    f8 = F8.FORMATS[fmt]
    fmax = torch.finfo(f8).max
    # eager's clamp(v, -fmax, fmax) is min(max(v, -fmax), fmax) (NaN stays NaN); Inductor has it
    # as these two lowerings (aten.clamp is decomposed before lowering)
    q = _L(aten.clamp_max.default)(_L(aten.clamp_min.default)(_L(aten.mul.Tensor)(_cast(x, torch.float32), scale),
                                                              -fmax), fmax)
    return _cast(q, f8)


class _Shared:
    """The quantizations one graph's lowering has built, to hand out again (module doc): FP8
    values and inverse scales by (value, format, scaling, orientation), tensorwise scales by the
    stored elements they were taken over. The values it keys on are kept alive with their
    entries, so an ``id`` is never reused within a graph."""

    _per_graph: "weakref.WeakKeyDictionary[Any, _Shared]" = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self.quantized: dict[tuple, tuple[Any, Any, Any]] = {}  # key -> (value, q, inverse scale)
        self.scales: dict[tuple, tuple[Any, Any]] = {}  # key -> (elements, scale)

    @classmethod
    def of_this_graph(cls) -> "_Shared":
        graph = compat.lowering_graph()
        with _lock:
            return cls._per_graph.setdefault(graph, cls())


def _quantize(x, fmt: str, dim: Optional[int], pow2: bool, transposed: bool = False):
    """``(q, inverse scale)`` of ``x`` (or of its transpose, ``transposed``) as IR, exactly
    ``custom_ops.fp8.quantize``, ``q`` realized row-major: scales per slice along ``dim`` of the
    quantized value (kept as a size-1 dimension) or per tensor (``dim`` None, 0-dim scale). Built
    once per value of the graph (:class:`_Shared`)."""
    shared = _Shared.of_this_graph()
    key = (id(x), transposed, fmt, dim, pow2)
    if key in shared.quantized:
        report().count(Count.FP8_QUANTIZATIONS_SHARED)
        _, q, inv = shared.quantized[key]
        return q, inv
    value = _L(aten.permute.default)(x, [1, 0]) if transposed else x
    scale = None
    elements = compat.ir_elements(x) if dim is None else None
    scale_key = (id(elements), fmt, pow2)
    if elements is not None and scale_key in shared.scales:
        report().count(Count.FP8_SCALES_SHARED)
        scale = shared.scales[scale_key][1]
    if scale is None:
        scale = _scale(value, fmt, dim, pow2)
        scale.realize()  # one amax pass, read by every cast of this value
        if elements is not None:
            shared.scales[scale_key] = (elements, scale)
    q, inv = _cast_to_fp8(value, scale, fmt), _L(aten.reciprocal.default)(scale)
    q, inv = _row_major(q), _row_major(inv)
    shared.quantized[key] = (x, q, inv)
    return q, inv


def _row_major(x):
    """``x`` (fresh IR of this lowering) stored in a buffer of its own, its layout frozen row-major
    (Inductor's default for a new buffer): the strides ``_scaled_mm`` reads it with."""
    x.realize()
    x.freeze_layout()
    return x


def _unsupported(a, b, recipe: str, a_fmt: str, b_fmt: str) -> str:
    """Why this call cannot be lowered here ("" when it can)."""
    try:
        _L(aten._scaled_mm.default)
    except KeyError:
        return f"torch {torch.__version__} has no Inductor lowering of aten._scaled_mm"
    if recipe not in F8.RECIPES or a_fmt not in F8.FORMATS or b_fmt not in F8.FORMATS:
        return f"recipe {recipe!r} or formats {a_fmt!r}, {b_fmt!r} unknown to the lowering"
    dtype = a.get_dtype()
    if dtype not in F8.SUPPORTED_DTYPES or b.get_dtype() != dtype:
        return f"operand dtypes {dtype} x {b.get_dtype()} (lowered: both bf16, fp16 or fp32)"
    if len(a.get_size()) != 2 or len(b.get_size()) != 2:
        return "operands not 2-D"
    device = a.get_device()
    if device is None or device.type not in ("cpu", "cuda"):
        return f"device {device}: FP8 code generation is lowered on cpu and cuda only"
    if device.type == "cuda":
        if torch.version.hip:
            return "ROCm: Inductor's Triton has no float8_e4m3fn / float8_e5m2 casts there"
        if torch.cuda.get_device_capability(device) < F8_MIN_CAPABILITY:
            return (f"{torch.cuda.get_device_name(device)}: Triton's FP8 casts need compute capability "
                    f"{F8_MIN_CAPABILITY[0]}.{F8_MIN_CAPABILITY[1]}")
    return ""


def _fallback(a, b, bias, recipe: str, a_fmt: str, b_fmt: str, reason: str):
    report().count(Count.FP8_NOT_LOWERED)  # every one counted, the reason logged once
    _log_once(reason)
    return compat.fallback_lowering(OP)(a, b, bias, recipe, a_fmt, b_fmt)


def lower_fp8_mm(a, b, bias, recipe: str, a_fmt: str, b_fmt: str):
    """``enn::fp8_mm(a, b, bias, recipe, a_fmt, b_fmt)`` as Inductor IR (the module doc)."""
    why = _unsupported(a, b, recipe, a_fmt, b_fmt)
    if why:
        return _fallback(a, b, bias, recipe, a_fmt, b_fmt, why)
    rowwise = recipe == "rowwise"
    dtype = a.get_dtype()
    n = b.get_size()[1]
    qa, ia = _quantize(a, a_fmt, 1 if rowwise else None, rowwise)  # [M, K]; scale [M, 1] or []
    # b is quantized as its transpose [N, K] (rowwise: one scale per row of it, [N, 1]), stored
    # row-major and read back as [K, N] with strides (1, K): the column-major operand the GEMM
    # reads, written by the quantizing kernel itself (no separate transpose copy)
    qbt, ib = _quantize(b, b_fmt, 1 if rowwise else None, rowwise, transposed=True)
    qb = _L(aten.permute.default)(qbt, [1, 0])
    if rowwise:
        ib = _L(aten.view.default)(ib, [1, n])  # [N, 1] row-major is [1, N] row-major
    try:
        out = _L(aten._scaled_mm.default)(qa, qb, ia, ib, None, None, dtype, False)
    except (RuntimeError, AssertionError, NotImplementedError, TypeError, ValueError) as exc:
        # the quantization built above then has no reader, and Inductor's scheduler drops it
        text = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        return _fallback(a, b, bias, recipe, a_fmt, b_fmt,
                         f"Inductor's lowering of aten._scaled_mm refused it ({type(exc).__name__}: {text})")
    if bias is not None:
        out = _L(aten.add.Tensor)(out, _cast(bias, dtype))
    return out


# op -> its lowering (collected by enn_backend.lowerings)
LOWERINGS = {OP: lower_fp8_mm}
