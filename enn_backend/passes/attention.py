"""Attention pass: hand-written ``softmax(Q Kᵀ · s + bias, masked) V`` -> one fused attention.

A hand-written graph matcher over the post-decomposition ATen joint graph (training: forward +
backward; inference: forward only). It starts at each ``bmm(P, V)`` and walks up:

    O = view(bmm(view(expand(cast?(softmax(x)))), view(expand(V))))
    x = cast? / where(cond, fill, ·) / add(·, bias) / mul|div(·, c) ... around
        view(bmm(view(expand(cast?(Q·c?))), view(expand(cast?(permute(K·c?))))))

softmax is ``_softmax`` or Inductor's decomposition ``exp(x - amax) / sum``; casts are autocast's;
the fill of a ``masked_fill``/``where`` is ``-inf`` or ``finfo.min``; K/V may be grouped-query
(``unsqueeze -> expand -> clone -> view``, what ``repeat_interleave`` and HF's ``repeat_kv``
produce). A mask built from constants (``tril``, ``triu``, ``arange`` compares) or read from a
module buffer (nanoGPT's ``tril``, guarded per call) is evaluated at compile time and, when it is
causal or a sliding-window band, becomes a flag instead of a tensor.

What replaces it (the policy in enn_backend/attention_policy.py picks the kernel): SDPA's ATen
kernel and its backward op (``_NativeKernel``) where no row can be fully masked; FlexAttention
ops (attention_flex.py) for ALiBi / windows; otherwise ``enn::attention`` (+
``enn::attention_backward``). Training: the backward region -- every joint-graph node whose
``seq_nr`` belongs to a forward node of the region (AOT Autograd tags each backward node with the
forward op it differentiates) -- is replaced too. The gradients leaving that backward region are
mapped to q / k / v / bias by shape, then by the forward op they differentiate; anything
ambiguous leaves the graph alone (recorded).

Anything that is not exactly attention (another reduction than softmax over the key axis, a
dropout between softmax and the second matmul, an intermediate used elsewhere) is left alone.
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from .. import compat
from ..attention_policy import AttentionProblem, choose
from ..custom_ops.attention import SATURATED, SATURATED_FLOOR, floors_saturated
from ..custom_ops.pinned import EMITTED
from ..report import FallbackKind, report
from . import EnnPass, PassContext, current_module_state

log = logging.getLogger(__name__)
aten = torch.ops.aten
prims = torch.ops.prims

_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default}
_CAST = {prims.convert_element_type.default}
_EVAL_LIMIT = 1 << 26  # largest constant mask evaluated at compile time (elements)


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _shape(n: Any) -> Optional[tuple]:
    v = _val(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _is(n: Any, *targets: Any) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def _one_user(n: fx.Node) -> bool:
    return len(n.users) == 1


def _skip_views(n: Any, also: tuple = ()) -> Any:
    """Walk up through shape-only ops (view/alias/clone/expand without broadcasting) and ``also``."""
    while isinstance(n, fx.Node):
        if n.target in _VIEWS and _is_gqa_expand(n.args[0]):
            break  # keep grouped-query K/V as the [B, H, T, D] view; _gqa_base looks further
        if n.target in _VIEWS or n.target in also:
            n = n.args[0]
        elif n.target is aten.clone.default:
            n = n.args[0]
        elif n.target is aten.expand.default and _shape(n.args[0]) == _shape(n):
            n = n.args[0]
        else:
            break
    return n


def _is_gqa_expand(n: Any) -> bool:
    """``n`` is (a clone of) an expand that broadcasts: the repeat of grouped-query K/V."""
    if _is(n, aten.clone.default):
        n = n.args[0]
    return _is(n, aten.expand.default) and _shape(n.args[0]) != _shape(n)


def _scalar(n: Any) -> Optional[float]:
    """A Python number, or a 0-d ``full`` constant node's value."""
    if isinstance(n, (int, float)) and not isinstance(n, bool):
        return float(n)
    if _is(n, aten.full.default) and list(n.args[0]) == [] and isinstance(n.args[1], (int, float)):
        return float(n.args[1])
    if _is(n, *_CAST):
        return _scalar(n.args[0])
    return None


# ----------------------------------------------------------------------------- matching
@dataclass
class Match:
    out: fx.Node  # the [B, H, Tq, Dv] (or [B, Tq, Dv]) output node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    scale: float
    three_d: bool
    bias_terms: list = field(default_factory=list)  # (node, factor)
    masks: list = field(default_factory=list)  # (cond node, keep_when_true, fill)
    region_roots: list = field(default_factory=list)  # nodes where the region starts
    dtype: Optional[torch.dtype] = None  # the dtype the matmuls run in (q / k / v are cast to it)


def _softmax_input(n: fx.Node) -> Optional[fx.Node]:
    """``x`` if ``n`` is softmax(x) over the last axis (ATen or Inductor's decomposition)."""
    if _is(n, aten._softmax.default):
        x, dim = n.args[0], n.args[1]
        return x if dim in (-1, len(_shape(x)) - 1) else None
    if not _is(n, aten.div.Tensor):
        return None
    e, s = n.args
    if not (_is(e, aten.exp.default) and _is(s, aten.sum.dim_IntList) and s.args[0] is e):
        return None
    sub = e.args[0]
    if not _is(sub, aten.sub.Tensor):
        return None
    x, amax = sub.args
    if not (_is(amax, aten.amax.default) and amax.args[0] is x):
        return None
    nd = len(_shape(x))
    for r in (amax, s):
        dims = list(r.args[1])
        if dims not in ([-1], [nd - 1]) or not (len(r.args) > 2 and r.args[2]):
            return None
    return x


