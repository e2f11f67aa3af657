"""What the masks and bias terms of one attention amount to: :func:`classify`.

A constant mask or bias (evaluated at compile time: :mod:`.constants`) that is causal, a
sliding-window band, or ALiBi's ``slopes[h] * (j - i)`` becomes a flag instead of a tensor. Each
such *pattern family* is one recognizer and one row in :data:`MASK_FAMILIES` or
:data:`BIAS_FAMILIES`. What no family claims stays a tensor: a boolean keep-mask (``-inf``
fill), a ``finfo.min``-filled mask (which adds like a bias), or an additive bias; where a bias
comes from (:mod:`.provenance`) decides which kernels may take it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.fx as fx

from ... import compat
from ...custom_ops.attention import SATURATED
from ...fx_utils import is_call, shape
from ..manager import ModuleState
from .constants import PROBES, Constants, Dims, constant_band
from .match import BiasTerm, MaskTerm
from .provenance import finite_bias, may_saturate

aten = torch.ops.aten


def _additive_keep(cv: torch.Tensor) -> Optional[torch.Tensor]:
    """The keep-mask of an additive 0 / -inf / finfo.min mask (None if it is anything else)."""
    if not cv.is_floating_point():
        return None
    masked = ~torch.isfinite(cv) | (cv <= torch.finfo(cv.dtype).min)
    return (cv == 0) if bool(((cv == 0) | masked).all()) else None


def _relative_positions(rv: Optional[torch.Tensor], tq: int, tk: int) -> Any:
    """'exact' if ``rv`` is ``j - i`` over a [tq, tk] grid (broadcast over leading 1-dims); its
    dtype if it is ``j - i`` rounded to that low-precision dtype (``rel.to(bf16)``: past 256 bf16
    rounds positions, and the user's model computes with the rounded ones); else None."""
    if rv is None or tuple(rv.shape[-2:]) != (tq, tk) or any(d != 1 for d in rv.shape[:-2]):
        return None
    i = torch.arange(tq, device=rv.device).view(tq, 1)
    j = torch.arange(tk, device=rv.device).view(1, tk)
    got = rv.reshape(tq, tk)
    if bool((got.double() == (j - i).double()).all()):
        return "exact"
    if got.is_floating_point() and bool((got == (j - i).to(got.dtype)).all()):
        return got.dtype
    return None



# ----------------------------------------------------------------------------- pattern families
@dataclass(frozen=True)
class Alibi:
    slopes: fx.Node  # [.., H, 1, 1]
    positions: Any  # 'exact', or the dtype the user's code rounds positions to
    term: fx.Node  # the bias term ``slopes * (j - i)``


@dataclass(frozen=True)
class Claim:
    """What a recognizer found in one mask or bias term."""

    band: tuple[str, int] = ("none", 0)  # ('none'|'causal'|'window', w)
    alibi: Optional[Alibi] = None


def band_keep_mask(m: MaskTerm, dims: Dims, ev: Constants) -> Optional[Claim]:
    """A constant boolean keep-mask: causal (``tril``, ``triu``, ``arange`` compares, a causal mask
    buffer), a sliding-window band, or all-true."""
    def keep_of(cv: torch.Tensor) -> Optional[torch.Tensor]:
        return (cv if m.keep_when_true else ~cv) if cv.dtype == torch.bool else None

    band = constant_band(m.cond, dims, ev, keep_of)
    return Claim(band=band) if band is not None else None


def band_additive_mask(b: BiasTerm, dims: Dims, ev: Constants) -> Optional[Claim]:
    """A constant additive mask of 0 and -inf / finfo.min: causal or a band (LLaMA's ``triu``)."""
    band = constant_band(b.node, dims, ev, _additive_keep) if b.factor == 1.0 else None
    return Claim(band=band) if band is not None else None


def alibi_slopes(b: BiasTerm, dims: Dims, ev: Constants) -> Optional[Claim]:
    """ALiBi: ``slopes[h] * (j - i)``, slopes ``[.., H, 1, 1]``, positions a constant."""
    term = b.node
    if b.factor != 1.0 or not is_call(term, aten.mul.Tensor) or not all(isinstance(a, fx.Node) for a in term.args):
        return None
    tq, tk = dims.tq, dims.tk
    for rel, slopes in (term.args, term.args[::-1]):
        ss = shape(slopes)
        if ss is None or len(ss) < 3 or ss[-2:] != (1, 1) or ss[-3] != dims.heads or any(d != 1 for d in ss[:-3]):
            continue
        if isinstance(tq, int) and isinstance(tk, int):
            sizes = [(None, tq, tk)]
        elif isinstance(tq, torch.SymInt) and str(tq) == str(tk):
            sizes = [(p, p, p) for p in PROBES]  # dynamic shapes: the same at two probe sizes
        else:
            continue
        kinds = {_relative_positions(ev.value(rel, probe), q, k) for probe, q, k in sizes}
        if len(kinds) == 1 and None not in kinds:
            return Claim(alibi=Alibi(slopes, kinds.pop(), term))
    return None


class Family(NamedTuple):
    name: str
    recognize: Callable[[Any, Dims, Constants], Optional[Claim]]


# ``where(cond, scores, fill)`` terms, then ``scores + term`` terms: the first family that claims
# a term wins.
MASK_FAMILIES: tuple[Family, ...] = (Family("constant keep-mask band", band_keep_mask),)
BIAS_FAMILIES: tuple[Family, ...] = (Family("constant additive mask band", band_additive_mask),
                                     Family("ALiBi slopes", alibi_slopes))


# ----------------------------------------------------------------------------- classification
@dataclass
class Structure:
    """What the masks and bias terms of one match amount to."""

    causal: bool = False
    window: int = 0
    keep: list[MaskTerm] = field(default_factory=list)  # boolean masks with a -inf fill
    floors: list[MaskTerm] = field(default_factory=list)  # masks with a finite (finfo.min) fill: add like a bias
    bias: list[BiasTerm] = field(default_factory=list)  # additive float tensors
    alibi: Optional[Alibi] = None
    relied: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # module buffers a claim read

    def add(self, claim: Claim) -> None:
        kind, w = claim.band
        if kind != "none":
            self.causal, self.window = True, (w if kind == "window" else self.window)
        if claim.alibi is not None:
            self.alibi = claim.alibi

    @property
    def has_bias(self) -> bool:
        return bool(self.bias or self.floors)

    def bias_finite(self) -> bool:
        """The bias provably holds no -inf: no score row can be fully masked."""
        return self.has_bias and all(finite_bias(t.node) for t in self.bias) and all(
            finite_bias(m.cond) for m in self.floors)

    def bias_may_saturate(self) -> bool:
        """A provably finite bias that may hold values at or below SATURATED (finfo.min)."""
        return self.bias_finite() and (any(may_saturate(t.node) for t in self.bias)
                                       or any(m.fill <= SATURATED for m in self.floors))


def _claim(families: tuple[Family, ...], term: Any, dims: Dims, st: Structure, state: Optional[ModuleState]) -> bool:
    for family in families:
        ev = Constants(state)
        claim = family.recognize(term, dims, ev)
        if claim is not None and not (claim.alibi is not None and st.alibi is not None):  # one ALiBi term
            st.add(claim)
            st.relied += ev.reads
            return True
    return False


def classify(masks: list[MaskTerm], bias: list[BiasTerm], dims: Dims, state: Optional[ModuleState]) -> Structure:
    """Sort a match's masks and bias terms into flags (claimed by a family) and tensors."""
    st = Structure()
    with compat.real_tensor_mode():  # constant masks are evaluated on real tensors
        for m in masks:
            if not _claim(MASK_FAMILIES, m, dims, st, state):
                (st.keep if m.fill == float("-inf") else st.floors).append(m)
        for b in bias:
            if not _claim(BIAS_FAMILIES, b, dims, st, state):
                st.bias.append(b)
    return st

