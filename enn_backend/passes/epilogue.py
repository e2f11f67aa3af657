"""Epilogue pass: GEMM + bias + activation -> ``enn::gemm_bias_act``; GEMM + residual add ->
``enn::gemm_residual``.

Runs on the joint graph (training: forward + backward; inference: the forward), where
Inductor's decompositions have already run. There GELU is no longer one node: it is an
``erf`` (or ``tanh``) chain of muls and adds, wrapped in ``convert_element_type`` to fp32
and back for bf16/fp16; SiLU is ``x / (1 + exp(-x))``; relu stays ``aten.relu``. Those
chains change between torch versions, so the pass does not match their structure.
It matches by value instead:

1. source: ``addmm(bias, x, wT)``, or ``mm(x, wT)`` with an optional ``add`` of a bias
   vector, with an optional ``view`` that reshapes the leading dims (a 3-D linear);
2. closure: the pointwise nodes downstream of the source whose only tensor inputs are
   the source or other closure nodes (functions of the pre-activation alone);
3. fingerprint: every closure node is evaluated on a float64 probe vector (casts count
   as identity) and compared with exact relu / gelu / gelu_tanh / silu; a node equal to
   one of them (to 1e-12) in the GEMM's dtype is the activation output. exact GELU and
   tanh GELU differ by ~5e-4 there, so they are never confused.

A match is rewritten only if every node between the GEMM and the activation output is
used by nothing else. In a training graph with gelu/silu the backward reads the
pre-activation (``gelu'(pre)``); the fused kernel does not return it, and keeping the
GEMM as well would compute it twice, so the match is declined. relu's backward reads
the relu output (``out <= 0``), so relu is fused in training too.

Without an activation, the GEMM's single user may be an ``add`` of a tensor of the output's
shape and dtype: the residual family (``x + self.o_proj(h)``). With measurement on
(``measure_ms``, or max-autotune) a GEMM + bias alone is a site too (the bias family), which
only a measured win takes off Inductor's ``addmm``.

Then the kernel registry (``custom_ops/gemm_policy.py``: a checker per kernel, the rules that
order them, measurement when it is on) decides whether a fused kernel beats Inductor on this
device, dtype and shape; where it does not, or the family is named in ``epilogue_off``, the
graph is left to Inductor. The chosen kernel is the emitted op's ``kernel`` argument.

Every decision is visible: rewrites as ``ctx.fusion("epilogue")`` and a kernel choice;
declines in the debug log and as an ``inductor`` kernel choice with the reason; declines
the user could act on (exact GELU on CUDA, fp16 on a CPU without fp16 GEMM, a bias in
another dtype) also as one ``PASS_SKIPPED`` fallback per graph and reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from enn_backend.custom_ops import gemm as G

from .. import compat
from ..registry import Measurement
from ..report import FallbackKind
from ..fx_utils import VIEWS, ancestors, insert, is_call, val
from .manager import EnnPass, PassContext

log = logging.getLogger(__name__)

aten = torch.ops.aten
prims = torch.ops.prims

_MAX_CLOSURE = 64  # pointwise nodes examined per GEMM
_PROBE = torch.cat([torch.linspace(-8.0, 8.0, 161, dtype=torch.float64),
                    torch.tensor([0.0, 1e-3, -1e-3, 0.3, -0.3, 12.5, -12.5], dtype=torch.float64)])
_REFERENCES = {act: G.ACT_FN[act](_PROBE) for act in G.ACTIVATIONS}
_CASTS = {prims.convert_element_type.default, aten._to_copy.default}


# ----------------------------------------------------------------- step 1: the GEMM source
@dataclass
class Source:
    gemm: fx.Node  # addmm or mm
    x: fx.Node
    w_t: fx.Node  # the [K, N] operand
    bias: fx.Node | None
    nodes: list[fx.Node]  # gemm, then the optional view / bias add, in order
    view_size: Any = None  # the view's size argument, when the source has one

    @property
    def out(self) -> fx.Node:
        return self.nodes[-1]


def find_source(n: fx.Node) -> Source | None:
    """``n`` as the GEMM of a linear layer (see the module doc), or None."""
    if is_call(n, aten.addmm.default):
        if len(n.args) > 3 or n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1:
            return None
        bias, x, w_t = n.args[:3]
        if not _is_vector_bias(bias, n):
            return None
        src = Source(n, x, w_t, bias, [n])
    elif is_call(n, aten.mm.default):
        src = Source(n, n.args[0], n.args[1], None, [n])
    else:
        return None
    if not (val(src.x) is not None and val(src.x).dim() == 2 and val(src.w_t) is not None and val(src.w_t).dim() == 2):
        return None
    cur = src.out
    if len(cur.users) == 1:
        (u,) = cur.users
        if is_call(u, *VIEWS) and _same_last_dim(u, cur):
            src.nodes.append(u)
            src.view_size = u.args[1]
            cur = u
    if src.bias is None and len(cur.users) == 1:
        (u,) = cur.users
        if is_call(u, aten.add.Tensor) and len(u.args) == 2 and not u.kwargs:
            other = u.args[1] if u.args[0] is cur else u.args[0]
            if other is not cur and _is_vector_bias(other, src.gemm):
                src.bias = other
                src.nodes.append(u)
    return src


def _is_vector_bias(b: Any, gemm: fx.Node) -> bool:
    bv, gv = val(b), val(gemm)
    return (isinstance(bv, torch.Tensor) and isinstance(gv, torch.Tensor) and bv.dim() == 1
            and bv.shape[0] == gv.shape[-1])


def _same_last_dim(view: fx.Node, base: fx.Node) -> bool:
    v, b = val(view), val(base)
    return isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[-1] == b.shape[-1]


# ----------------------------------------------------------------- step 2-3: the activation
def _is_pointwise(n: fx.Node) -> bool:
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in n.target.tags:
        return False
    return n.target in _CASTS or torch.Tag.pointwise in n.target.tags


def _evaluate(n: fx.Node, values: dict[fx.Node, torch.Tensor]) -> torch.Tensor | None:
    """``n`` on the probe, given its inputs' probe values; None if it cannot be evaluated."""
    tensor_inputs = [a for a in n.all_input_nodes]
    if not tensor_inputs or any(a not in values for a in tensor_inputs):
        return None
    if n.target in _CASTS:
        dtype = n.args[1] if n.target is prims.convert_element_type.default else n.kwargs.get("dtype")
        src = values[n.args[0]]
        if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            return src  # float casts are identity on the float64 probe
        return src.to(dtype)

    def sub(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return values[a]
        if isinstance(a, (list, tuple)):
            return type(a)(sub(v) for v in a)
        return a

    try:
        out = n.target(*sub(n.args), **{k: sub(v) for k, v in n.kwargs.items()})
    except Exception:  # noqa: BLE001 - an op that cannot run on the probe is simply not matched
        return None
    return out if isinstance(out, torch.Tensor) and out.shape == _PROBE.shape else None


def _closure(src: fx.Node) -> dict[fx.Node, torch.Tensor]:
    """Pointwise nodes that are functions of ``src`` alone, with their probe values."""
    values: dict[fx.Node, torch.Tensor] = {src: _PROBE}
    frontier = list(src.users)
    seen: set[fx.Node] = set()
    changed = True
    while changed and len(values) <= _MAX_CLOSURE:
        changed = False
        for u in list(frontier):
            if u in values or not _is_pointwise(u):
                continue
            v = _evaluate(u, values)
            if v is None:
                continue
            values[u] = v
            changed = True
            for w in u.users:
                if w not in seen:
                    seen.add(w)
                    frontier.append(w)
    return values


def fingerprint(v: torch.Tensor) -> str | None:
    """The activation whose float64 values ``v`` equals, or None."""
    if not v.is_floating_point():
        return None
    for act, ref in _REFERENCES.items():
        if torch.allclose(v, ref, rtol=1e-12, atol=1e-12):
            return act
    return None


@dataclass
class Match:
    src: Source
    out: fx.Node  # the activation output (in the GEMM dtype)
    act: str
    chain: list[fx.Node] = field(default_factory=list)  # GEMM..out, graph order
    outside: list[fx.Node] = field(default_factory=list)  # users of the chain besides out's
    residual: fx.Node | None = None  # the residual family: the tensor added to the GEMM's output

    @property
    def family(self) -> str:
        return "residual" if self.residual is not None else ("bias" if self.act == "none" else self.act)


def find_match(src: Source) -> Match | None:
    with compat.real_tensor_mode():
        values = _closure(src.out)
        acts = {n: fingerprint(v) for n, v in values.items() if n is not src.out}
    gemm_val = val(src.out)
    cands = []
    for n, act in acts.items():
        nv = val(n)
        if act and isinstance(nv, torch.Tensor) and nv.dtype == gemm_val.dtype and nv.shape == gemm_val.shape:
            cands.append((n, act))
    if not cands:
        return None
    order = {n: i for i, n in enumerate(src.out.graph.nodes)}
    out, act = min(cands, key=lambda c: order[c[0]])
    # the chain: closure nodes and source nodes that out depends on
    pool = set(values) | set(src.nodes)
    chain = ancestors([out], within=pool.__contains__) | set(src.nodes)
    outside = sorted({u for n in chain if n is not out for u in n.users if u not in chain}, key=order.get)
    return Match(src, out, act, sorted(chain, key=order.get), outside)


def _chain_match(src: Source, out: fx.Node, act: str, residual: fx.Node | None = None) -> Match:
    chain = list(src.nodes) + ([out] if out is not src.out else [])
    members = set(chain)
    outside = sorted({u for n in chain if n is not out for u in n.users if u not in members},
                     key={n: i for i, n in enumerate(src.out.graph.nodes)}.get)
    return Match(src, out, act, chain, outside, residual)


def find_residual(src: Source) -> Match | None:
    """``src`` followed by one ``add`` of a tensor of its output's shape and dtype, or None."""
    if len(src.out.users) != 1:
        return None
    (u,) = src.out.users
    if not (is_call(u, aten.add.Tensor) and len(u.args) == 2 and not u.kwargs):
        return None
    other = u.args[1] if u.args[0] is src.out else u.args[0]
    ov, gv = val(other), val(src.out)
    if other is src.out or not isinstance(ov, torch.Tensor) or ov.shape != gv.shape or ov.dtype != gv.dtype:
        return None
    return _chain_match(src, u, "none", residual=other)


def find_bias_only(src: Source) -> Match | None:
    """``src`` with a bias and nothing fused after it: the bias family."""
    return _chain_match(src, src.out, "none") if src.bias is not None else None


# ----------------------------------------------------------------- the pass
class EpiloguePass(EnnPass):
    """addmm / mm (+ bias) + relu / gelu / gelu_tanh / silu -> enn::gemm_bias_act."""

    name = "epilogue"
    option = "epilogue"
    stage = "joint"

    def __call__(self, graph: fx.Graph, ctx: PassContext) -> int:
        matches = 0
        skipped: dict[str, list[fx.Node]] = {}
        for n in list(graph.nodes):
            if n.graph is not graph or n.op != "call_function":
                continue
            src = find_source(n)
            if src is None:
                continue
            m = find_match(src) or find_residual(src)
            if m is None and self.opts.measure_budget_ms() > 0:
                m = find_bias_only(src)
            if m is None:
                continue
            ok, reason, choice = self.decide(m)
            # how the choice was made (measured, cached) and its times, whichever kernel won
            how = {"how": choice.how, "timings_ms": dict(choice.timings_ms)} if choice and choice.how != "rule" else {}
            if not ok:
                log.debug("enn epilogue: declined %s -> %s at %s: %s", n.name, m.family, m.out.name, reason)
                ctx.kernel_choice(m.out, "inductor", f"epilogue declined: {reason}", act=m.family, **how)
                if choice is not None and choice.actionable:
                    skipped.setdefault(reason, []).append(m.out)
                continue
            new = rewrite(graph, m, choice.kernel)
            matches += 1
            ctx.fusion("epilogue")
            ctx.kernel_choice(new, choice.kernel.value, choice.reason, act=m.family,
                              dtype=str(val(m.src.gemm).dtype).removeprefix("torch."), replaced=m.out.name, **how)
            log.debug("enn epilogue: %s + %s (%s) -> %s [%s]", n.name, m.family, m.out.name, new.name, choice.kernel)
        for reason, nodes in skipped.items():
            ctx.fallback(FallbackKind.PASS_SKIPPED, nodes, reason=f"epilogue fusion declined for {len(nodes)} GEMM(s): {reason}",
                         action="left to Inductor (extern GEMM + fused pointwise)")
        if matches:
            compat.stable_topological_sort(graph)
        return matches

    def decide(self, m: Match) -> tuple[bool, str, G.KernelChoice | None]:
        """(rewrite?, reason, kernel choice) for a match: the registry's choice (measured when on)."""
        if m.outside:
            names = ", ".join(u.name for u in m.outside[:3]) + (f" and {len(m.outside) - 3} more" if len(m.outside) > 3 else "")
            return False, (f"the pre-activation is also read by {len(m.outside)} other op(s) ({names}), "
                           "e.g. the activation's backward; the fused kernel does not return it"), None
        choice = G.select_kernel(self.problem(m), measurement=self.measurement())
        if choice.kernel is G.GemmKernel.INDUCTOR:
            return False, choice.reason, choice
        return True, choice.reason, choice

    def problem(self, m: Match) -> G.GemmProblem:
        """The registry's problem for a match, from the graph's fake values."""
        gv, bv, xv, wv = val(m.src.gemm), val(m.src.bias), val(m.src.x), val(m.src.w_t)
        sizes = (xv.shape[0], wv.shape[1], xv.shape[1])
        fixed = all(isinstance(s, int) for s in sizes)
        return G.GemmProblem(
            device_type=gv.device.type, dtype=gv.dtype, act=m.act, has_bias=bv is not None,
            bias_dtype_matches=bv is None or bv.dtype == gv.dtype, autotune=G.autotuning(),
            m=sizes[0] if fixed else None, n=sizes[1] if fixed else None, k=sizes[2] if fixed else None,
            residual=m.residual is not None, unfused=m.family in self.opts.unfused_epilogues(),
            layout=G.layout_of(xv, wv.t()))

    def measurement(self) -> Measurement | None:
        return Measurement.of(self.opts)


def _rows_by(size: Any) -> list[Any]:
    """A 2-D view's size ``[rows, cols]`` with the rows left to the view (-1) where the columns are
    a number."""
    rows, cols = size
    return [-1, cols] if isinstance(cols, int) else [rows, cols]


def rewrite(graph: fx.Graph, m: Match, kernel: str = "") -> fx.Node:
    """Replace the chain GEMM..out by ``enn::gemm_bias_act`` / ``enn::gemm_residual`` running
    ``kernel`` (+ the view back)."""
    src, out = m.src, m.out
    mode = getattr(val(src.gemm), "fake_mode", None)  # graphs traced without fake values have none
    if is_call(src.w_t, aten.permute.default) and list(src.w_t.args[1]) == [1, 0]:
        weight = src.w_t.args[0]
    elif is_call(src.w_t, aten.t.default):
        weight = src.w_t.args[0]
    else:
        weight = insert(graph, aten.permute.default, (src.w_t, [1, 0]), before=out, mode=mode)
    meta = {key: out.meta[key] for key in ("stack_trace", "nn_module_stack", "source_fn_stack") if key in out.meta}
    # the GEMM's module (the linear layer), not its caller's; in a backward graph, the forward's
    stack = src.gemm.meta.get("nn_module_stack") or src.gemm.meta.get("fwd_nn_module_stack")
    if stack:
        meta["nn_module_stack"] = stack
    kernel = str(kernel)
    if m.residual is not None:
        residual = m.residual
        if src.view_size is not None:  # the residual as the 2-D GEMM output it is added to
            flat = aten.view.default if val(residual).is_contiguous() else aten.reshape.default
            # rows as -1: a symbolic row count would print as a symbol (s27) no eager run of the graph binds
            residual = insert(graph, flat, (residual, _rows_by(val(src.gemm).shape)), before=out, mode=mode)
        new = insert(graph, torch.ops.enn.gemm_residual.default, (src.x, weight, src.bias, residual, kernel),
                     before=out, mode=mode, meta=meta)
    else:
        new = insert(graph, torch.ops.enn.gemm_bias_act.default, (src.x, weight, src.bias, m.act, kernel), before=out,
                     mode=mode, meta=meta)
    result = new
    if src.view_size is not None:
        result = insert(graph, aten.view.default, (new, src.view_size), before=out, mode=mode)
    out.replace_all_uses_with(result)
    for n in reversed(m.chain):
        if not n.users:
            graph.erase_node(n)
    if src.w_t.op == "call_function" and not src.w_t.users:
        graph.erase_node(src.w_t)
    return new


__all__ = ["EpiloguePass", "find_source", "find_match", "find_residual", "find_bias_only", "fingerprint", "rewrite",
           "Match", "Source"]