def _qk(n: fx.Node) -> Optional[tuple[fx.Node, fx.Node, float, bool]]:
    """(q, k, scale, three_d) if ``n`` is the Q·Kᵀ product (4-D via view or a plain 3-D bmm)."""
    three_d = _is(n, aten.bmm.default)
    mm = n if three_d else (n.args[0] if _is(n, *_VIEWS) else None)
    if not _is(mm, aten.bmm.default):
        return None
    a, b = mm.args
    scale = 1.0
    # Casts are skipped too: under autocast Q / Kᵀ reach the bmm through a cast to its dtype
    # (LLaMA's RoPE makes q, k fp32); the rewrite casts q / k / v to the bmm dtype again.
    q = _skip_views(a, also=tuple(_CAST))
    kt = _skip_views(b, also=tuple(_CAST))
    for side in ("q", "k"):
        node = q if side == "q" else kt
        while _is(node, aten.mul.Tensor, aten.div.Tensor) and _scalar(node.args[1]) is not None:
            c = _scalar(node.args[1])
            scale = scale * c if node.target is aten.mul.Tensor else scale / c
            node = _skip_views(node.args[0], also=tuple(_CAST))
        if side == "q":
            q = node
        else:
            kt = node
    if not _is(kt, aten.permute.default):
        return None
    nd = len(_shape(kt))
    perm = list(kt.args[1])
    if perm != list(range(nd - 2)) + [nd - 1, nd - 2]:
        return None
    k = kt.args[0]
    while _is(k, aten.mul.Tensor, aten.div.Tensor) and _scalar(k.args[1]) is not None:
        c = _scalar(k.args[1])
        scale = scale * c if k.target is aten.mul.Tensor else scale / c
        k = _skip_views(k.args[0], also=tuple(_CAST))
    want = 3 if three_d else 4
    if len(_shape(q)) != want or len(_shape(k)) != want:
        return None
    return q, k, scale, three_d


def _fill(n: Any) -> Optional[float]:
    v = _scalar(n)
    if v is None:
        return None
    if v == float("-inf"):
        return v
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        if v <= torch.finfo(dt).min:
            return v
    return None


def _peel_scores(x: fx.Node, m: dict) -> Optional[tuple]:
    """Walk from the softmax input to Q·Kᵀ, collecting scale, bias terms and masks."""
    factor = 1.0  # product of the scale factors applied outside the current node
    n = x
    while True:
        # Step through casts and views one node at a time: the 4-D view of the Q·Kᵀ bmm must be
        # seen before it is skipped (softmax(scores.float()) puts a cast right above it).
        while True:
            got = _qk(n)
            if got is not None:
                q, k, s, three_d = got
                return q, k, s * factor, three_d
            nxt = _skip_views(n, also=tuple(_CAST))
            if nxt is n:
                break
            n = n.args[0]
        if _is(n, aten.where.self):
            cond, a, b = n.args
            fa, fb = _fill(a), _fill(b)
            if fa is not None and isinstance(b, fx.Node):
                m["masks"].append((cond, False, fa, factor))
                n = b
            elif fb is not None and isinstance(a, fx.Node):
                m["masks"].append((cond, True, fb, factor))
                n = a
            else:
                return None
            continue
        if _is(n, aten.add.Tensor) and not n.kwargs and len(n.args) == 2 and all(isinstance(a, fx.Node) for a in n.args):
            for score, bias in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
                sub: dict = {"masks": [], "bias": []}
                got = _peel_scores(score, sub)
                if got is not None:
                    if not isinstance(_val(bias), torch.Tensor) or not _val(bias).is_floating_point():
                        return None
                    m["bias"].append((bias, factor))
                    q, k, s, three_d = got
                    m["masks"] += [(c, p, f, fac * factor) for c, p, f, fac in sub["masks"]]
                    m["bias"] += [(b, fac * factor) for b, fac in sub["bias"]]
                    return q, k, s * factor, three_d
            return None
        if _is(n, aten.mul.Tensor, aten.div.Tensor) and _scalar(n.args[1]) is not None:
            c = _scalar(n.args[1])
            if c == 0:
                return None
            factor = factor * c if n.target is aten.mul.Tensor else factor / c
            if factor <= 0:
                return None
            n = n.args[0]
            continue
        got = _qk(n)
        if got is None:
            return None
        q, k, s, three_d = got
        return q, k, s * factor, three_d


def match_at(bmm: fx.Node) -> Optional[Match]:
    """A Match if ``bmm`` is the P·V product of an attention."""
    p, vv = bmm.args
    p = _skip_views(p, also=tuple(_CAST))
    x = _softmax_input(p)
    if x is None:
        return None
    m: dict = {"masks": [], "bias": []}
    got = _peel_scores(x, m)
    if got is None:
        return None
    q, k, scale, three_d = got
    v = _skip_views(vv, also=tuple(_CAST))
    out = bmm
    if not three_d:
        users = list(bmm.users)
        if len(users) != 1 or not _is(users[0], *_VIEWS) or len(_shape(users[0])) != 4:
            return None
        out = users[0]
    if len(_shape(v)) != (3 if three_d else 4):
        return None
    if any(f != 1.0 and fill != float("-inf") for _, _, fill, f in m["masks"]):
        return None  # a finite fill that was rescaled afterwards is no longer finfo.min
    return Match(out=out, q=q, k=k, v=v, scale=scale, three_d=three_d, bias_terms=m["bias"], masks=m["masks"],
                 dtype=_val(bmm).dtype)


def _gqa_base(n: fx.Node) -> tuple[fx.Node, int]:
    """(K/V with Hkv heads, n_rep) if ``n`` is ``view(clone(expand(unsqueeze(x, 2))))``."""
    a = n
    if _is(a, *_VIEWS):
        a = a.args[0]
        if _is(a, aten.clone.default):
            a = a.args[0]
        if _is(a, aten.expand.default):
            u = a.args[0]
            if _is(u, aten.unsqueeze.default) and u.args[1] == 2 and len(_shape(u.args[0])) == 4:
                base = u.args[0]
                b, hkv, t, d = _shape(base)
                es = _shape(a)
                if es[:2] == (b, hkv) and es[3:] == (t, d) and _shape(n)[1] == hkv * es[2]:
                    return base, es[2]
    return n, 1


