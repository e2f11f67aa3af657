"""Where a mask or bias comes from: what decides which kernels may take it.

:func:`keep_structure` reads what a boolean keep-mask built in the graph is made of (causal /
window constants and a ``[B, Tk]`` key-padding gather, as transformers' ``masking_utils`` builds
them); :func:`tensor_provenance` describes a mask tensor left to the kernels. :func:`finite_bias`
(it cannot hold -inf, so no row is fully masked) and :func:`may_saturate` (it may hold
``finfo.min``-sized values, so a row may be *saturated*: see custom_ops/attention/masks.py
``saturated_counts``) read an additive bias's provenance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from ... import compat
from ...custom_ops.attention import SATURATED
from ...fx_utils import CONVERT, VIEWS, is_call, shape, tensor_dtype, val
from ..manager import ModuleState
from .constants import Constants, Dims, band_of
from .match import _fill, scalar

aten = torch.ops.aten


# ----------------------------------------------------------------------------- provenance of keep-masks
@dataclass(frozen=True)
class KeepStructure:
    """What a boolean keep-mask computed in the graph amounts to: the band of its constant factors
    and, optionally, a key-padding vector ``[B, Tk]`` (key ``j`` of batch ``b`` kept where true)."""

    band: tuple[str, int]  # ('none'|'causal'|'window', w)
    key_padding: Optional[fx.Node] = None

    def describe(self) -> str:
        kind, w = self.band
        parts = [] if kind == "none" else [f"window {w}" if kind == "window" else "causal"]
        return " + ".join(parts + ["key padding [B, Tk]"] * (self.key_padding is not None)) or "no mask"


_AND = (aten.bitwise_and.Tensor, aten.logical_and.default)
_THROUGH = (aten.expand.default, aten.alias.default, aten.clone.default)  # keep right-aligned broadcasting


def _factors(n: Any, out: list[fx.Node]) -> None:
    """The factors of a conjunction (HF's ``and_masks``, ``a & b``), through broadcasts and bool casts."""
    while is_call(n, *_THROUGH) or (is_call(n, CONVERT) and n.args[1] == torch.bool):
        n = n.args[0]
    if is_call(n, *_AND):
        for a in n.args:
            _factors(a, out)
    else:
        out.append(n)


def _is_arange(v: Optional[torch.Tensor], length: int, dim: int) -> bool:
    """``v`` is ``arange(length)`` laid along axis ``dim`` of a 4-D broadcast shape."""
    if v is None or v.dim() != 4 or v.is_floating_point() or v.dtype == torch.bool:
        return False
    want = [1, 1, 1, 1]
    want[dim] = length
    return list(v.shape) == want and bool((v.reshape(-1) == torch.arange(length)).all())


def _key_padding(leaf: fx.Node, batch: Any, tk: int, ev: Constants) -> tuple[Optional[fx.Node], str]:
    """(vector, "") if ``leaf`` is HF's ``padding_mask_function``: ``vector[b_idx, kv_idx]`` with
    ``b_idx`` / ``kv_idx`` the aranges of the batch and key axes; else (None, why not)."""
    if not is_call(leaf, aten.index.Tensor) or len(leaf.args[1]) != 2 or any(i is None for i in leaf.args[1]):
        what = f"computed by {leaf.target.__name__}" if leaf.op == "call_function" else f"read from {leaf.op} {leaf.name}"
        return None, f"a factor {what} depends on tensors other than a key-padding vector"
    vec, (bi, ki) = leaf.args[0], leaf.args[1]
    vs = shape(vec)
    if vs is None or len(vs) != 2 or tensor_dtype(vec) != torch.bool:
        return None, "an indexed mask factor that is not a 2-D boolean vector"
    bv, kv = ev.value(bi), ev.value(ki)
    if not _is_arange(bv, batch, 0):
        return None, "a mask factor indexed by something other than the batch index"
    if _is_arange(kv, tk, 2):
        return None, "a padding vector indexed by query position (not a key-padding mask)"
    if not _is_arange(kv, tk, 3):
        return None, "a padding vector indexed by something other than the key position (offset or data)"
    if tuple(vs) != (batch, tk):
        return None, f"padding vector of shape {tuple(vs)}, not [B, Tk] = [{batch}, {tk}]"
    return vec, ""


def keep_structure(cond: fx.Node, dims: Dims, batch: Any, state: Optional[ModuleState]
                   ) -> tuple[Optional[KeepStructure], str]:
    """(structure, "") of a boolean keep-mask ``[.., Tq, Tk]`` built in the graph, or (None, why not).

    The mask must be a conjunction whose factors are constants (``arange`` compares: causal,
    sliding window, all-true) and at most one key-padding gather ``vector[b_idx, kv_idx]`` (what
    transformers' ``masking_utils`` builds from the ``[B, T]`` attention mask). Anything else --
    a factor reading other data, a padding vector indexed by query position, an ``or`` -- is
    arbitrary."""
    tq, tk = dims.tq, dims.tk
    if not all(isinstance(d, int) for d in (tq, tk, batch)):
        return None, "dynamic shapes: mask provenance is read for fixed lengths only"
    factors: list[fx.Node] = []
    _factors(cond, factors)
    ev = Constants(state)
    padding: Optional[fx.Node] = None
    with compat.real_tensor_mode():  # the pass runs under the graph's fake mode
        keep = torch.ones(tq, tk, dtype=torch.bool)
        for f in factors:
            cv = ev.value(f) if isinstance(f, fx.Node) else None
            if cv is not None:
                if cv.dtype != torch.bool or cv.dim() > 4:
                    return None, "a constant mask factor that is not a boolean [.., Tq, Tk] tensor"
                if cv.dim() > 2:  # the same for every batch and head (a constant folded after its expand)
                    flat = cv.reshape(-1, *cv.shape[-2:])
                    if not bool((flat == flat[:1]).all()):
                        return None, "a constant mask factor that varies over batch or heads"
                    cv = flat[0]
                try:
                    keep = keep & cv
                except RuntimeError:
                    return None, f"a constant mask factor of shape {tuple(cv.shape)} does not broadcast to [{tq}, {tk}]"
                continue
            if padding is not None:
                return None, "more than one data-dependent mask factor"
            padding, why = _key_padding(f, batch, tk, ev)
            if padding is None:
                return None, why
        band = band_of(keep.expand(tq, tk), tq, tk)
    if band is None:
        return None, "the constant part of the mask is neither causal nor a sliding window"
    if ev.reads:
        return None, "a mask read from a module buffer (guarded elsewhere)"
    return KeepStructure(band, padding), ""


def _number(n: Any, ev: Constants) -> Optional[float]:
    v = ev.value(n) if isinstance(n, fx.Node) else None
    if v is not None and v.numel() == 1 and v.is_floating_point():
        return float(v)
    return scalar(n)


def additive_mask_fill(n: fx.Node, state: Optional[ModuleState]) -> Optional[float]:
    """The fill of the additive mask ``where(keep, 0, fill)`` transformers' ``eager_mask`` builds
    (-inf or a ``finfo.min``-sized number; ``keep`` is ``n.args[0]``), None for any other tensor."""
    if not is_call(n, aten.where.self):
        return None
    ev = Constants(state)
    with compat.real_tensor_mode():
        return _fill(_number(n.args[2], ev)) if _number(n.args[1], ev) == 0.0 else None


def tensor_provenance(n: fx.Node, dims: Dims, batch: Any, state: Optional[ModuleState]) -> str:
    """What a mask tensor left to the kernels is made of: a boolean keep-mask, or the additive
    ``where(keep, 0, fill)`` transformers' ``eager_mask`` builds (``finfo.min`` fill), described
    by :func:`keep_structure`; or "arbitrary" and why; "" for a tensor that is not such a mask."""
    cond, fill = n, ""
    if tensor_dtype(n) != torch.bool:
        value = additive_mask_fill(n, state)
        if value is None:
            return ""  # not a mask: a bias (learned, relative positions, HF's (1 - mask) * finfo.min)
        cond, fill = n.args[0], (", -inf fill" if value == float("-inf") else ", finfo.min fill")
    ks, why = keep_structure(cond, dims, batch, state)
    return ks.describe() + fill if ks is not None else f"arbitrary ({why})"



# ----------------------------------------------------------------------------- where a bias comes from
# Ops a bias may be built with and stay finite (given finite inputs): shape ops and casts.
_FINITE_SHAPE_OPS = VIEWS | {CONVERT, aten.expand.default, aten.clone.default, aten.unsqueeze.default,
                             aten.slice.Tensor, aten.permute.default, aten.squeeze.dim, aten.lift_fresh_copy.default}


def finite_bias(n: Any, depth: int = 0) -> bool:
    """Whether an additive bias provably holds no -inf / NaN, so no score row can be fully masked.

    Accepted: finite constants (also small tensor constants), integer / boolean tensors
    (attention masks), shape ops and casts of those, ``where`` between finite values, and a 0/1
    mask scaled and shifted by finite numbers (HF's ``(1 - mask) * finfo.min``: attention masks
    hold 0 and 1). Anything else -- a learned bias, a user tensor, a ``-inf`` fill -- is not, and
    keeps enn::attention's dead-row handling.
    """
    if isinstance(n, bool):
        return True
    if isinstance(n, (int, float)):
        return math.isfinite(n)
    if not isinstance(n, fx.Node) or depth > 32:
        return False
    v = val(n)
    if isinstance(v, torch.Tensor) and not v.is_floating_point() and not v.is_complex():
        return True  # integer / boolean values are finite
    if n.op == "get_attr":  # a constant the traced code made (transformers' `torch.tensor(0.0)` fill)
        c = getattr(n.graph.owning_module, str(n.target), None)
        if not isinstance(c, torch.Tensor) or c.numel() > 1024:
            return False
        with compat.real_tensor_mode():  # the pass runs under the graph's fake mode
            return bool(torch.isfinite(c).all())
    if n.op != "call_function":
        return False
    t = n.target
    if t in _FINITE_SHAPE_OPS:
        return finite_bias(n.args[0], depth + 1)
    if t in (aten.full.default, aten.scalar_tensor.default):
        return finite_bias(n.args[1] if t is aten.full.default else n.args[0], depth + 1)
    if t is aten.where.self:
        return finite_bias(n.args[1], depth + 1) and finite_bias(n.args[2], depth + 1)
    if t in (aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.rsub.Scalar, aten.rsub.Tensor, aten.div.Tensor):
        a, b = n.args[0], n.args[1]
        scalars = [x for x in (a, b) if scalar(x) is not None]
        if not scalars:  # tensor with tensor: finite when bounded (ALiBi's slopes x positions)
            return magnitude_bound(n) is not None
        if not all(math.isfinite(scalar(x)) for x in scalars):
            return False
        if t is aten.div.Tensor and scalar(b) in (None, 0.0):
            return False
        return all(finite_bias(x, depth + 1) for x in (a, b) if scalar(x) is None)
    return magnitude_bound(n) is not None


# The largest magnitude an integer / boolean tensor of each dtype can hold.
_INT_BOUND = {torch.bool: 1.0, torch.uint8: 255.0, torch.int8: 128.0, torch.int16: 2.0 ** 15,
              torch.int32: 2.0 ** 31, torch.int64: 2.0 ** 63}
_BOUND_THROUGH = _FINITE_SHAPE_OPS - {CONVERT}


def magnitude_bound(n: Any, depth: int = 0) -> Optional[float]:
    """An upper bound on ``|x|`` for every element of ``n``, proved from its provenance; None when
    there is none (a learned bias, a user tensor, an op not covered).

    Bounded: numbers; integer / boolean tensors (by their dtype's range: an attention mask, or
    positions counted from one with ``cumsum``); constant subgraphs (evaluated at compile time
    from constants alone, no module buffer: BLOOM's ALiBi slopes ``pow(base, arange)``); shape ops;
    casts that do not overflow; ``where``; ``+``, ``-``, ``*`` of bounded operands and division by
    a nonzero number. A bound is a value bound: a tensor with one has no gradient."""
    if isinstance(n, bool):
        return 1.0
    if isinstance(n, (int, float)):
        return abs(float(n)) if math.isfinite(n) else None
    if not isinstance(n, fx.Node) or depth > 32:
        return None
    v = val(n)
    if not isinstance(v, torch.Tensor) or v.is_complex():
        return None
    if not v.is_floating_point():
        return _INT_BOUND.get(v.dtype)
    top = torch.finfo(v.dtype).max
    c = Constants(None).value(n)  # constants alone: no buffer a later call could change
    if c is not None:
        with compat.real_tensor_mode():
            b = float(c.abs().max()) if c.numel() else 0.0
        return b if math.isfinite(b) else None
    if n.op != "call_function":
        return None
    t, args = n.target, n.args

    def bound(x: Any) -> Optional[float]:
        return magnitude_bound(x, depth + 1)

    if t in _BOUND_THROUGH:
        b = bound(args[0])
    elif t is CONVERT:  # rounding to the new dtype moves a value by less than 1%
        b = bound(args[0])
        b = None if b is None else b * 1.01
    elif t in (aten.full.default, aten.scalar_tensor.default):
        b = bound(args[1] if t is aten.full.default else args[0])
    elif t is aten.where.self:
        a, c2 = bound(args[1]), bound(args[2])
        b = None if a is None or c2 is None else max(a, c2)
    elif t in (aten.neg.default, aten.abs.default):
        b = bound(args[0])
    elif t in (aten.add.Tensor, aten.sub.Tensor):
        alpha = abs(float(n.kwargs.get("alpha", 1)))
        a, c2 = bound(args[0]), bound(args[1])
        b = None if a is None or c2 is None else a + alpha * c2
    elif t is aten.mul.Tensor:
        a, c2 = bound(args[0]), bound(args[1])
        b = None if a is None or c2 is None else a * c2
    elif t is aten.div.Tensor:
        d, a = scalar(args[1]), bound(args[0])
        b = None if not d or a is None else a / abs(d)
    else:
        b = None
    return b if b is not None and b <= top else None  # past the dtype's range: an infinity


def may_saturate(n: Any, depth: int = 0) -> bool:
    """Whether a (provably finite) bias may hold values at or below ``SATURATED`` -- HF's
    ``finfo.min`` masks do -- so that a row whose every key is masked is *saturated*: eager's
    softmax is uniform there (see custom_ops/attention/masks.py ``saturated_counts``). Looks for a
    constant of that size in the bias's provenance."""
    if isinstance(n, (int, float)) and not isinstance(n, bool):
        return abs(n) >= -SATURATED
    if not isinstance(n, fx.Node) or depth > 32:
        return False
    if n.op == "get_attr":
        c = getattr(n.graph.owning_module, str(n.target), None)
        if not isinstance(c, torch.Tensor) or not c.is_floating_point():
            return False
        with compat.real_tensor_mode():
            return bool((c.abs() >= -SATURATED).any())
    if n.op != "call_function":
        return False
    return any(may_saturate(a, depth + 1) for a in (*n.args, *n.kwargs.values())
               if isinstance(a, (fx.Node, int, float)))
