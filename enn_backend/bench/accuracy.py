"""Is a compiled result as accurate as eager? Judged against an fp64 reference.

The method is the one PyTorch's own benchmark harness uses (``torch/_dynamo/utils.py``
``same`` and ``benchmarks/dynamo/common.py``), written out here so it is readable
and testable on its own. For every tensor of a result (outputs, or loss + gradients):

1. non-finite values: the compiled tensor may hold NaN/Inf only where the fp64
   reference does too; a NaN or Inf that fp64 does not have is a failure;
2. pass if ``allclose(compiled, eager, rtol=tol, atol=tol)``;
3. else pass if ``RMSE(compiled, fp64) <= m * RMSE(eager, fp64) + tol / 10``,
   with ``m = 2`` for fp32 runs and ``m = 3`` for bf16/fp16 runs (the run's compute
   dtype decides, so fp32 gradients of an autocast run get ``m = 3``);
4. without an fp64 reference: pass if the cosine similarity of compiled and eager
   is at least 0.99 (the harness's ``cos_similarity`` mode).

Before any of that, :func:`eager_self_check` runs eager twice: if eager does not
agree with itself within ``tol``, no verdict about a compiled backend means
anything, and the result is marked unreliable instead of pass/fail.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

# Upstream tolerances (HF / TIMM): 1e-3 inference, 1e-2 training; low precision is looser.
TOLERANCES = {
    ("infer", "fp32"): 1e-3,
    ("train", "fp32"): 1e-2,
    ("infer", "bf16"): 1e-2,
    ("train", "bf16"): 2e-2,
    ("infer", "fp16"): 1e-2,
    ("train", "fp16"): 2e-2,
}
COSINE_MIN = 0.99


def tolerance(mode: str, dtype: str) -> float:
    return TOLERANCES[(mode, dtype)]


def multiplier(dtype: str) -> float:
    return 2.0 if dtype in ("fp32", "fp64") else 3.0


@dataclass
class TensorCheck:
    """The verdict on one tensor of a result."""

    index: int
    passed: bool
    method: str  # allclose | rmse | cosine | exact | nonfinite | shape
    rmse_compiled: float = float("nan")
    rmse_eager: float = float("nan")
    cosine: float = float("nan")
    max_abs_diff: float = float("nan")
    detail: str = ""


@dataclass
class Verdict:
    """The verdict on a whole result (every tensor must pass)."""

    passed: bool
    reason: str
    checks: list[TensorCheck] = field(default_factory=list)
    # totals over all floating tensors: sqrt(sum sq err / sum sq ref) against fp64
    rel_error_compiled: float = float("nan")
    rel_error_eager: float = float("nan")

    def worst(self) -> TensorCheck | None:
        failed = [c for c in self.checks if not c.passed]
        if failed:
            return failed[0]
        ratios = [c for c in self.checks if c.method == "rmse"]
        return max(ratios, key=lambda c: c.rmse_compiled / max(c.rmse_eager, 1e-30), default=None)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["checks"] = [asdict(c) for c in self.checks if not c.passed or c.method != "allclose"][:20]
        d["n_tensors"] = len(self.checks)
        return d


def flatten(result: Any) -> list[torch.Tensor]:
    """The tensors of a (nested list / tuple / dict) result, detached, in a fixed order."""
    if isinstance(result, torch.Tensor):
        return [result.detach()]
    if isinstance(result, dict):
        return [t for k in sorted(result, key=str) for t in flatten(result[k])]
    if isinstance(result, (list, tuple)):
        return [t for x in result for t in flatten(x)]
    return []


def rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return math.sqrt(torch.mean(torch.square(a.double() - b.double())).item()) if a.numel() else 0.0


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    denom = (a.norm() * b.norm()).item()
    if denom == 0.0:
        return 1.0 if torch.equal(a, b) else 0.0
    return float((a @ b).item() / denom)


def check_tensor(index: int, compiled: torch.Tensor, eager: torch.Tensor, fp64: torch.Tensor | None, *,
                 tol: float, dtype: str) -> TensorCheck:
    """Judge one tensor (see the module docstring for the rules, in order)."""
    if compiled.shape != eager.shape or (fp64 is not None and fp64.shape != compiled.shape):
        return TensorCheck(index, False, "shape", detail=f"shapes {tuple(compiled.shape)} vs {tuple(eager.shape)}")
    if not compiled.is_floating_point() and not compiled.is_complex():
        same = torch.equal(compiled, eager.to(compiled.device))
        return TensorCheck(index, same, "exact", detail="" if same else "integer/bool tensors differ")
    c = compiled.double()
    e = eager.double().to(c.device)
    r = fp64.double().to(c.device) if fp64 is not None else None
    finite_c = torch.isfinite(c)
    expected_finite = torch.isfinite(r) if r is not None else torch.isfinite(e)
    bad = ~finite_c & expected_finite
    if bool(bad.any()):
        n_nan = int(torch.isnan(c)[bad].sum())
        n_inf = int(bad.sum()) - n_nan
        return TensorCheck(index, False, "nonfinite",
                           detail=f"{n_nan} NaN and {n_inf} Inf where the {'fp64 reference' if r is not None else 'eager result'} is finite")
    both = finite_c & expected_finite
    odd = ~finite_c & ~expected_finite
    if bool(odd.any()):
        ref_vals = (r if r is not None else e)[odd]
        if not torch.equal(torch.nan_to_num(c[odd], nan=0.0), torch.nan_to_num(ref_vals, nan=0.0)):
            return TensorCheck(index, False, "nonfinite", detail="non-finite values differ in kind (NaN vs +-Inf)")
    c, e = c[both], e[both]
    r = r[both] if r is not None else None
    max_abs = float((c - e).abs().max().item()) if c.numel() else 0.0
    if c.numel() == 0 or torch.allclose(c, e, rtol=tol, atol=tol):
        out = TensorCheck(index, True, "allclose", max_abs_diff=max_abs)
        if r is not None:
            out.rmse_compiled, out.rmse_eager = rmse(c, r), rmse(e, r)
        return out
    if r is not None:
        rc, re_ = rmse(c, r), rmse(e, r)
        limit = multiplier(dtype) * re_ + tol / 10.0
        passed = rc <= limit
        return TensorCheck(index, passed, "rmse", rmse_compiled=rc, rmse_eager=re_, max_abs_diff=max_abs,
                           detail="" if passed else f"RMSE vs fp64 {rc:.3g} > {multiplier(dtype):g} x eager's {re_:.3g} + {tol / 10:.3g}")
    cos = cosine(c, e)
    return TensorCheck(index, cos >= COSINE_MIN, "cosine", cosine=cos, max_abs_diff=max_abs,
                       detail="" if cos >= COSINE_MIN else f"cosine similarity {cos:.4f} < {COSINE_MIN}")


def compare(compiled: Any, eager: Any, fp64: Any | None, *, tol: float, dtype: str = "fp32") -> Verdict:
    """Judge a compiled result against eager's and an fp64 reference (``None``: cosine mode)."""
    cs, es = flatten(compiled), flatten(eager)
    rs = flatten(fp64) if fp64 is not None else [None] * len(cs)
    if not (len(cs) == len(es) == len(rs)):
        return Verdict(False, f"result structure differs: {len(cs)} vs {len(es)} vs {len(rs)} tensors")
    checks = [check_tensor(i, c, e, r, tol=tol, dtype=dtype) for i, (c, e, r) in enumerate(zip(cs, es, rs))]
    failed = [c for c in checks if not c.passed]
    verdict = Verdict(not failed, "pass" if not failed else f"tensor {failed[0].index}: {failed[0].method}: {failed[0].detail}",
                      checks)
    if fp64 is not None:
        verdict.rel_error_compiled = relative_error(cs, rs)
        verdict.rel_error_eager = relative_error(es, rs)
    return verdict


