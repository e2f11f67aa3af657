"""Recognize hand-written attention in an ATen graph: :func:`match_at` a ``bmm(P, V)``.

The matcher starts at each ``bmm(P, V)`` and walks up::

    O = view(bmm(view(expand(cast?(softmax(x)))), view(expand(V))))
    x = cast? / where(cond, fill, ·) / add(·, bias) / mul|div(·, c) ... around
        view(bmm(view(expand(cast?(Q·c?))), view(expand(cast?(permute(K·c?))))))

or ``view(baddbmm(bias, Q, Kᵀ, beta, alpha))`` (BLOOM's ALiBi: a bias term, alpha the scale);

softmax is ``_softmax``, Inductor's decomposition ``exp(x - amax) / sum`` or SDPA math's safe
softmax, over the key axis (softmax.py);
casts are autocast's; the fill of a ``masked_fill`` / ``where`` is ``-inf`` or ``finfo.min``;
K/V may be grouped-query (``unsqueeze -> expand -> clone -> view``, what ``repeat_interleave``
and HF's ``repeat_kv`` produce: :func:`gqa_base`). What the masks and bias terms are is
masks.py's business.

Between the softmax and the second matmul the probabilities may pass through a dropout
(:class:`Dropout`): ``P * (rand(P.shape) > p) * (1 / (1 - p))``, the form the decompositions of
``F.dropout`` / ``nn.Dropout`` (``native_dropout``) give the joint graph; the draw is Inductor's
``inductor_random`` once its joint passes ran. The fused kernel draws its own mask (see
kernels/), so the pass erases the graph's draw with the site.

A site that looks like attention -- a softmax over the key axis above the second matmul's first
operand, or a ``Q·Kᵀ`` matmul above the softmax -- but is not exactly one (another op between
them, a dropout whose mask is not a fresh draw or whose scale is not ``1 / (1 - p)``, a softmax
over another axis) raises :class:`Skip` with the reason, which the pass records; scores it cannot
read raise :class:`Unread`, recorded only at the pass's last stage (Inductor's clean-up between
the stages may make them readable). Anything else does not match (``None``).

What must stay internal (checked when the site is planned, regions.py): the scores (``Q·Kᵀ`` and
every scale, mask and bias applied to it), the softmax and the probabilities (their dropout
included) are read by nothing but the attention and its backward; a model that returns them
(``output_attentions=True``) or reads them elsewhere is not fused, with the reason. Q, K, V and
the bias terms are the kernel's inputs and may be read anywhere; so may a copy of Q, K or V in
its own shape (clones, casts, views that keep the shape): a K/V cache a model returns
(``use_cache=True``) is such a copy, and the kernel reads that same tensor. Any other form of
one of them that is read elsewhere (a transposed or scaled K, the repeated K/V of grouped-query
attention) keeps the site unfused, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch
import torch.fx as fx

from ...fx_utils import CONVERT, VIEWS, is_call, shape, val
from .softmax import softmax_input, softmax_of

aten = torch.ops.aten
_SKIPPED = (CONVERT,)  # what the walk from a matmul operand to Q / K / V steps through besides views
_MULS, _DIVS = (aten.mul.Tensor, aten.mul.Scalar), (aten.div.Tensor, aten.div.Scalar)


class Skip(Exception):
    """A match that is not fused; the message says why (recorded as a PASS_SKIPPED fallback)."""


class Unread(Skip):
    """Scores the matcher cannot read at this stage; Inductor's clean-up between the pass's
    stages may make them readable (a ``scalar_tensor`` fill it folds), so only the last stage says why."""


class MaskTerm(NamedTuple):
    """``where(cond, scores, fill)`` (or with the branches swapped) around the scores."""

    cond: fx.Node
    keep_when_true: bool  # True: ``cond`` marks the keys kept
    fill: float  # -inf or a finfo.min-sized number
    factor: float  # the scale applied to the scores after this mask


class BiasTerm(NamedTuple):
    """``scores + node`` (times ``factor``, the scale applied after the add)."""

    node: fx.Node
    factor: float


@dataclass
class Match:
    out: fx.Node  # the [B, H, Tq, Dv] (or [B, Tq, Dv]) output node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    scale: float
    three_d: bool
    bias_terms: list[BiasTerm] = field(default_factory=list)
    masks: list[MaskTerm] = field(default_factory=list)
    dtype: Optional[torch.dtype] = None  # the dtype the matmuls run in (q / k / v are cast to it)
    dropout: Optional["Dropout"] = None  # dropout on the probabilities (training)
    zero_rows: bool = False  # a safe softmax (softmax.py): rows whose every score is -inf give 0
    scores: Optional[fx.Node] = None  # the softmax's input: the scale, masks and bias terms applied
    probs: Optional[fx.Node] = None  # the softmax's output: the probabilities before any dropout


class Dropout(NamedTuple):
    """``P * keep * (1 / (1 - p))`` with ``keep = draw > p`` and ``draw`` uniform of ``P``'s shape."""

    p: float
    keep: fx.Node  # the boolean keep-mask (the backward reads it too)
    draw: fx.Node  # the random draw; random ops survive dead-code elimination: the pass erases it