# ----------------------------------------------------------------------------- constant masks
def _constant_value(n: fx.Node, probe: Optional[int] = None) -> Optional[torch.Tensor]:
    """Evaluate ``n`` on real tensors if it depends on constants only (small, static shapes).

    With ``probe``, symbolic sizes (SymInt placeholders, ``sym_size``) are allowed and every
    one of them is evaluated as ``probe``: the mask a dynamic-shape graph builds from its
    sizes, seen at that size.

    A module buffer (nanoGPT's ``tril`` mask) counts as a constant: its real value is read from
    the compile's :class:`ModuleState`, and each buffer read is appended to ``BUFFER_READS`` so
    the rewrite can record the content it relied on.
    """
    state = current_module_state()
    buffers: dict = {}
    order: list[fx.Node] = []
    seen: set = set()
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
        if x.op == "placeholder" and state is not None:
            got = state.value_of(x)
            if got is None or got[1].numel() > _EVAL_LIMIT:
                return None
            buffers[x] = got
            continue
        if x.op != "call_function":
            return None
        v = _val(x)
        if isinstance(v, torch.Tensor):
            if probe is None and any(not isinstance(s, int) for s in v.shape):
                return None
            if all(isinstance(s, int) for s in v.shape) and v.numel() > _EVAL_LIMIT:
                return None
        if torch.Tag.nondeterministic_seeded in getattr(x.target, "tags", ()):
            return None
        order.append(x)
        stack.extend(x.all_input_nodes)
    env: dict = {}
    try:
        with compat.real_tensor_mode():  # joint passes run inside a FakeTensorMode
            for x in sorted(order + list(buffers), key=_topo_index(n.graph)):
                if _is_size_symbol(x):
                    env[x] = probe
                    continue
                if x in buffers:
                    env[x] = buffers[x][1]
                    continue
                args = fx.map_arg(x.args, lambda a: env[a])
                kwargs = fx.map_arg(x.kwargs, lambda a: env[a])
                env[x] = x.target(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - an op that will not run on real tensors: not constant
        log.debug("enn attention: constant mask %s not evaluated: %s", n.name, exc)
        return None
    out = env[n]
    if type(out) is not torch.Tensor:
        return None  # a FakeTensor means fake mode was active
    BUFFER_READS.extend(buffers.values())
    return out


# (input index, real tensor) of every module buffer a constant evaluation read; _Rewrite.run
# turns the reads its classification relied on into ModuleState assumptions.
BUFFER_READS: list = []


_TOPO: dict = {}


def _topo_index(graph: fx.Graph):
    idx = {x: i for i, x in enumerate(graph.nodes)}
    return lambda x: idx[x]


_PROBES = (16, 23)  # sizes at which a dynamic-shape mask is evaluated (two, so a structure is not a coincidence)


def _is_size_symbol(x: fx.Node) -> bool:
    return (x.op == "placeholder" and isinstance(_val(x), torch.SymInt)) or _is(x, aten.sym_size.int)


def _mask_structure(node: fx.Node, tq: Any, tk: Any, keep_of: Any) -> Optional[tuple[str, int]]:
    """('none'|'causal'|'window', w) of a constant mask; for symbolic Tq/Tk (dynamic shapes)
    the mask is evaluated at two probe sizes and must have the same structure at both.

    ``keep_of(value) -> keep-mask or None`` turns the evaluated node into a boolean keep-mask.
    """
    if isinstance(tq, int) and isinstance(tk, int):
        cv = _constant_value(node)
        keep = keep_of(cv) if cv is not None else None
        return _classify_keep(keep, tq, tk) if keep is not None else None
    if not (isinstance(tq, torch.SymInt) and isinstance(tk, torch.SymInt) and str(tq) == str(tk)):
        return None  # only square masks over one symbolic length
    seen = set()
    for p in _PROBES:
        cv = _constant_value(node, probe=p)
        keep = keep_of(cv) if cv is not None else None
        cls = _classify_keep(keep, p, p) if keep is not None else None
        if cls is None or (cls[0] == "window" and cls[1] >= p):
            return None
        seen.add(cls)
    return seen.pop() if len(seen) == 1 else None


def _classify_keep(keep: torch.Tensor, tq: int, tk: int) -> Optional[tuple[str, int]]:
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
        # a band: keys i - w < j <= i for some w
        counts = first.sum(-1)
        w = int(counts.max())
        band = causal & (i - j < w)
        if bool((first == band).all()):
            return ("causal", 0) if w >= tk else ("window", w)
    return None


def _additive_keep(cv: torch.Tensor) -> Optional[torch.Tensor]:
    """The keep-mask of an additive 0 / -inf / finfo.min mask (None if it is anything else)."""
    if not cv.is_floating_point():
        return None
    masked = ~torch.isfinite(cv) | (cv <= torch.finfo(cv.dtype).min)
    return (cv == 0) if bool(((cv == 0) | masked).all()) else None


def _alibi_slopes(term: fx.Node, tq: int, tk: int, heads: int) -> Optional[tuple[fx.Node, Any]]:
    """(slopes node, 'exact' | the dtype positions are rounded to) if ``term`` is ``slopes[h] * (j - i)``."""
    if not _is(term, aten.mul.Tensor) or not all(isinstance(a, fx.Node) for a in term.args):
        return None
    for rel, slopes in (term.args, term.args[::-1]):
        ss = _shape(slopes)
        if ss is None or len(ss) < 3 or ss[-2:] != (1, 1) or ss[-3] != heads or any(d != 1 for d in ss[:-3]):
            continue
        if isinstance(tq, int) and isinstance(tk, int):
            sizes = [(None, tq, tk)]
        elif isinstance(tq, torch.SymInt) and str(tq) == str(tk):
            sizes = [(p, p, p) for p in _PROBES]  # dynamic shapes: the same at two probe sizes
        else:
            continue
        kinds = {_is_relative_positions(_constant_value(rel, probe), q, k) for probe, q, k in sizes}
        if len(kinds) == 1 and None not in kinds:
            return slopes, kinds.pop()
    return None


def _is_relative_positions(rv: Optional[torch.Tensor], tq: int, tk: int) -> Any:
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


# ----------------------------------------------------------------------------- the pass
class AttentionPass(EnnPass):
    """Fuse hand-written attention: SDPA's ATen kernels, FlexAttention ops, or ``enn::attention``."""

    name = "attention"
    option = "attention"
    # joint_pre: before Inductor's own fuse_attention takes the patterns it knows (with other
    # masked-row semantics); joint: again after Inductor's clean-up, for what only matches
    # once constants are folded. A fused site is an enn::attention node: no double match.
    stage = ("joint_pre", "joint")

    def __call__(self, graph: fx.Graph, ctx: PassContext) -> int:
        import enn_backend.custom_ops  # noqa: F401  (the enn ops must be registered)

        if any(_is(n, aten.alias.default) for n in graph.nodes):
            compat.remove_noop_ops(graph)  # as a joint *pre* pass: Inductor runs this right after anyway
        count = 0
        for n in list(graph.nodes):
            if n.graph is not graph or not _is(n, aten.bmm.default):
                continue
            m = match_at(n)
            if m is None:
                continue
            try:
                done = _Rewrite(graph, m, self.opts, ctx).run()
            except _Skip as why:
                report().add_fallback(FallbackKind.PASS_SKIPPED, node=n.name, phase="compile", graph=ctx.unit,
                                      reason=f"attention at {n.name} not fused: {why}", action="left as written",
                                      level=logging.INFO)
                done = False
            if done:
                count += 1
                ctx.fusion("attention")
        if count:
            graph.eliminate_dead_code()
            compat.stable_topological_sort(graph)
            graph.lint()
        return count


class _Skip(Exception):
    pass


_TRANSPARENT_BWD = (aten.view.default, aten._unsafe_view.default, aten.permute.default, aten.clone.default,
                    aten.alias.default, aten.expand.default, aten.squeeze.dim, aten.unsqueeze.default)


class _Rewrite:
    def __init__(self, graph: fx.Graph, m: Match, opts: Any, ctx: PassContext) -> None:
        self.g, self.m, self.opts, self.ctx = graph, m, opts, ctx
        self.mode = _fake_mode(graph)
        self.created: list = []

    # -- node helpers
    def call(self, target: Any, args: tuple, kwargs: Optional[dict] = None, before: Optional[fx.Node] = None) -> fx.Node:
        with self.g.inserting_before(before or self.m.out):
            n = self.g.call_function(target, args, kwargs or {})
        vals = fx.map_arg((args, kwargs or {}), _val)
        with self.mode:
            n.meta["val"] = target(*vals[0], **vals[1])
        n.meta[EMITTED] = True  # the guard's reference runs enn's safe path for these nodes only
        self.created.append(n)
        return n

    def run(self) -> bool:
        m = self.m
        q, k, v = m.q, m.k, m.v
        k_base, rep_k = (k, 1) if m.three_d else _gqa_base(k)
        v_base, rep_v = (v, 1) if m.three_d else _gqa_base(v)
        if rep_k != rep_v or rep_k == 1:
            k_base, v_base = k, v
        qs, ks, vs = _shape(q), _shape(k_base), _shape(v_base)
        tq, tk = qs[-2], ks[-2]
        if any(not isinstance(s, int) for s in qs + ks + vs):
            pass  # symbolic sizes are fine; structure classification below needs ints only
        # masks: constant ones become flags, others keep-masks (bool) or float bias terms
        causal, window = False, 0
        keep_nodes: list = []
        bias_terms = list(m.bias_terms)
        minfill_masks: list = []
        alibi = alibi_term = alibi_positions = None
        relied: list = []  # module buffers whose content a classification below relied on

        def classified(fn, *args):
            start = len(BUFFER_READS)
            got = fn(*args)
            if got is not None:
                relied.extend(BUFFER_READS[start:])
            del BUFFER_READS[start:]
            return got

        with compat.real_tensor_mode():  # constant masks are evaluated on real tensors
            for cond, keep_when_true, fill, _factor in m.masks:
                cls = classified(_mask_structure, cond, tq, tk,
                                 lambda cv, kt=keep_when_true: (cv if kt else ~cv) if cv.dtype == torch.bool else None)
                if cls is not None:
                    kind, w = cls
                    if kind == "none":
                        continue
                    causal, window = True, (w if kind == "window" else window)
                    continue
                if fill == float("-inf"):
                    keep_nodes.append((cond, keep_when_true))
                else:
                    minfill_masks.append((cond, keep_when_true, fill))
            structural_bias = []
            for term, factor in bias_terms:
                cls = classified(_mask_structure, term, tq, tk, _additive_keep) if factor == 1.0 else None
                if cls is not None:
                    # an additive mask of 0 / -inf / finfo.min built from constants (LLaMA's causal mask)
                    if cls[0] != "none":
                        causal, window = True, (cls[1] if cls[0] == "window" else window)
                    continue
                if alibi is None and factor == 1.0:
                    found = classified(_alibi_slopes, term, tq, tk, 1 if m.three_d else _shape(q)[1])
                    if found is not None:
                        (alibi, alibi_positions), alibi_term = found, term
                        continue
                structural_bias.append((term, factor))
            bias_terms = structural_bias
        if causal and tq != tk:
            raise _Skip("causal mask with Tq != Tk (SDPA's causal is top-left aligned)")
        # ---- the graph regions and their gradients
        inputs = [q, k_base, v_base] + [t for t, _ in bias_terms] + ([alibi_term] if alibi_term is not None else [])
        region = _region(m.out, inputs)
        training = any(n.op == "placeholder" and _is_bwd(n) for n in self.g.nodes)
        bwd = _backward_region(self.g, region, inputs) if training else set()
        _check_closed(region, bwd, m.out, inputs)
        exits = _exits(bwd) if training else []
        grads = _map_exits(exits, inputs, region, bwd) if training else {}
        grad_out = _grad_out(bwd, region, inputs, m.out) if grads else None
        if grads and grad_out is None:
            raise _Skip("could not find the gradient of the attention output")
        if alibi_term is not None and len(inputs) - 1 in grads:
            raise _Skip("ALiBi slopes that need a gradient")
        bias_grad = any(i >= 3 for i in grads)
        if bias_grad and (len(bias_terms) != 1 or bias_terms[0][1] != 1.0):
            raise _Skip("gradient needed for a bias built from several terms")
        # ---- build the op's inputs
        before = m.out
        q4, k4, v4 = (self._cast(t, m.dtype, before) for t in (q, k_base, v_base))
        if m.three_d:
            q4, k4, v4 = (self.call(aten.unsqueeze.default, (t, 1), before=before) for t in (q4, k4, v4))
        bias = None
        for term, factor in bias_terms:
            t = term if factor == 1.0 else self.call(aten.mul.Tensor, (term, factor), before=before)
            bias = t if bias is None else self.call(aten.add.Tensor, (bias, t), before=before)
        for cond, keep_when_true, fill in minfill_masks:  # finfo.min fill: eager averages dead rows; a bias does too
            keep = cond if keep_when_true else self.call(aten.bitwise_not.default, (cond,), before=before)
            zero = self.call(aten.full.default, ([], 0.0), {"dtype": _val(q).dtype, "device": _val(q).device}, before=before)
            low = self.call(aten.full.default, ([], fill), {"dtype": _val(q).dtype, "device": _val(q).device}, before=before)
            t = self.call(aten.where.self, (keep, zero, low), before=before)
            bias = t if bias is None else self.call(aten.add.Tensor, (bias, t), before=before)
        mask = None
        for cond, keep_when_true in keep_nodes:
            keep = cond if keep_when_true else (cond.args[0] if _is(cond, aten.bitwise_not.default)
                                                else self.call(aten.bitwise_not.default, (cond,), before=before))
            mask = keep if mask is None else self.call(aten.bitwise_and.Tensor, (mask, keep), before=before)
        if bias is not None and m.three_d:
            pass  # a [B, Tq, Tk] bias broadcasts against [B, 1, Tq, Tk] after unsqueeze below
        if m.three_d:
            if bias is not None and len(_shape(bias)) == 3:
                bias = self.call(aten.unsqueeze.default, (bias, 1), before=before)
            if mask is not None and len(_shape(mask)) == 3:
                mask = self.call(aten.unsqueeze.default, (mask, 1), before=before)
        alibi_node = None
        if alibi is not None:
            alibi_node = self.call(aten.view.default, (alibi, [_shape(q4)[1]]), before=before)
        bias_finite = bias is not None and all(_finite_bias(t) for t, _ in bias_terms) and all(
            _finite_bias(c) for c, _, _ in minfill_masks)
        saturating = bias_finite and (any(_may_saturate(t) for t, _ in bias_terms)
                                      or any(f <= SATURATED for _, _, f in minfill_masks))
        backend = self._choose(q4, k4, v4, mask, bias, bias_grad, causal, window, training and bool(grads),
                               alibi_node is not None, bias_finite, saturating)
        if backend == "inductor":  # the policy leaves it to Inductor: undo the helper nodes
            self.ctx.kernel_choice(m.out.name, "inductor", self.reason, fused=False)
            for n in reversed(self.created):
                if not n.users:
                    self.g.erase_node(n)
            return False
        rounded = alibi_positions not in (None, "exact")
        if rounded and backend != "flex":
            raise _Skip(f"ALiBi positions rounded to {alibi_positions}: only FlexAttention reproduces them "
                        f"({backend} would add exact positions)")
        native = self._native_plan(backend, mask, bias, alibi_node, window, bias_grad, bias_finite)
        first_bwd = min((n for n in bwd), key=_topo_index(self.g)) if grads else None
        g_in = grad_out
        if grads and m.three_d:
            g_in = self.call(aten.unsqueeze.default, (grad_out, 1), before=first_bwd)
        flex_grads = None
        if backend == "flex":
            from .attention_flex import emit_flex

            slopes = self._cast(alibi_node, torch.float32, before) if alibi_node is not None else None
            # The bias as the user's code rounds it: positions (and the product) in the term's dtype.
            low = (torch.bfloat16, torch.float16)
            bias_dtype = _val(alibi_term).dtype if alibi_term is not None else None
            out, flex_grads = emit_flex(self, q4, k4, v4, slopes, float(m.scale), causal, int(window),
                                        g_in if grads else None, before, first_bwd,
                                        pos_dtype=alibi_positions if rounded else None,
                                        bias_dtype=bias_dtype if bias_dtype in low else None)
        elif native:
            k_full, v_full = k4, v4
            if rep_k > 1 and (k_base is not k):  # kernels without grouped-query K/V: the graph's repeat
                k_full, v_full = (self._cast(t, m.dtype, before) for t in (k, v))
            kern = _NativeKernel(self, backend, q4, k_full, v_full, self._native_bias(bias, q4, k_full, before),
                                 float(m.scale), causal)
            out = kern.forward(before)
        else:
            masked_rows = "zero" if self.opts.masked_rows == "zero" else "eager"
            fwd = self.call(torch.ops.enn.attention.default,
                            (q4, k4, v4, bias, mask, alibi_node, float(m.scale), causal, int(window), 0.0, masked_rows,
                             backend), before=before)
            out = self.call(operator.getitem, (fwd, 0), before=before)
            lse = self.call(operator.getitem, (fwd, 1), before=before)
        res = out
        if m.three_d:
            res = self.call(aten.squeeze.dim, (out, 1), before=before)
        if _shape(res) != _shape(m.out):
            raise _Skip(f"output shape {_shape(res)} != {_shape(m.out)}")
        m.out.replace_all_uses_with(res)
        if grads:
            if flex_grads is not None:
                parts = flex_grads + [None]
            elif native:
                dq, dk, dv = kern.backward(g_in, first_bwd)
                if k_full is not k4:  # sum the repeated heads' gradients back onto the K/V heads
                    dk, dv = (self._fold_heads(t, k4, first_bwd) for t in (dk, dv))
                parts = [dq, dk, dv]
            else:
                b = self.call(torch.ops.enn.attention_backward.default,
                              (g_in, q4, k4, v4, bias, mask, alibi_node, out, lse, float(m.scale), causal, int(window),
                               masked_rows, backend, bias_grad), before=first_bwd)
                parts = [self.call(operator.getitem, (b, i), before=first_bwd) for i in range(4)]
            for idx, exit_node in grads.items():
                gi = parts[min(idx, 3)]
                if m.three_d and idx < 3:
                    gi = self.call(aten.squeeze.dim, (gi, 1), before=first_bwd)
                gi = self._cast(gi, _val(exit_node).dtype, first_bwd)
                if _shape(gi) != _shape(exit_node):
                    raise _Skip(f"gradient shape {_shape(gi)} != {_shape(exit_node)}")
                exit_node.replace_all_uses_with(gi)
        if backend == "flex":
            self.reason += "; emitted as FlexAttention ops in the graph (compiled by Inductor)"
        elif native:
            self.reason += "; emitted as the ATen kernel itself (no fully-masked row is possible)"
            if saturating and floors_saturated(_val(q4).dtype):
                self.reason += ("; finfo.min-sized bias values handed to the kernel as -2**100, so rows masked "
                                "whole stay uniform as in eager")
        state = current_module_state()
        for index, value in relied:
            state.assume(index, value)
            self.reason += f"; mask buffer (input {index}) checked {'causal' if causal else 'structural'} at compile time, its content guarded per call"
        self.ctx.kernel_choice(m.out.name, backend, self.reason,
                               causal=causal, window=window, gqa=_hint(_shape(q4)[1]) != _hint(_shape(k4)[1]),
                               mask=mask is not None, bias=bias is not None, alibi=alibi_node is not None,
                               training=bool(grads))
        return True

    # -- ATen kernels emitted directly
    def _native_plan(self, backend, mask, bias, alibi, window, bias_grad, bias_finite) -> bool:
        """Whether the chosen kernel can be emitted as its ATen op, with no ``enn::attention`` around it.

        That op's Python body exists for what the kernels do not do themselves: boolean masks,
        ALiBi / window structure, the NaN of a row whose keys are all masked. Without those,
        the kernel computes exactly what the user wrote; emitting it directly saves the custom
        op's per-call cost and gives the backward the kernel's own saved statistics (no
        recompute). A bias qualifies only if it cannot hold -inf (``_finite_bias``).
        """
        if backend not in _NATIVE_BACKENDS or mask is not None or alibi is not None or window > 0:
            return False
        if bias is None:
            return True
        if backend not in ("efficient", "cpu_flash") or bias_grad or not bias_finite:
            return False
        tk = _shape(bias)[-1]
        return isinstance(tk, int) and tk % 8 == 0  # the kernels' bias alignment (else SDPA pads a copy)

    def _native_bias(self, bias, q4, k4, before):
        """The bias in the kernel's dtype and 4-D shape, as custom_ops.attention.kernel_bias
        makes it. A provably finite bias stays finite (fp32 finfo.min cast to bf16 would be
        -inf). In bf16 / fp32, values at or below SATURATED become SATURATED_FLOOR, which the
        kernels handle in saturated rows (HF's finfo.min there overflows the CUDA
        memory-efficient kernel); in fp16 values are clamped to its range."""
        if bias is None:
            return None
        dt = _val(q4).dtype
        if floors_saturated(dt):
            above = self.call(aten.gt.Scalar, (bias, SATURATED), before=before)
            bias = self.call(aten.where.ScalarOther, (above, bias, SATURATED_FLOOR), before=before)
            if _val(bias).dtype != dt:
                bias = self.call(aten.clamp_max.default, (bias, torch.finfo(dt).max), before=before)
        elif _val(bias).dtype != dt:
            bias = self.call(aten.clamp_min.default, (bias, torch.finfo(dt).min), before=before)
            bias = self.call(aten.clamp_max.default, (bias, torch.finfo(dt).max), before=before)
        if _val(bias).dtype != dt:
            bias = self._cast(bias, dt, before)
        while len(_shape(bias)) < 4:
            bias = self.call(aten.unsqueeze.default, (bias, 0), before=before)
        qs, ks = _shape(q4), _shape(k4)
        want = [qs[0], qs[1], qs[2], ks[2]]
        if list(_shape(bias)) != want:
            bias = self.call(aten.expand.default, (bias, [self._size(q4, 0), self._size(q4, 1), self._size(q4, 2),
                                                         self._size(k4, 2)]), before=before)
        return bias

    def _size(self, n: fx.Node, dim: int) -> Any:
        s = _shape(n)[dim]
        return s if isinstance(s, int) else self.call(aten.sym_size.int, (n, dim), before=self.m.out)

    def _fold_heads(self, g: fx.Node, base: fx.Node, before: fx.Node) -> fx.Node:
        """[B, Hq, T, D] gradient of repeated K/V -> [B, Hkv, T, D] (head h reads K/V head h // rep)."""
        b, hq, t, d = (self._size(g, i) for i in range(4))
        hkv = _shape(base)[1]
        rep = _hint(_shape(g)[1]) // _hint(hkv)
        v5 = self.call(aten.view.default, (g, [b, self._size(base, 1), rep, t, d]), before=before)
        return self.call(aten.sum.dim_IntList, (v5, [2]), before=before)

    def _cast(self, n: fx.Node, dtype: Optional[torch.dtype], before: fx.Node) -> fx.Node:
        if dtype is None or _val(n).dtype == dtype:
            return n
        return self.call(prims.convert_element_type.default, (n, dtype), before=before)

    def _choose(self, q, k, v, mask, bias, bias_grad, causal, window, training, alibi=False, bias_finite=False,
                bias_saturating=False) -> str:
        qv, kv, vv = _val(q), _val(k), _val(v)
        dev = qv.device
        cap = (0, 0)
        if dev.type == "cuda" and torch.cuda.is_available():
            cap = torch.cuda.get_device_capability(dev)
        p = AttentionProblem(
            device=dev.type, capability=tuple(cap), dtype=str(qv.dtype).removeprefix("torch."),
            head_dim=_hint(qv.shape[-1]), head_dim_v=_hint(vv.shape[-1]), tq=_hint(qv.shape[-2]), tk=_hint(kv.shape[-2]),
            heads_q=_hint(qv.shape[1]), heads_kv=_hint(kv.shape[1]), causal=causal, window=window,
            has_mask=mask is not None, has_bias=bias is not None, bias_grad=bias_grad, alibi=alibi,
            training=training, bias_finite=bias_finite, bias_may_saturate=bias_saturating,
            static_shapes=all(isinstance(d, int) for d in (qv.shape[-2], kv.shape[-2])))
        c = choose(p, self.opts.attention_backend, self.opts.attention_order)
        self.reason = c.reason
        if c.forced_failed:
            report().add_fallback(FallbackKind.KERNEL_CHOICE, node=self.m.out.name, phase="compile", graph=self.ctx.unit,
                                  reason=c.forced_failed, action=f"using {c.backend} ({c.reason})")
        return c.backend


_NATIVE_BACKENDS = ("flash", "cudnn", "efficient", "cpu_flash")


class _NativeKernel:
    """One SDPA kernel's forward and backward ATen ops, wired as AOT Autograd wires them for
    ``F.scaled_dot_product_attention`` (the same ops, argument order and saved outputs)."""

    def __init__(self, rw: "_Rewrite", backend: str, q, k, v, bias, scale: float, causal: bool) -> None:
        self.rw, self.backend, self.q, self.k, self.v, self.bias = rw, backend, q, k, v, bias
        self.scale, self.causal = scale, causal
        self.saved: list = []

    def _outs(self, node, n: int, before) -> list:
        return [self.rw.call(operator.getitem, (node, i), before=before) for i in range(n)]

    def forward(self, before) -> fx.Node:
        q, k, v, s, c = self.q, self.k, self.v, self.scale, self.causal
        if self.backend == "flash":
            f = self.rw.call(aten._scaled_dot_product_flash_attention.default, (q, k, v, 0.0, c, False), {"scale": s},
                             before=before)
            self.saved = self._outs(f, 8, before)  # out, lse, cum_q, cum_k, max_q, max_k, seed, offset
        elif self.backend == "cudnn":
            f = self.rw.call(aten._scaled_dot_product_cudnn_attention.default, (q, k, v, None, True, 0.0, c, False),
                             {"scale": s}, before=before)
            self.saved = self._outs(f, 8, before)
        elif self.backend == "efficient":
            f = self.rw.call(aten._scaled_dot_product_efficient_attention.default, (q, k, v, self.bias, True, 0.0, c),
                             {"scale": s}, before=before)
            self.saved = self._outs(f, 4, before)  # out, lse, seed, offset
        else:  # cpu_flash
            f = self.rw.call(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v, 0.0, c),
                             {"attn_mask": self.bias, "scale": s}, before=before)
            self.saved = self._outs(f, 2, before)  # out, lse
        return self.saved[0]

    def _saturated_counts(self, before) -> fx.Node:
        """enn::attention's ``saturated_counts`` of the kernel's bias, as graph nodes (see
        custom_ops/attention.py): per query row, the number of keys at the row's largest bias
        when that bias absorbs the scores, else 1. The backward kernels recompute P from the
        saved log-sum-exp and give such rows ``count`` times eager's gradients."""
        bias = self.bias.args[0] if _is(self.bias, aten.expand.default) else self.bias  # reduce before broadcasting
        rw, fb = self.rw, self.rw._cast(bias, torch.float32, before)
        if self.causal:  # keys after the query are dropped by the kernel (top-left aligned)
            full = rw.call(aten.full.default, ([rw._size(self.q, 2), rw._size(self.k, 2)], float("-inf")),
                           {"dtype": torch.float32, "device": _val(fb).device}, before=before)
            fb = rw.call(aten.add.Tensor, (fb, rw.call(aten.triu.default, (full, 1), before=before)), before=before)
        top = rw.call(aten.amax.default, (fb, [-1], True), before=before)
        at_top = rw.call(aten.eq.Tensor, (fb, top), before=before)
        count = rw.call(aten.sum.dim_IntList, (at_top, [-1], True), {"dtype": torch.float32}, before=before)
        saturated = rw.call(aten.le.Scalar, (top, SATURATED), before=before)
        return rw.call(aten.where.ScalarOther, (saturated, count, 1.0), before=before)

    def backward(self, g, before) -> list:
        q, k, v, s, c, sv = self.q, self.k, self.v, self.scale, self.causal, self.saved
        out, lse = sv[0], sv[1]
        if self.bias is not None:  # a provably finite bias: no dead rows, but maybe saturated ones
            scaled = self.rw.call(aten.div.Tensor, (g, self._saturated_counts(before)), before=before)
            g = self.rw._cast(scaled, _val(g).dtype, before)
        # Dense (not varlen) batches: the forward's cum_seq outputs are undefined and max_q / max_k
        # are the lengths; AOT Autograd passes them as the literals None / Tq / Tk (the partitioner
        # cannot save a None output), and so does enn.
        tq, tk = self.rw._size(q, 2), self.rw._size(k, 2)
        if self.backend == "flash":
            b = self.rw.call(aten._scaled_dot_product_flash_attention_backward.default,
                             (g, q, k, v, out, lse, None, None, tq, tk, 0.0, c, sv[6], sv[7]), {"scale": s},
                             before=before)
        elif self.backend == "cudnn":
            b = self.rw.call(aten._scaled_dot_product_cudnn_attention_backward.default,
                             (g, q, k, v, out, lse, sv[6], sv[7], None, None, None, tq, tk, 0.0, c),
                             {"scale": s}, before=before)
        elif self.backend == "efficient":
            b = self.rw.call(aten._scaled_dot_product_efficient_attention_backward.default,
                             (g, q, k, v, self.bias, out, lse, sv[2], sv[3], 0.0, [True, True, True, False], c),
                             {"scale": s}, before=before)
        else:
            b = self.rw.call(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                             (g, q, k, v, out, lse, 0.0, c), {"attn_mask": self.bias, "scale": s}, before=before)
        return self._outs(b, 3, before)