def relative_error(results: list[torch.Tensor], refs: list[torch.Tensor | None]) -> float:
    """sqrt(sum of squared errors / sum of squared reference values) over all floating tensors."""
    num = den = 0.0
    for x, r in zip(results, refs):
        if r is None or not x.is_floating_point():
            continue
        x, r = x.double(), r.double().to(x.device)
        ok = torch.isfinite(r)
        if not bool(torch.isfinite(x)[ok].all()):
            return float("inf")
        num += float(torch.sum(torch.square(x[ok] - r[ok])).item())
        den += float(torch.sum(torch.square(r[ok])).item())
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


def eager_self_check(first: Any, second: Any, *, tol: float) -> tuple[bool, str]:
    """Does eager agree with itself (two runs, same inputs and weights)?"""
    a, b = flatten(first), flatten(second)
    if len(a) != len(b):
        return False, "eager's two runs return different structures"
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape:
            return False, f"tensor {i}: shapes differ between eager runs"
        if x.is_floating_point():
            if not torch.allclose(x.double(), y.double().to(x.device), rtol=tol, atol=tol, equal_nan=True):
                return False, f"tensor {i}: eager's two runs differ by up to {(x.double() - y.double()).abs().max().item():.3g}"
        elif not torch.equal(x, y):
            return False, f"tensor {i}: eager's two runs differ"
    return True, "eager agrees with itself"


def no_worse(enn: Verdict, inductor: Verdict, slack: float = 1.10) -> tuple[bool, str]:
    """Is enn's accuracy no worse than inductor's on one workload?

    No worse means: enn passes wherever inductor passes, and enn's total relative
    error against fp64 is at most ``slack`` x inductor's (plus 1e-6 absolute, for
    results where both are at rounding level).
    """
    if inductor.passed and not enn.passed:
        return False, f"inductor passes, enn fails ({enn.reason})"
    a, b = enn.rel_error_compiled, inductor.rel_error_compiled
    if math.isnan(a) or math.isnan(b):
        return enn.passed or not inductor.passed, "no fp64 totals; judged by verdicts only"
    if a <= slack * b + 1e-6:
        return True, f"relative error vs fp64: enn {a:.3g}, inductor {b:.3g}"
    return False, f"relative error vs fp64: enn {a:.3g} > {slack:g} x inductor's {b:.3g}"