def skip_views(n: Any, also: tuple = ()) -> Any:
    """Walk up through shape-only ops (view/alias/clone/expand without broadcasting) and ``also``."""
    while isinstance(n, fx.Node):
        if n.target in VIEWS and _is_gqa_expand(n.args[0]):
            break  # keep grouped-query K/V as the [B, H, T, D] view; gqa_base looks further
        if n.target in VIEWS or n.target in also:
            n = n.args[0]
        elif n.target is aten.clone.default:
            n = n.args[0]
        elif n.target is aten.expand.default and shape(n.args[0]) == shape(n):
            n = n.args[0]
        else:
            break
    return n


def _is_gqa_expand(n: Any) -> bool:
    """``n`` is (a clone of) an expand that broadcasts: the repeat of grouped-query K/V."""
    if is_call(n, aten.clone.default):
        n = n.args[0]
    return is_call(n, aten.expand.default) and shape(n.args[0]) != shape(n)


def scalar(n: Any) -> Optional[float]:
    """A Python number, or a 0-d ``full`` constant node's value."""
    if isinstance(n, (int, float)) and not isinstance(n, bool):
        return float(n)
    if is_call(n, aten.full.default) and list(n.args[0]) == [] and isinstance(n.args[1], (int, float)):
        return float(n.args[1])
    if is_call(n, CONVERT):
        return scalar(n.args[0])
    return None


def _strip_scale(n: Any, scale: float) -> tuple[Any, float]:
    """Step up through ``mul`` / ``div`` by constants (and casts / views), folding them into ``scale``."""
    # (SDPA's math path scales Q and Kᵀ by sqrt(scale) each, as mul.Scalar)
    while is_call(n, *_MULS, *_DIVS) and scalar(n.args[1]) is not None:
        c = scalar(n.args[1])
        scale = scale * c if n.target in _MULS else scale / c
        n = skip_views(n.args[0], also=_SKIPPED)
    return n, scale


class QK(NamedTuple):
    """The Q·Kᵀ product: ``scale · Q·Kᵀ`` (4-D via view, or a plain 3-D bmm), plus ``bias`` when
    it is a ``baddbmm`` that adds one (BLOOM's ALiBi), as a term in the scores' shape."""

    q: fx.Node
    k: fx.Node
    scale: float
    three_d: bool
    bias: Optional[BiasTerm] = None