# Ops a bias may be built with and stay finite (given finite inputs): shape ops and casts.
_FINITE_SHAPE_OPS = _VIEWS | _CAST | {aten.expand.default, aten.clone.default, aten.unsqueeze.default,
                                      aten.slice.Tensor, aten.permute.default, aten.squeeze.dim,
                                      aten.lift_fresh_copy.default}


def _finite_bias(n: Any, depth: int = 0) -> bool:
    """Whether an additive bias provably holds no -inf / NaN, so no score row can be fully masked.

    Accepted: finite constants (also small tensor constants), integer / boolean tensors
    (attention masks), shape ops and casts of those, ``where`` between finite values, and a 0/1 mask scaled and shifted by finite numbers
    (HF's ``(1 - mask) * finfo.min``: attention masks hold 0 and 1). Anything else -- a learned
    bias, a user tensor, a ``-inf`` fill -- is not, and keeps enn::attention's dead-row handling.
    """
    if isinstance(n, bool):
        return True
    if isinstance(n, (int, float)):
        return math.isfinite(n)
    if not isinstance(n, fx.Node) or depth > 32:
        return False
    v = _val(n)
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
        return _finite_bias(n.args[0], depth + 1)
    if t in (aten.full.default, aten.scalar_tensor.default):
        return _finite_bias(n.args[1] if t is aten.full.default else n.args[0], depth + 1)
    if t is aten.where.self:
        return _finite_bias(n.args[1], depth + 1) and _finite_bias(n.args[2], depth + 1)
    if t in (aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.rsub.Scalar, aten.rsub.Tensor, aten.div.Tensor):
        a, b = n.args[0], n.args[1]
        scalars = [x for x in (a, b) if _scalar(x) is not None]
        if not scalars or not all(math.isfinite(_scalar(x)) for x in scalars):
            return False
        if t is aten.div.Tensor and _scalar(b) in (None, 0.0):
            return False
        tensors = [x for x in (a, b) if _scalar(x) is None]
        return all(_finite_bias(x, depth + 1) for x in tensors)
    return False


