"""The precision pass: keep risky fp16/bf16 reductions and their results in fp32.

Runs last on the joint graph (forward + backward, or the inference graph), after
autocast's casts and every decomposition are explicit. Per reduction node it decides
whether low precision is safe; where it is not, the node is *promoted*: its input
chain is computed in fp32, the reduction runs in fp32, and its result stays fp32
through the pointwise/view ops that consume it (an "fp32 island"); the value is cast
back to its original dtype only where it leaves the island (a GEMM, a graph output).
Inside one fused Inductor kernel the island costs nothing (Inductor computes in fp32
registers anyway); what changes is that no intermediate is *rounded* or *overflows*.

Rules (each promotion is recorded with ``ctx.promotion(node, reason)``):

====================================  =========================================================
node                                  decision
====================================  =========================================================
fp16 sum / cumsum over N >= 1024      promote: the result exceeds 65504 once the mean
                                      magnitude passes 65504/N (100k ones -> inf in eager
                                      and Inductor alike)
fp16 var / var_mean                   promote: a variance is a squared magnitude (std > 256
                                      overflows)
fp16/bf16 reduction fed by x*x / pow  promote: the square overflows fp16 at |x| > 256 when it
                                      is materialized
fp32 reduction result cast down to    keep the fp32 value for its pointwise consumers (e.g.
fp16/bf16 and reused (per-row sized)  autograd's ``exp(x - lse)`` in logsumexp's backward:
                                      a bf16 lse of 1e5 is off by up to 256)
bf16 sum / mean / cumsum              safe: bf16 has fp32's range; Inductor accumulates in
                                      fp32 already
fp16 mean / amax / amin               safe: the result lies within the input's range
====================================  =========================================================
"""

from __future__ import annotations

import logging
import math
import operator
from typing import Any

import torch
import torch.fx as fx

from .. import compat
from ..fx_utils import CONVERT, LOW_PRECISION, fake_mode, insert, refresh, tensor_dtype, val
from .manager import EnnPass, PassContext

log = logging.getLogger(__name__)

aten, prims = torch.ops.aten, torch.ops.prims
FP16_SUM_LIMIT = 1024  # fp16 sums over at least this many elements are promoted

_SUMS = {aten.sum.dim_IntList, aten.sum.default, aten.cumsum.default}
_VARS = {aten.var.correction, aten.var_mean.correction, aten.var.dim, aten.var_mean.dim}
_MEANS = {aten.mean.dim, aten.mean.default}
_REDUCTIONS = _SUMS | _VARS | _MEANS | {aten.amax.default, aten.amin.default}


# ----------------------------------------------------------------------------- helpers
def is_view(n: fx.Node) -> bool:
    t = n.target
    if not isinstance(t, torch._ops.OpOverload):
        return False
    if t is aten.view.dtype:
        return False
    return bool(getattr(t, "is_view", False)) or t in (aten.clone.default, aten.reshape.default)


def is_pointwise(n: fx.Node) -> bool:
    t = n.target
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags and t is not CONVERT


def reduction_size(n: fx.Node) -> int:
    """How many input elements feed one output element of reduction ``n``."""
    x = val(n.args[0])
    if not isinstance(x, torch.Tensor):
        return 0
    shape = [int(s) if not isinstance(s, torch.SymInt) else 1 << 20 for s in x.shape]
    if n.target is aten.cumsum.default:
        return shape[n.args[1] % max(len(shape), 1)] if shape else 1
    dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    if dims is None or n.target in (aten.sum.default, aten.mean.default) or dims == []:
        return math.prod(shape) if shape else 1
    dims = [dims] if isinstance(dims, int) else dims
    return math.prod(shape[d % len(shape)] for d in dims) if shape else 1


def fed_by_square(n: fx.Node) -> bool:
    """Is the reduction's input x*x or x**2 (possibly through a convert)?"""
    x = n.args[0]
    while isinstance(x, fx.Node) and x.target is CONVERT:
        x = x.args[0]
    if not isinstance(x, fx.Node):
        return False
    if x.target is aten.mul.Tensor and len(x.args) == 2 and x.args[0] is x.args[1]:
        return True
    return x.target in (aten.pow.Tensor_Scalar,) and x.args[1] == 2


def decide(n: fx.Node) -> str | None:
    """Why reduction ``n`` must run in fp32, or None when its low precision is safe."""
    if n.target not in _REDUCTIONS:
        return None
    x_dtype = tensor_dtype(n.args[0])
    if x_dtype not in LOW_PRECISION:
        return None
    if n.target in _VARS and x_dtype == torch.float16:
        return "fp16 variance: a squared magnitude overflows fp16 once std > 256"
    if n.target in _SUMS and x_dtype == torch.float16:
        size = reduction_size(n)
        if size >= FP16_SUM_LIMIT:
            return (f"fp16 {n.target.__name__.split('.')[0]} over {size} elements: overflows 65504 once the mean "
                    f"magnitude passes {65504 / size:.3g}")
    if fed_by_square(n) and x_dtype == torch.float16 and n.target not in (aten.amax.default, aten.amin.default):
        return "fp16 reduction of a square: x*x overflows fp16 at |x| > 256"
    return None