def _qk(n: fx.Node) -> Optional[QK]:
    """The Q·Kᵀ product ``n`` (4-D via view or a plain 3-D ``bmm`` / ``baddbmm``), or None."""
    mms = (aten.bmm.default, aten.baddbmm.default)
    three_d = is_call(n, *mms)
    mm = n if three_d else (n.args[0] if is_call(n, *VIEWS) else None)
    if not is_call(mm, *mms):
        return None
    if mm.target is aten.baddbmm.default:  # beta · bias + alpha · (a @ b)
        added, a, b = mm.args
        beta, alpha = scalar(mm.kwargs.get("beta", 1)), scalar(mm.kwargs.get("alpha", 1))
        if beta is None or alpha is None or alpha == 0:
            return None
    else:
        (a, b), added, beta, alpha = mm.args, None, 0.0, 1.0
    # Casts are skipped too: under autocast Q / Kᵀ reach the bmm through a cast to its dtype
    # (LLaMA's RoPE makes q, k fp32); the rewrite casts q / k / v to the bmm dtype again.
    q, scale = _strip_scale(skip_views(a, also=_SKIPPED), alpha)
    kt, scale = _strip_scale(skip_views(b, also=_SKIPPED), scale)
    if not is_call(kt, aten.permute.default):
        return None
    nd = len(shape(kt))
    if list(kt.args[1]) != list(range(nd - 2)) + [nd - 1, nd - 2]:
        return None
    k, scale = _strip_scale(kt.args[0], scale)
    want = 3 if three_d else 4
    if len(shape(k)) != want:  # BLOOM's 3-D K is a view of the 4-D heads
        k = skip_views(k, also=_SKIPPED)
    if len(shape(q)) != want or len(shape(k)) != want:
        return None
    bias = None
    if added is not None and beta != 0:
        term = added if three_d else _heads_view(added, shape(n))
        if term is None:
            return None
        bias = BiasTerm(term, beta)
    return QK(q, k, scale, three_d, bias)


def _heads_view(bias: Any, scores: tuple) -> Optional[fx.Node]:
    """A ``baddbmm``'s bias (broadcasting against [B·H, Tq, Tk]) as a node that broadcasts against
    the 4-D scores [B, H, Tq, Tk] it is viewed as: ``view(bias, [B, H, ·, ·])`` (or [1, 1, ·, ·]
    for a bias shared by every head), added to the graph once; None if it does not split so."""
    if not isinstance(val(bias), torch.Tensor) or not val(bias).is_floating_point() or len(shape(bias)) > 3:
        return None
    dims = (1,) * (3 - len(shape(bias))) + shape(bias)
    b, h = scores[0], scores[1]
    if dims[0] == 1:
        heads = [1, 1]
    elif dims[0] == b * h:
        heads = [b, h]
    else:
        return None
    want = heads + list(dims[1:])
    for user in bias.users:  # the pass runs at two stages: reuse the view made at the first
        if is_call(user, aten.view.default) and list(user.args[1]) == want:
            return user
    try:
        value = aten.view.default(val(bias), want)
    except RuntimeError:  # strides that do not split (an expanded bias)
        return None
    with bias.graph.inserting_after(bias):
        node = bias.graph.call_function(aten.view.default, (bias, want))
    node.meta["val"] = value
    return node


def _fill(n: Any) -> Optional[float]:
    """The value of a mask fill that drops a key: -inf or a finfo.min of some float dtype."""
    v = scalar(n)
    if v is None:
        return None
    if v == float("-inf"):
        return v
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        if v <= torch.finfo(dt).min:
            return v
    return None


def _peel_scores(x: fx.Node, masks: list[MaskTerm], bias: list[BiasTerm]
                 ) -> Optional[tuple[fx.Node, fx.Node, float, bool]]:
    """Walk from the softmax input to Q·Kᵀ, collecting scale, bias terms and masks."""
    factor = 1.0  # product of the scale factors applied outside the current node
    n = x
    while True:
        # Step through casts and views one node at a time: the 4-D view of the Q·Kᵀ bmm must be
        # seen before it is skipped (softmax(scores.float()) puts a cast right above it).
        while True:
            got = _qk(n)
            if got is not None:
                return _product_of(got, factor, bias)
            if skip_views(n, also=_SKIPPED) is n:
                break
            n = n.args[0]
        if is_call(n, aten.where.self):
            cond, a, b = n.args
            fa, fb = _fill(a), _fill(b)
            if fa is not None and isinstance(b, fx.Node):
                masks.append(MaskTerm(cond, False, fa, factor))
                n = b
            elif fb is not None and isinstance(a, fx.Node):
                masks.append(MaskTerm(cond, True, fb, factor))
                n = a
            else:
                return None
            continue
        if is_call(n, aten.add.Tensor) and not n.kwargs and len(n.args) == 2 and all(isinstance(a, fx.Node) for a in n.args):
            for score, term in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
                sub_masks: list[MaskTerm] = []
                sub_bias: list[BiasTerm] = []
                got = _peel_scores(score, sub_masks, sub_bias)
                if got is not None:
                    if not isinstance(val(term), torch.Tensor) or not val(term).is_floating_point():
                        return None
                    bias.append(BiasTerm(term, factor))
                    q, k, s, three_d = got
                    masks += [m._replace(factor=m.factor * factor) for m in sub_masks]
                    bias += [b._replace(factor=b.factor * factor) for b in sub_bias]
                    return q, k, s * factor, three_d
            return None
        if is_call(n, aten.mul.Tensor, aten.div.Tensor) and scalar(n.args[1]) is not None:
            c = scalar(n.args[1])
            if c == 0:
                return None
            factor = factor * c if n.target is aten.mul.Tensor else factor / c
            if factor <= 0:
                return None
            n = n.args[0]
            continue
        got = _qk(n)
        return None if got is None else _product_of(got, factor, bias)