def _may_saturate(n: Any, depth: int = 0) -> bool:
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
    return any(_may_saturate(a, depth + 1) for a in (*n.args, *n.kwargs.values())
               if isinstance(a, (fx.Node, int, float)))


def _hint(s: Any) -> int:
    return compat.size_hint(s)  # never int(s): that would specialize dynamic shapes


def _fake_mode(graph: fx.Graph) -> Any:
    vals = [_val(n) for n in graph.nodes if n.op == "placeholder"]
    mode = compat.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None:
        raise _Skip("graph has no fake tensors to compute metadata from")
    return mode


def _is_bwd(n: fx.Node) -> bool:
    return n.meta.get("partitioner_tag") == "is_backward" or bool(n.meta.get("autograd_backward"))


def _region(out: fx.Node, inputs: list) -> set:
    """Forward nodes on a path from an input to ``out`` (inputs excluded), plus the constants
    (scale/fill/mask nodes with no input in the region) feeding it."""
    inputs_set = set(inputs)
    anc: set = set()
    stack = [out]
    while stack:
        n = stack.pop()
        if n in anc or n in inputs_set:
            continue
        if n.op != "call_function":
            continue
        anc.add(n)
        stack.extend(n.all_input_nodes)
    return anc


def _seq(n: fx.Node) -> Any:
    return n.meta.get("seq_nr")