# ----------------------------------------------------------------------------- rewriting
class Island:
    """Rewires consumers of a low-precision value to its fp32 version, as far as it is cheap."""

    def __init__(self, graph: fx.Graph, mode: Any) -> None:
        self.graph = graph
        self.mode = mode
        self.changed: list[fx.Node] = []

    def widen(self, low: fx.Node, wide: fx.Node, low_dtype: torch.dtype) -> None:
        """Consumers of ``low`` that are pointwise/view ops read ``wide`` (fp32) instead."""
        for user in list(low.users):
            if user is wide or user.op == "output":
                continue
            if user.target is CONVERT:
                user.replace_input_with(low, wide)
                refresh(user, self.mode)
                continue
            if not (is_pointwise(user) or is_view(user)):
                continue
            before = tensor_dtype(user)
            user.replace_input_with(low, wide)
            refresh(user, self.mode)
            self.changed.append(user)
            after = tensor_dtype(user)
            if before in LOW_PRECISION and after == torch.float32:
                self._narrow_for_others(user, before)

    def _narrow_for_others(self, node: fx.Node, low_dtype: torch.dtype) -> None:
        """``node`` is now fp32: users that may not change get a cast back; the rest widen further."""
        keep = [u for u in node.users if not (is_pointwise(u) or is_view(u) or u.target is CONVERT)]
        if keep:
            back = insert(self.graph, CONVERT, (node, low_dtype), after=node, mode=self.mode)
            for u in keep:
                u.replace_input_with(node, back)
        for u in list(node.users):
            if u.target is CONVERT or u in keep:
                continue
            before = tensor_dtype(u)
            refresh(u, self.mode)
            if before in LOW_PRECISION and tensor_dtype(u) == torch.float32:
                self.changed.append(u)
                self._narrow_for_others(u, before)


def promote_reduction(graph: fx.Graph, n: fx.Node, mode: Any) -> None:
    """Run reduction ``n`` on an fp32 copy of its input and keep its result fp32 downstream."""
    x = n.args[0]
    low_dtype = tensor_dtype(x)
    # the square feeding it (if any) is computed in fp32 too
    src = x
    if fed_by_square(n) and len(src.users) == 1 and src.target is not CONVERT:
        base = src.args[0]
        up = insert(graph, CONVERT, (base, torch.float32), before=src, mode=mode)
        src.args = tuple(up if a is base else a for a in src.args)
        refresh(src, mode)
    else:
        up = insert(graph, CONVERT, (x, torch.float32), before=n, mode=mode)
        n.replace_input_with(x, up)
    out_low = {}
    outs = [u for u in n.users if u.target is operator.getitem] if isinstance(val(n), (tuple, list)) else [n]
    for o in outs:
        out_low[o] = list(o.users)
    refresh(n, mode)
    for o in outs:
        if o is not n:
            refresh(o, mode)
        # every consumer first sees a cast back to the original dtype, then the island widens
        back = insert(graph, CONVERT, (o, low_dtype), after=o, mode=mode)
        for u in out_low[o]:
            u.replace_input_with(o, back)
        Island(graph, mode).widen(back, o, low_dtype)


def reduction_source(n: fx.Node, depth: int = 6) -> fx.Node | None:
    """The reduction a value derives from through pointwise/view ops, if its size did not grow."""
    numel = _numel(n)
    stack, seen = [(n, 0)], set()
    while stack:
        cur, d = stack.pop()
        if cur in seen or d > depth or not isinstance(cur, fx.Node):
            continue
        seen.add(cur)
        red = cur
        if cur.target is operator.getitem and isinstance(cur.args[0], fx.Node) and cur.args[0].target in _REDUCTIONS:
            red = cur.args[0]  # e.g. var_mean's mean: the same size rule applies
        if red.target in _REDUCTIONS or red.target is aten.logsumexp.default:
            # only a value no larger than the reduction's result (per-row sized: lse, a mean) is
            # kept in fp32; a full-size normalized activation (LayerNorm / BatchNorm output,
            # x - mean) must keep autocast's cast, or the island widens whole activations
            return red if _numel(red) is not None and numel is not None and _numel(red) >= numel else None
        if is_pointwise(cur) or is_view(cur) or cur.target is CONVERT:
            stack.extend((a, d + 1) for a in cur.all_input_nodes)
    return None


def _numel(n: fx.Node) -> int | None:
    v = val(n)
    if isinstance(v, (list, tuple)):
        v = v[0]
    if not isinstance(v, torch.Tensor):
        return None
    try:
        return int(v.numel())
    except Exception:  # noqa: BLE001 - symbolic size
        return None


class PrecisionPass(EnnPass):
    """fp32 accumulation and fp32 islands for risky low-precision reductions."""

    name = "precision"
    option = "precision"
    stage = "joint"

    def __call__(self, graph: fx.Graph, ctx: PassContext) -> int:
        mode = fake_mode(graph)
        if mode is None:
            return 0
        count = 0
        for n in list(graph.nodes):
            if n.op != "call_function":
                continue
            reason = decide(n)
            if reason is not None:
                promote_reduction(graph, n, mode)
                ctx.promotion(n, reason, op=str(n.target), rule="reduction")
                log.debug("enn precision: %s promoted to fp32 (%s)", n.name, reason)
                count += 1
            elif n.target is CONVERT and n.args[1] in LOW_PRECISION and tensor_dtype(n.args[0]) == torch.float32:
                count += self._keep_fp32_result(graph, n, ctx, mode)
        if count:
            compat.stable_topological_sort(graph)
            graph.lint()
        return count

    def _keep_fp32_result(self, graph: fx.Graph, n: fx.Node, ctx: PassContext, mode: Any) -> int:
        users = [u for u in n.users if u.op != "output" and (is_pointwise(u) or is_view(u))]
        if not users:
            return 0
        src = n.args[0]
        red = reduction_source(src)
        if red is None:
            return 0
        island = Island(graph, mode)
        island.widen(n, src, n.args[1])
        if not island.changed:
            return 0
        ctx.promotion(n, f"fp32 result of reduction {red.name} kept for {len(users)} pointwise consumer(s) "
                              f"instead of its {str(n.args[1]).removeprefix('torch.')} rounding",
                      op=str(red.target), rule="fp32_result")
        return 1
