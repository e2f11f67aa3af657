"""NaN/Inf screens of a graph's outputs, and how a compiled result compares with the reference.

The guard screens the floating outputs of a compiled call for NaN/Inf. An output may be
*allowed* infinities the reference makes at the same places -- an additive ``-inf`` mask
saved for the backward is the common case -- but never NaN: an allowance names the signs of
infinity it tolerates (``"-inf"``, ``"+inf"`` or ``"inf"`` for both), learned from a
reference run whose non-finite values were exactly those infinities. A NaN is screened on
every checked call, whatever was seen before.
"""

from __future__ import annotations

import math
from typing import Any

import torch

INF = float("inf")

# allowance -> the elements it still flags (a bool tensor, True where the value is not allowed)
_FLAGGED = {
    "-inf": lambda t: ~(t < INF),  # NaN and +inf
    "+inf": lambda t: ~(t > -INF),  # NaN and -inf
    "inf": torch.isnan,
}


def outputs(outs: Any) -> list:
    """A graph's outputs as a list (a boxed graph returns a list or tuple, a bare one a tensor)."""
    return outs if isinstance(outs, (list, tuple)) else [outs]


def _floating(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() > 0


# The allowance of an attention kernel's saved state (its log-sum-exp): not screened. Only the
# matching backward kernel reads it, and the backward's results are screened; its padding and
# the rows that keep no key hold infinities by the kernel's own convention, which enn's math
# (the reference) lays out per kernel, not bit for bit -- so, as in a value check, it is judged
# by its layout alone (screen.diverging), never by its NaN/Inf.
UNSCREENED = "kernel state"


def _split(flat: list, allowed: dict[int, str]) -> tuple[list[int], list[int]]:
    """(outputs screened in full, outputs with an allowance); UNSCREENED outputs in neither."""
    full = [i for i, t in enumerate(flat) if _floating(t) and i not in allowed]
    partial = [i for i, a in allowed.items() if a != UNSCREENED and i < len(flat) and _floating(flat[i])]
    return full, partial


def _totals(flat: list, idx: list[int], peak: bool = False) -> list[torch.Tensor]:
    """One fp32 total per output, combined per device and dtype (NaN + x = NaN, Inf - Inf = NaN):
    a finite total means every output is finite. By default the cheapest: the L1 norm on CUDA,
    where one _foreach_norm launches a few kernels for all outputs of a dtype instead of one
    kernel per output, the sum on CPU; either can overflow fp32 on finite values, which the
    caller then checks exactly. ``peak``: the largest magnitude, which never overflows."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for i in idx:
        groups.setdefault((flat[i].device, flat[i].dtype), []).append(flat[i])
    totals = []
    for (device, _), ts in groups.items():
        if device.type == "cuda":
            parts = torch._foreach_norm(ts, INF if peak else 1, dtype=torch.float32)
        elif peak:
            parts = [torch.linalg.vector_norm(t, INF, dtype=torch.float32) for t in ts]
        else:
            parts = [t.sum(dtype=torch.float32) for t in ts]
        totals.append(_peak(parts) if peak else _sum(parts))
    return totals


def _sum(ts: list[torch.Tensor]) -> torch.Tensor:
    """The sum of 0-dim tensors (a single one as it is: a screen's every op is host time)."""
    return ts[0] if len(ts) == 1 else torch.stack(ts).sum()


def _peak(ts: list[torch.Tensor]) -> torch.Tensor:
    """The largest of 0-dim tensors (a single one as it is)."""
    return ts[0] if len(ts) == 1 else torch.stack(ts).amax()


def nonfinite_flag(flat: list, full: list[int]) -> torch.Tensor:
    """A 0-dim bool tensor, computed where the outputs are (no host sync): True exactly when an
    output of ``full`` holds a NaN or an infinity. It reads the largest magnitude (a max
    reduction carries NaN, as ``amax`` does), which is finite for finite values: unlike a sum,
    it never overflows -- the L1 total of a bf16 ``finfo.min`` mask (BLOOM, T5) does."""
    return ~torch.isfinite(_peak(_totals(flat, full, peak=True)))


def nonfinite_outputs(outs: Any, allowed: dict[int, str] | None = None) -> list[int]:
    """Indices (in the flat output list) of floating outputs holding values they may not hold:
    NaN/Inf, or for an output with an allowance, NaN or an infinity of another sign.

    One fp32 reduction per output screens them with one host sync per device and dtype;
    only when the screen trips (a NaN/Inf, or a sum overflowing) is each output checked exactly.
    """
    flat = outputs(outs)
    allowed = allowed or {}
    full, partial = _split(flat, allowed)
    bad = [i for i in partial if bool(_FLAGGED[allowed[i]](flat[i]).any())]
    if not full or all(math.isfinite(t.item()) for t in _totals(flat, full)):
        return bad
    return sorted(bad + [i for i in full if not bool(torch.isfinite(flat[i]).all())])


def nonfinite_inputs(inputs: list) -> list[int]:
    """Indices of floating inputs holding NaN/Inf."""
    return [i for i, t in enumerate(inputs) if _floating(t) and not bool(torch.isfinite(t).all())]


def single_cuda_device(outs: Any) -> bool:
    """Are all floating outputs on one CUDA device (so they can be screened without a sync)?"""
    devices = {t.device for t in outputs(outs) if isinstance(t, torch.Tensor) and t.is_floating_point()}
    return len(devices) == 1 and next(iter(devices)).type == "cuda"


class LateScreen:
    """The screen of one call's outputs, computed on the GPU and copied to pinned host memory
    behind an event: read back once the event has passed, with no device sync."""

    def __init__(self, outs: Any, allowed: dict[int, str], host: torch.Tensor, call: int) -> None:
        flat = outputs(outs)
        full, partial = _split(flat, allowed)
        flags = [nonfinite_flag(flat, full)] if full else []
        flags += [_FLAGGED[allowed[i]](flat[i]).any() for i in partial]
        self.call, self.host, self.event = call, host, None
        if flags:
            host.copy_(flags[0] if len(flags) == 1 else torch.stack(flags).any(), non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self, wait: bool = False) -> bool | None:
        """True: a value not allowed found; False: clean; None: not known yet (``wait`` blocks instead)."""
        if self.event is None:
            return False
        if not self.event.query():
            if not wait:
                return None
            self.event.synchronize()
        return bool(self.host)


# ----------------------------------------------------------------------- against the reference
def same_nonfinite(a: torch.Tensor, b: torch.Tensor) -> bool:
    """NaN, +inf and -inf at exactly the same places."""
    if a.shape != b.shape:
        return False
    return (torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.isposinf(a), torch.isposinf(b))
            and torch.equal(torch.isneginf(a), torch.isneginf(b)))


# How far the finite values of two runs of one graph may differ and still count as the same
# values: Inductor's fusions reorder reductions, so low precision gets a wide band.
_TOLERANCE = {torch.float16: (1e-2, 1e-2), torch.bfloat16: (5e-2, 5e-2)}
_TOLERANCE_FP32 = (1e-4, 1e-5)  # (rtol, atol)
# Low precision values are also compared as a whole: ||a - b|| <= NORM_RTOL * ||b|| (L2 norms, plus
# NORM_FLOOR_RMS root-mean-square of absolute slack for tensors of values near zero). Each element
# may move by its band, which rounding at a different place and fused, reordered sums need, but
# such differences do not all point one way: they move a tensor by a small share of its norm (about
# 2^-9 per bf16 rounding). A kernel off by a few percent everywhere (a drifted scale: an FP8 GEMM's
# result x1.05) stays inside every element's band and moves the whole tensor by that share.
NORM_RTOL = 2e-2
NORM_FLOOR_RMS = 1e-4


def _tolerance(dtype: torch.dtype, low_precision: bool) -> tuple[float, float]:
    """(rtol, atol) for values of ``dtype``; a graph that computes in fp16/bf16 anywhere gets the
    bf16 band for all its outputs (an fp32 log-sum-exp of bf16 scores is only as exact as they are)."""
    return _TOLERANCE[torch.bfloat16] if low_precision else _TOLERANCE.get(dtype, _TOLERANCE_FP32)


def _norm_band(dtype: torch.dtype, low_precision: bool) -> bool:
    """Whether values of ``dtype`` are also compared as a whole (:data:`NORM_RTOL`): low precision ones."""
    return low_precision or dtype in _TOLERANCE


def finite_close(a: torch.Tensor, b: torch.Tensor, low_precision: bool = False) -> bool:
    """The finite values of ``a`` and ``b`` agree within the tolerance of their dtype (the
    non-finite places are compared by :func:`same_nonfinite`)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    keep = torch.isfinite(a) & torch.isfinite(b)
    return _within(a[keep], b[keep], *_tolerance(a.dtype, low_precision), _norm_band(a.dtype, low_precision))


def _within(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float, whole: bool = False) -> bool:
    """|a - b| <= atol * max(1, max |b|) + rtol * |b| everywhere, computed in fp64 (finite values);
    with ``whole``, also ||a - b|| within :data:`NORM_RTOL` of ||b||."""
    if not b.numel():
        return True
    x, y = a.double(), b.double()
    scale = max(1.0, y.abs().max().item())
    if not bool(torch.isclose(x, y, rtol=rtol, atol=atol * scale).all()):  # isclose: that rule, in one op
        return False
    if not whole:
        return True
    slack = NORM_FLOOR_RMS * math.sqrt(y.numel())
    return (x - y).norm().item() <= NORM_RTOL * y.norm().item() + slack


def _all_finite(a: torch.Tensor, b: torch.Tensor) -> bool:
    """No NaN/Inf in ``a`` or ``b`` (their fp64 sum is finite: fp64 cannot overflow on sums of
    narrower floats; an fp64 sum that overflows reads as non-finite, which only costs the exact path)."""
    return math.isfinite((a.sum(dtype=torch.float64) + b.sum(dtype=torch.float64)).item())


def divergent(out: list, ref: list, idx: list[int]) -> tuple[list[int], list[int]]:
    """Of the outputs ``idx``: (those whose NaN/Inf places differ from the reference's, those
    whose places agree but whose finite values do not)."""
    pattern, values = [], []
    for i in idx:
        a, b = out[i], ref[i]
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or not same_nonfinite(a, b):
            pattern.append(i)
        elif not finite_close(a, b):
            values.append(i)
    return pattern, values


def allowance(ref: torch.Tensor) -> str | None:
    """What an output may hold on later calls, given the reference made ``ref`` there: the signs
    of infinity it holds; None if it holds a NaN (a NaN is never allowed ahead of time)."""
    if bool(torch.isnan(ref).any()):
        return None
    pos, neg = bool(torch.isposinf(ref).any()), bool(torch.isneginf(ref).any())
    return {(True, True): "inf", (True, False): "+inf", (False, True): "-inf"}.get((pos, neg))


def _exact(t: torch.Tensor) -> bool:
    """Integer and boolean values: compared exactly (complex ones are not compared by value)."""
    return not (t.is_floating_point() or t.is_complex())


def same_values(a: Any, b: Any, low_precision: bool = False, by_value: bool = True) -> bool:
    """Same dtype and shape, and for floating values NaN/Inf at the same places and the other
    values within the dtype's tolerance; integer and boolean values equal. ``by_value=False``
    (a forward's integer outputs saved for its backward: indices, counts, block masks, which a
    kernel may lay out differently from eager) compares integers by dtype and shape only."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return a == b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if _exact(a):
        return not by_value or torch.equal(a, b)
    if not a.is_floating_point():
        return True
    if _all_finite(a, b):  # the common case: no NaN/Inf places to compare, no finite values to pick
        return _within(a, b, *_tolerance(a.dtype, low_precision), _norm_band(a.dtype, low_precision))
    return same_nonfinite(a, b) and finite_close(a, b, low_precision)


def diverging(out: list, ref: list, low_precision: bool = False, bookkeeping: frozenset[int] = frozenset(),
              layout_only: frozenset[int] = frozenset()) -> list[int]:
    """Indices of the outputs whose values differ from the reference's (see same_values; the
    outputs in ``bookkeeping`` are compared with ``by_value=False``, those in ``layout_only`` by
    dtype and shape alone)."""
    return [i for i, (a, b) in enumerate(zip(out, ref))
            if not (same_layout(a, b) if i in layout_only else same_values(a, b, low_precision, i not in bookkeeping))]


def same_layout(a: Any, b: Any) -> bool:
    """Same dtype and shape (for tensors; other values equal)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return a == b
    return a.dtype == b.dtype and a.shape == b.shape


def _rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    keep = torch.isfinite(a) & torch.isfinite(b)
    d = a[keep].double() - b[keep].double()
    return float(d.square().mean().sqrt()) if d.numel() else 0.0


def compiled_is_worse(out: torch.Tensor, ref: torch.Tensor, ref64: torch.Tensor, low_precision: bool = False) -> bool:
    """Is the compiled value further from the fp64 run than the reference is? (torch's own
    accuracy rule: RMSE(compiled) > m * RMSE(reference) + atol / 10, m = 2 for fp32 and 3 for
    fp16/bf16, so the reference's own rounding is never held against the compiled code).
    A dtype or shape the reference does not have is always worse."""
    if out.dtype != ref.dtype or out.shape != ref.shape:
        return True
    if _exact(out):
        return _integer_is_worse(out, ref, ref64, 3.0 if low_precision else 2.0)
    if not out.is_floating_point():
        return False
    if not same_nonfinite(out, ref):  # worse when the reference has its NaN/Inf where fp64 does
        return same_nonfinite(ref, ref64.to(ref.dtype))
    m = 3.0 if (low_precision or out.dtype in _TOLERANCE) else 2.0
    atol = _tolerance(out.dtype, low_precision)[1]
    if _rmse(out, ref64) > m * _rmse(ref, ref64) + atol / 10:
        return True
    return _scale_drift(out, ref64) > max(NORM_RTOL / 2, m * _scale_drift(ref, ref64))


def _scale_drift(x: torch.Tensor, exact: torch.Tensor) -> float:
    """How far ``x``, projected onto ``exact``, is from it: |<x, e> / <e, e> - 1| (finite values).
    Rounding, in compiled code or in the reference, scatters values around the exact ones and
    leaves this near 0; a kernel whose result drifted by a factor (a wrong scale: an FP8 GEMM's
    result x1.05) moves it by that factor, while staying inside the RMSE rule above wherever the
    reference's own rounding is large (an FP8 GEMM rounds its operands to 3 mantissa bits)."""
    keep = torch.isfinite(x) & torch.isfinite(exact)
    e = exact[keep].double()
    ee = float(e.dot(e))
    return abs(float(x[keep].double().dot(e)) / ee - 1.0) if ee > 0 else 0.0


def _integer_is_worse(out: torch.Tensor, ref: torch.Tensor, ref64: torch.Tensor, m: float) -> bool:
    """The integer form of the rule above, counting elements instead of an RMSE: the compiled
    value is worse when more of its elements differ from the fp64 run's than m times the
    reference's do. An integer computed from floating-point math (a floor, an argmax, a
    comparison) may differ between two right programs where a value lies on a rounding
    boundary, and the fp64 run says which side is right; an integer the graph computes from
    integers alone is the same in the fp64 run as in the reference, so there any difference
    from the reference is the compiled code's. An fp64 value of another dtype or shape (a
    bitcast of a promoted input) cannot judge: nobody is blamed."""
    if ref64.dtype != ref.dtype or ref64.shape != ref.shape:
        return False
    return int((out != ref64).sum()) > m * int((ref != ref64).sum())