def _backward_region(graph: fx.Graph, region: set, inputs: list) -> set:
    """Backward nodes that differentiate forward nodes of ``region`` (by AOT's ``seq_nr``)."""
    on_path: set = set(inputs)  # region nodes that depend on q / k / v / bias (mask-only nodes do not)
    for n in sorted(region, key=_topo_index(graph)):
        if any(a in on_path for a in n.all_input_nodes):
            on_path.add(n)
    seqs = {_seq(n) for n in region if n in on_path and isinstance(_val(n), torch.Tensor)
            and _val(n).is_floating_point()}
    seqs.discard(None)
    bwd = {n for n in graph.nodes if n.op == "call_function" and _is_bwd(n) and _seq(n) in seqs}
    # accumulation/helper nodes without a seq_nr whose inputs all come from the region
    changed = True
    allowed = region | set(inputs)
    while changed:
        changed = False
        for n in graph.nodes:
            if n in bwd or n.op != "call_function" or not _is_bwd(n) or _seq(n) is not None:
                continue
            ins = n.all_input_nodes
            if ins and any(i in bwd for i in ins) and all(i in bwd or i in allowed for i in ins):
                bwd.add(n)
                changed = True
    return bwd


def _check_closed(region: set, bwd: set, out: fx.Node, inputs: list) -> None:
    """Every intermediate of the forward region is used only by the region or its backward.

    Constants (positions, masks built from sizes) depend on no input: the layers of a model
    share them after CSE, and leaving them in the graph for other users costs nothing.
    """
    on_path: set = set(inputs)
    for n in sorted(region, key=_topo_index(out.graph)):
        if any(a in on_path for a in n.all_input_nodes):
            on_path.add(n)
    for n in region:
        if n is out or n not in on_path:
            continue
        for u in n.users:
            if u not in region and u not in bwd:
                if _val(n) is not None and not isinstance(_val(n), torch.Tensor):
                    continue
                raise _Skip(f"intermediate {n.name} is also used by {u.name}")


