"""fp32 tail: run a model's output tail (final norm + projection) in fp32.

Option ``fp32_tail`` (``ENN_FP32_TAIL``): ``auto`` (default) applies it to bf16
inference graphs, ``on`` to fp16 and bf16 inference graphs, ``off`` never. Training
graphs are left alone (the loss path is the precision pass's business).

Why: two classes whose logits differ by less than a bf16 step (0.0625 at |x| ~ 10)
tie or swap when the final norm, the projection's input and its weights are rounded
to bf16. In fp32 the logits keep their ranking; the tail returns **fp32 logits**
(the one visible change: the output's dtype). Cost: one fp32 GEMM for the projection
(vocab x hidden) instead of a bf16 one, and the final norm in fp32.

The tail is found from the graph's first floating output: back through views and a
bias add to a projection (``mm``/``addmm``/``bmm``), then from its activation operand
back to the input of the last normalization feeding it (a ``mean``/``var_mean``
reduction on the way). The tail is every node on a path from that input to the
output, plus the casts/views that bring the projection's weight and the norm's
parameters in.

Skipped, with a ``PRECISION_SKIPPED`` fallback in the report, when a parameter
feeding the tail is itself stored in fp16/bf16 (fp32 math on bf16 weights would not
recover what the stored weights lost, and would cost an fp32 GEMM for nothing).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx

from ..report import FallbackKind
from ..fx_utils import CONVERT, LOW_PRECISION, ancestors, fake_mode, insert, refresh, retarget_dtypes, tensor_dtype, val
from .manager import EnnPass, PassContext
from .precision import is_pointwise, is_view

log = logging.getLogger(__name__)
aten = torch.ops.aten

_PROJ = {aten.mm.default, aten.addmm.default, aten.bmm.default}
_NORM_REDUCTIONS = {aten.mean.dim, aten.var_mean.correction, aten.var_mean.dim, aten.var.correction,
                    aten.sum.dim_IntList, aten._fused_rms_norm.default}


def _is_passthrough(n: fx.Node) -> bool:
    return n.op == "call_function" and (is_view(n) or n.target is CONVERT or n.target is aten.add.Tensor)


def find_projection(logits: fx.Node) -> fx.Node | None:
    cur = logits
    for _ in range(8):
        if cur.target in _PROJ:
            return cur
        if not _is_passthrough(cur):
            return None
        cands = [a for a in cur.all_input_nodes if a.op == "call_function"]
        if not cands:
            return None
        cur = max(cands, key=lambda a: _size(a))  # the bias is the smaller operand of the add
    return None


def _size(n: fx.Node) -> int:
    v = val(n)
    try:
        return int(v.numel()) if isinstance(v, torch.Tensor) else 0
    except Exception:  # noqa: BLE001
        return 0


def _operands(proj: fx.Node) -> tuple[fx.Node, fx.Node]:
    """(activation, weight) of a projection."""
    a, b = (proj.args[1], proj.args[2]) if proj.target is aten.addmm.default else (proj.args[0], proj.args[1])
    return a, b


def _param_source(n: fx.Node) -> fx.Node | None:
    """The placeholder a weight comes from through casts/views, if any."""
    cur = n
    for _ in range(8):
        if cur.op == "placeholder":
            return cur
        if cur.op != "call_function" or not (is_view(cur) or cur.target is CONVERT):
            return None
        cur = cur.args[0]
    return None


def find_tail(graph: fx.Graph) -> tuple[set[fx.Node], fx.Node, fx.Node, fx.Node] | None:
    """(tail nodes, tail input, projection, logits) or None when no tail is recognized."""
    out = next(n for n in graph.nodes if n.op == "output")
    outs = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    logits = next((o for o in outs if isinstance(o, fx.Node) and tensor_dtype(o) in LOW_PRECISION), None)
    if logits is None or logits.op != "call_function":
        return None
    proj = find_projection(logits)
    if proj is None:
        return None
    act, _w = _operands(proj)
    # back from the activation through the norm to its input
    start, norm_seen = act, False
    frontier, visited = [act], set()
    while frontier:
        c = frontier.pop()
        if c in visited or c.op != "call_function":
            continue
        visited.add(c)
        if c.target in _NORM_REDUCTIONS:
            norm_seen = True
            start = c.args[0]
            while start.op == "call_function" and (start.target is CONVERT or start.target in (aten.pow.Tensor_Scalar, aten.mul.Tensor) and start is not act):
                if start.target is aten.mul.Tensor and start.args[0] is not start.args[1]:
                    break
                start = start.args[0]
            continue
        if is_pointwise(c) or is_view(c) or c.target is CONVERT or c.target is torch.ops.aten.rsqrt.default or c.target.__name__.startswith("getitem"):
            frontier.extend(c.all_input_nodes)
    if not norm_seen:
        start = act
    anc_logits = ancestors([logits])
    tail = {n for n in anc_logits if n is not start and start in ancestors([n])} if start is not act else set()
    tail |= {n for n in anc_logits if n in ancestors([logits]) and (n is proj or proj in ancestors([n]))}
    tail.add(proj)
    # parameters' casts/views that enter the tail
    for n in list(tail):
        for a in n.all_input_nodes:
            cur = a
            while cur not in tail and cur.op == "call_function" and (is_view(cur) or cur.target is CONVERT):
                tail.add(cur)
                cur = cur.args[0]
    return tail, start, proj, logits


class Fp32TailPass(EnnPass):
    """Runs the output tail of low-precision inference graphs in fp32 (see module doc)."""

    name = "fp32_tail"
    option = "fp32_tail"
    stage = "joint"

    def __call__(self, graph: fx.Graph, ctx: PassContext) -> int:
        mode_opt = self.opts.fp32_tail
        if mode_opt == "off":
            return 0
        if any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes):
            return 0  # a training graph
        found = find_tail(graph)
        if found is None:
            return 0
        tail, start, proj, logits = found
        low = tensor_dtype(logits)
        if mode_opt == "auto" and low != torch.bfloat16:
            return 0
        params = {p for n in tail for a in n.all_input_nodes if (p := _param_source(a)) is not None}
        stored_low = sorted(p.name for p in params if tensor_dtype(p) in LOW_PRECISION and p is not _param_source(start))
        if stored_low:
            ctx.fallback(
                FallbackKind.PRECISION_SKIPPED, [proj],
                reason=f"parameters of the output tail are stored in {str(low).removeprefix('torch.')} ({', '.join(stored_low)})",
                action="fp32 tail not applied; the tail runs in the parameters' dtype")
            return 0
        mode = fake_mode(graph)
        if mode is None:
            return 0
        self._rewrite(graph, tail, start, logits, mode)
        ctx.promotion(proj, "fp32 output tail (final norm + projection); logits returned in fp32",
                      rule="fp32_tail")
        return 1

    @staticmethod
    def _rewrite(graph: fx.Graph, tail: set[fx.Node], start: fx.Node, logits: fx.Node, mode: Any) -> None:
        low = tensor_dtype(logits)
        if tensor_dtype(start) in LOW_PRECISION:
            up = insert(graph, CONVERT, (start, torch.float32), after=start, mode=mode)
            for u in list(start.users):
                if u in tail:
                    u.replace_input_with(start, up)
        for n in graph.nodes:  # graph order is topological
            if n not in tail:
                continue
            retarget_dtypes(n, LOW_PRECISION, torch.float32)
            refresh(n, mode)
        outside = [u for u in logits.users if u.op != "output" and u not in tail]
        if outside:
            back = insert(graph, CONVERT, (logits, low), after=logits, mode=mode)
            for u in outside:
                u.replace_input_with(logits, back)
