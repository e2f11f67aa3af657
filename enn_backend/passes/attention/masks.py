"""What the masks and bias terms of one attention amount to: :func:`classify`.

A mask or bias built from constants (``tril``, ``triu``, ``arange`` compares, LLaMA's additive
``triu`` of ``finfo.min``) or read from a module buffer (nanoGPT's ``tril``) is evaluated at
compile time (:class:`Constants`) -- at two probe lengths under dynamic shapes -- and, when it is
causal, a sliding-window band, or ALiBi's ``slopes[h] * (j - i)``, becomes a flag instead of a
tensor. Each such *pattern family* is one recognizer and one row in :data:`MASK_FAMILIES` or
:data:`BIAS_FAMILIES`. What no family claims stays a tensor: a boolean keep-mask (``-inf``
fill), a ``finfo.min``-filled mask (which adds like a bias), or an additive bias.

Where a bias comes from decides which kernels may take it: :func:`finite_bias` (it cannot hold
-inf, so no row is fully masked) and :func:`may_saturate` (it may hold ``finfo.min``-sized
values, so a row may be *saturated*: see custom_ops/attention.py ``saturated_counts``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.fx as fx

from ... import compat
from ...custom_ops.attention import SATURATED
from ..fx_utils import CONVERT, VIEWS, graph_order, is_call, shape, tensor_dtype, val
from ..manager import ModuleState
from .match import BiasTerm, MaskTerm, _fill, scalar

log = logging.getLogger(__name__)
aten = torch.ops.aten

_EVAL_LIMIT = 1 << 26  # largest constant mask evaluated at compile time (elements)
_PROBES = (16, 23)  # sizes at which a dynamic-shape mask is evaluated (two, so a structure is not a coincidence)


# ----------------------------------------------------------------------------- constant evaluation
def _is_size_symbol(x: fx.Node) -> bool:
    return (x.op == "placeholder" and isinstance(val(x), torch.SymInt)) or is_call(x, aten.sym_size.int)


class Constants:
    """Evaluates subgraphs that depend on constants only, on real tensors, and remembers which
    module buffers (:class:`ModuleState`) the evaluations read: ``reads``, (input index, tensor)."""

    def __init__(self, state: Optional[ModuleState]) -> None:
        self.state = state
        self.reads: list[tuple[int, torch.Tensor]] = []

    def value(self, n: fx.Node, probe: Optional[int] = None) -> Optional[torch.Tensor]:
        """``n`` evaluated (small, static shapes) as a CPU tensor, or None when it is not a constant.

        With ``probe``, symbolic sizes (SymInt placeholders, ``sym_size``) are allowed and each
        of them is evaluated as ``probe``: the mask a dynamic-shape graph builds from its sizes,
        seen at that size. A module buffer counts as a constant (its compile-time value).
        """
        buffers: dict[fx.Node, tuple[int, torch.Tensor]] = {}
        attrs: dict[fx.Node, torch.Tensor] = {}  # tensor constants the traced code made (HF's torch.tensor(0.0))
        order: list[fx.Node] = []
        seen: set[fx.Node] = set()
        stack = [n]
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            if _is_size_symbol(x):
                if probe is None:
                    return None
                order.append(x)
                continue
            if x.op == "placeholder" and self.state is not None:
                got = self.state.value_of(x)
                if got is None or got[1].numel() > _EVAL_LIMIT:
                    return None
                buffers[x] = got
                continue
            if x.op == "get_attr":
                c = getattr(x.graph.owning_module, str(x.target), None)
                if not isinstance(c, torch.Tensor) or c.numel() > _EVAL_LIMIT:
                    return None
                attrs[x] = c
                continue
            if x.op != "call_function":
                return None
            v = val(x)
            if isinstance(v, torch.Tensor):
                if probe is None and any(not isinstance(s, int) for s in v.shape):
                    return None
                if all(isinstance(s, int) for s in v.shape) and v.numel() > _EVAL_LIMIT:
                    return None
            if torch.Tag.nondeterministic_seeded in getattr(x.target, "tags", ()):
                return None
            order.append(x)
            stack.extend(x.all_input_nodes)
        env: dict[fx.Node, Any] = {}
        try:
            with compat.real_tensor_mode():  # joint passes run inside a FakeTensorMode
                for x in sorted(order + list(buffers) + list(attrs), key=graph_order(n.graph)):
                    if _is_size_symbol(x):
                        env[x] = probe
                    elif x in buffers:
                        env[x] = buffers[x][1]
                    elif x in attrs:
                        env[x] = attrs[x]
                    else:
                        env[x] = x.target(*fx.map_arg(x.args, env.__getitem__), **fx.map_arg(x.kwargs, env.__getitem__))
        except Exception as exc:  # noqa: BLE001 - an op that will not run on real tensors: not constant
            log.debug("enn attention: constant mask %s not evaluated: %s", n.name, exc)
            return None
        out = env[n]
        if type(out) is not torch.Tensor:
            return None  # a FakeTensor means fake mode was active
        self.reads.extend(buffers.values())
        return out.cpu()  # values are read for their structure, next to CPU tensors, whatever the graph's device


# ----------------------------------------------------------------------------- structure of constant masks
class Dims(NamedTuple):
    """The sizes a recognizer compares a constant with: query / key lengths (ints, or SymInts under
    dynamic shapes) and query heads."""

    tq: Any
    tk: Any
    heads: int


def _band(keep: torch.Tensor, tq: int, tk: int) -> Optional[tuple[str, int]]:
    """('none'|'causal'|'window', w) if the keep-mask is that structure for every batch/head."""
    if keep.dim() < 2 or keep.shape[-2:] not in ((tq, tk),):
        return None
    flat = keep.reshape(-1, tq, tk)
    first = flat[0]
    if not bool((flat == first).all()):
        return None
    if bool(first.all()):
        return "none", 0
    i = torch.arange(tq, device=keep.device).view(tq, 1)
    j = torch.arange(tk, device=keep.device).view(1, tk)
    causal = j <= i
    if not bool((first & ~causal).any()):
        # a band: keys i - w < j <= i for some w >= 1 (w = 0 masks every key: no band)
        w = int(first.sum(-1).max())
        if w == 0:
            return None
        band = causal & (i - j < w)
        if bool((first == band).all()):
            return ("causal", 0) if w >= tk else ("window", w)
    return None


def _structure(node: fx.Node, dims: Dims, ev: Constants,
               keep_of: Callable[[torch.Tensor], Optional[torch.Tensor]]) -> Optional[tuple[str, int]]:
    """('none'|'causal'|'window', w) of a constant mask; ``keep_of(value)`` turns its value into a
    boolean keep-mask (or None). For symbolic Tq / Tk the mask is evaluated at two probe sizes
    and must have the same structure at both."""
    tq, tk = dims.tq, dims.tk
    if isinstance(tq, int) and isinstance(tk, int):
        cv = ev.value(node)
        keep = keep_of(cv) if cv is not None else None
        return _band(keep, tq, tk) if keep is not None else None
    if not (isinstance(tq, torch.SymInt) and isinstance(tk, torch.SymInt) and str(tq) == str(tk)):
        return None  # only square masks over one symbolic length
    seen = set()
    for p in _PROBES:
        cv = ev.value(node, probe=p)
        keep = keep_of(cv) if cv is not None else None
        cls = _band(keep, p, p) if keep is not None else None
        if cls is None or (cls[0] == "window" and cls[1] >= p):
            return None
        seen.add(cls)
    return seen.pop() if len(seen) == 1 else None


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
        band = _band(keep.expand(tq, tk), tq, tk)
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

    band = _structure(m.cond, dims, ev, keep_of)
    return Claim(band=band) if band is not None else None


def band_additive_mask(b: BiasTerm, dims: Dims, ev: Constants) -> Optional[Claim]:
    """A constant additive mask of 0 and -inf / finfo.min: causal or a band (LLaMA's ``triu``)."""
    band = _structure(b.node, dims, ev, _additive_keep) if b.factor == 1.0 else None
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
            sizes = [(p, p, p) for p in _PROBES]  # dynamic shapes: the same at two probe sizes
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
        if not scalars or not all(math.isfinite(scalar(x)) for x in scalars):
            return False
        if t is aten.div.Tensor and scalar(b) in (None, 0.0):
            return False
        return all(finite_bias(x, depth + 1) for x in (a, b) if scalar(x) is None)
    return False


def may_saturate(n: Any, depth: int = 0) -> bool:
    """Whether a (provably finite) bias may hold values at or below ``SATURATED`` -- HF's
    ``finfo.min`` masks do -- so that a row whose every key is masked is *saturated*: eager's
    softmax is uniform there (see custom_ops/attention.py ``saturated_counts``). Looks for a
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