def _exits(bwd: set) -> list:
    return [n for n in bwd if any(u not in bwd for u in n.users)]


def _private(region: set, inputs: list) -> dict:
    """For each input index: the region nodes that depend on that input alone."""
    deps: dict = {}
    order = sorted(region | set(inputs), key=_topo_index(next(iter(region)).graph))
    for n in order:
        if n in inputs:
            deps[n] = {inputs.index(n)}
        else:
            s: set = set()
            for a in n.all_input_nodes:
                s |= deps.get(a, set())
            deps[n] = s
    return {i: {n for n in region if deps.get(n) == {i}} for i in range(len(inputs))}


def _map_exits(exits: list, inputs: list, region: set, bwd: set) -> dict:
    """{input index: exit node}: which gradient each exit is (by shape, then by seq_nr)."""
    private = _private(region, inputs)
    result: dict = {}
    for e in exits:
        cands = [i for i, x in enumerate(inputs) if _shape(x) == _shape(e) and _val(x).dtype == _val(e).dtype]
        if len(cands) > 1:
            by_seq = [i for i in cands if any(_seq(p) == _seq(e) for p in private[i])]
            if len(by_seq) == 1:
                cands = by_seq
            else:
                cands = _by_bmm_operand(e, cands, inputs, bwd)
        if len(cands) != 1 or cands[0] in result:
            raise _Skip(f"cannot tell which input backward node {e.name} is the gradient of")
        result[cands[0]] = e
    return result