def _product_of(got: QK, factor: float, bias: list[BiasTerm]) -> tuple[fx.Node, fx.Node, float, bool]:
    """What _peel_scores returns for the Q·Kᵀ product ``got`` under the scale ``factor``; a bias
    the product adds (``baddbmm``) joins ``bias``."""
    if got.bias is not None:
        bias.append(got.bias._replace(factor=got.bias.factor * factor))
    return got.q, got.k, got.scale * factor, got.three_d


def _is_draw(n: Any) -> bool:
    """``n`` draws uniform random numbers: ``aten.rand`` or Inductor's ``inductor_random(.., "rand")``."""
    if is_call(n, aten.rand.default):
        return True
    return (isinstance(n, fx.Node) and n.op == "call_function" and str(n.target) == "prims.inductor_random.default"
            and len(n.args) > 2 and n.args[2] == "rand")


def _product(n: Any, depth: int = 0) -> tuple[float, list[Any]]:
    """``n`` as ``constant * product of tensor factors``, through (up to three) ``mul`` nodes and
    ``mul`` / ``div`` by constants."""
    if depth < 3 and is_call(n, aten.mul.Tensor, aten.div.Tensor):
        a, b = n.args
        c = scalar(b)
        if c is not None and c != 0:
            f, factors = _product(a, depth + 1)
            return (f * c if n.target is aten.mul.Tensor else f / c), factors
        if n.target is aten.mul.Tensor and isinstance(a, fx.Node) and isinstance(b, fx.Node):
            (fa, ta), (fb, tb) = _product(a, depth + 1), _product(b, depth + 1)
            return fa * fb, ta + tb
    return 1.0, [n]


def _is_softmax(n: Any) -> bool:
    return softmax_input(skip_views(n, also=_SKIPPED))[0] is not None


def _dropout(n: fx.Node) -> Optional[tuple[fx.Node, Dropout]]:
    """(P, its dropout) if ``n`` is a softmax's ``P * (draw > p) * (1 / (1 - p))``; None if ``n``
    multiplies no softmax; Skip for any other product of the probabilities."""
    factor, factors = _product(n)
    probs = [f for f in factors if _is_softmax(f)]
    if n is factors[0] or len(probs) != 1:
        return None
    others = [f for f in factors if f is not probs[0]]
    if not others:
        raise Skip(f"the probabilities are scaled by {factor:g} before the P·V matmul")
    keep = skip_views(others[0], also=_SKIPPED) if len(others) == 1 else None
    if keep is None or not is_call(keep, aten.gt.Scalar) or not _is_draw(keep.args[0]):
        raise Skip(f"the probabilities are multiplied by {', '.join(o.name for o in others)}, which is not a "
                   "dropout's fresh random draw (rand(P.shape) > p)")
    draw, p = keep.args[0], scalar(keep.args[1])
    if shape(draw) != shape(n) or len(draw.users) != 1:
        raise Skip(f"dropout draw {draw.name} is not one fresh draw per probability (shape {shape(draw)}, "
                   f"{len(draw.users)} users)")
    if p is None or not 0.0 < p < 1.0:
        raise Skip(f"dropout keep-mask {keep.name} compares against {keep.args[1]}, not a probability in (0, 1)")
    if abs(factor * (1.0 - p) - 1.0) > 1e-6:
        raise Skip(f"dropout p={p:g} scaled by {factor:g}, not 1 / (1 - p) = {1.0 / (1.0 - p):g}")
    return probs[0], Dropout(p, keep, draw)