def _by_bmm_operand(e: fx.Node, cands: list, inputs: list, bwd: set) -> list:
    """bmm backward: grad(self) = bmm(g, permute(mat2)); grad(mat2) = bmm(permute(self), g)."""
    n = e
    while _is(n, *_TRANSPARENT_BWD) and n in bwd:
        n = n.args[0]
    if not _is(n, aten.bmm.default):
        return cands
    a, b = n.args
    for i in cands:
        x = inputs[i]
        if _is(a, aten.permute.default) and _skip_views(a.args[0]) is x:
            return [i]
        if _is(b, aten.permute.default) and _skip_views(b.args[0]) is x:
            return [j for j in cands if j != i][:1] if len(cands) == 2 else cands
    return cands


def _grad_out(bwd: set, region: set, inputs: list, out: fx.Node) -> Optional[fx.Node]:
    """The gradient flowing into the attention output: the outside tensor the backward reads that
    has the output's shape and is not a forward value."""
    allowed = region | set(inputs)
    found = set()
    for n in bwd:
        for a in n.all_input_nodes:
            if a in bwd or a in allowed:
                continue
            if _shape(a) == _shape(out) and (a.op == "placeholder" and _is_bwd(a) or _is_bwd(a)):
                found.add(a)
            elif isinstance(_val(a), torch.Tensor) and _val(a).dim() > 0 and not _is(a, aten.full.default):
                raise _Skip(f"backward of the attention reads an unexpected value {a.name}")
    return found.pop() if len(found) == 1 else None