def _near(start: fx.Node, found: Any, depth: int = 6, same_shape: bool = False) -> Optional[fx.Node]:
    """The first node within ``depth`` steps up from ``start`` for which ``found`` holds (through
    any input, or with ``same_shape`` only through values of ``start``'s shape)."""
    frontier, seen = [start], {start}
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for a in n.all_input_nodes:
                if a in seen:
                    continue
                if found(a):
                    return a
                seen.add(a)
                if not same_shape or shape(a) == shape(start):
                    nxt.append(a)
        frontier = nxt
    return None


def _between_skip(p: fx.Node) -> None:
    """Skip if ``p`` (the P·V matmul's first operand, not a softmax) is a softmax over another
    axis, or has a softmax over the key axis a few ops above it."""
    soft = softmax_of(p)
    if soft is not None:
        raise Skip(f"softmax over axis {soft[1]}, not the key axis")
    if _near(p, _is_softmax, depth=3, same_shape=True) is not None:
        raise Skip(f"{p.target} ({p.name}) between the softmax and the P·V matmul is not a dropout the matcher takes")


def _scores_skip(x: fx.Node) -> None:
    """Skip if the softmax input ``x``, which the matcher could not read, comes from a matmul."""
    if _near(x, lambda a: is_call(a, aten.bmm.default)) is None:
        return
    draw = _near(x, _is_draw, same_shape=True)  # a draw of the scores' shape, not one on the hidden states
    if draw is not None:
        raise Skip(f"a random draw ({draw.name}) on the scores before the softmax: dropout there is not attention "
                   "dropout")
    raise Unread("the scores reach the softmax through ops that are no scale, mask or bias the matcher takes")


def match_at(bmm: fx.Node) -> Optional[Match]:
    """A Match if ``bmm`` is the P·V product of an attention; None if it is no attention; Skip
    (with the reason) if it looks like one but is not exactly one."""
    p, vv = bmm.args
    p = skip_views(p, also=_SKIPPED)
    dropout = None
    if not _is_softmax(p):
        got = _dropout(p)
        if got is None:
            _between_skip(p)
            return None
        p, dropout = got
    x, zero_rows = softmax_input(skip_views(p, also=_SKIPPED))
    masks: list[MaskTerm] = []
    bias: list[BiasTerm] = []
    got = _peel_scores(x, masks, bias)
    if got is None:
        _scores_skip(x)
        return None
    q, k, scale, three_d = got
    v = skip_views(vv, also=_SKIPPED)
    out = bmm
    if not three_d:
        users = list(bmm.users)
        if len(users) != 1 or not is_call(users[0], *VIEWS) or len(shape(users[0])) != 4:
            raise Skip(f"the P·V matmul {bmm.name} is not read as one 4-D view")
        out = users[0]
    if len(shape(v)) != (3 if three_d else 4):
        raise Skip(f"V is {len(shape(v))}-D, Q is {3 if three_d else 4}-D")
    if any(m.factor != 1.0 and m.fill != float("-inf") for m in masks):
        raise Skip("a finfo.min mask fill rescaled afterwards (no longer finfo.min)")
    return Match(out=out, q=q, k=k, v=v, scale=scale, three_d=three_d, bias_terms=bias, masks=masks,
                 dtype=val(bmm).dtype, dropout=dropout, zero_rows=zero_rows, scores=x, probs=p)


def gqa_base(n: fx.Node) -> tuple[fx.Node, int]:
    """(K/V with Hkv heads, n_rep) if ``n`` is ``view(clone(expand(unsqueeze(x, 2))))``."""
    a = n
    if is_call(a, *VIEWS):
        a = a.args[0]
        if is_call(a, aten.clone.default):
            a = a.args[0]
        if is_call(a, aten.expand.default):
            u = a.args[0]
            if is_call(u, aten.unsqueeze.default) and u.args[1] == 2 and len(shape(u.args[0])) == 4:
                base = u.args[0]
                b, hkv, t, d = shape(base)
                es = shape(a)
                if es[:2] == (b, hkv) and es[3:] == (t, d) and shape(n)[1] == hkv * es[2]:
                    return base, es[2]
    return n, 1
