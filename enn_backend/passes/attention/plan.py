"""Everything decided about one matched attention before the graph is edited: :func:`plan_site`.

In order: the K/V to read (grouped-query heads), what the masks and biases are (masks.py), the
forward / backward regions and their gradients (regions.py), the problem the kernels' checkers
see, the kernel the policy chooses, and whether that kernel can take this site. A site that cannot
be fused raises :class:`~.match.Skip` here, with the graph untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
import torch.fx as fx

from ... import compat
from ...custom_ops.attention import Backend
from ...options import Options
from ...registry import Measurement
from ...fx_utils import shape, val
from ..manager import current_module_state
from .key_padding import KeyPadding, take
from .kernels import EnnOpKernel, Kernel, kernel_for
from .constants import Dims
from .masks import Structure, classify
from .provenance import tensor_provenance
from .match import Match, Skip, gqa_base
from .policy import Choice, choose
from .problem import AttentionProblem
from .regions import Leak, Regions, find_regions, leak_reason


@dataclass
class Plan:
    match: Match
    k: fx.Node  # K / V as the kernels read them: the grouped-query base (Hkv heads) or match.k / .v
    v: fx.Node
    rep: int  # how often the graph repeats each K/V head (1: no grouped-query base)
    structure: Structure
    regions: Regions
    bias_grad: bool
    # The distinct bias term nodes (inputs 3.. of the regions) and each one's factor in the
    # kernel's bias (summed over the terms it appears in): the gradient of term node ``t`` is
    # ``factor * dbias`` summed down to ``t``'s shape.
    bias_terms: list[tuple[fx.Node, float]]
    problem: AttentionProblem
    choice: Choice
    kernel: Kernel
    masked_rows: str  # enn::attention's fully-masked-row semantics ("eager" | "zero")
    refusal: str = ""  # why the chosen kernel cannot take this site ("" when it can)
    provenance: str = ""  # what the mask tensors left to the kernel are made of (provenance.tensor_provenance)
    padding: Optional[KeyPadding] = None  # a finfo.min mask taken as band flags + key padding (key_padding.py)
    padding_refused: str = ""  # why a finfo.min mask of a band and key padding stays a tensor

    @property
    def backend(self) -> Backend:
        return self.choice.backend


def _hint(s: Any) -> int:
    return compat.size_hint(s)  # never int(s): that would specialize dynamic shapes


def _kv(m: Match) -> tuple[fx.Node, fx.Node, int]:
    if m.three_d:
        return m.k, m.v, 1
    (k, rep_k), (v, rep_v) = gqa_base(m.k), gqa_base(m.v)
    if rep_k != rep_v or rep_k == 1:
        return m.k, m.v, 1
    return k, v, rep_k


def _bias_shape(st: Structure, three_d: bool) -> Optional[tuple]:
    """The shape of the bias the kernels get: the terms and finfo.min masks added (broadcast)."""
    shapes = [shape(b.node) for b in st.bias] + [shape(m.cond) for m in st.floors]
    if not shapes:
        return None
    out = tuple(torch.broadcast_shapes(*[torch.Size(s) for s in shapes]))
    return (out[0], 1) + out[1:] if three_d and len(out) == 3 else out


def _problem(m: Match, k: fx.Node, v: fx.Node, st: Structure, bias_grad: bool, training: bool,
             padding: bool) -> AttentionProblem:
    qv, kv, vv = val(m.q), val(k), val(v)
    dev = qv.device
    cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" and torch.cuda.is_available() else (0, 0)
    heads_q = 1 if m.three_d else _hint(qv.shape[1])
    heads_kv = 1 if m.three_d else _hint(kv.shape[1])
    return AttentionProblem(
        device=dev.type, capability=tuple(cap), dtype=str(m.dtype).removeprefix("torch."),
        head_dim=_hint(qv.shape[-1]), head_dim_v=_hint(vv.shape[-1]), tq=_hint(qv.shape[-2]), tk=_hint(kv.shape[-2]),
        heads_q=heads_q, heads_kv=heads_kv, causal=st.causal, window=st.window,
        has_mask=bool(st.keep), has_bias=st.has_bias or padding, bias_grad=bias_grad, alibi=st.alibi is not None,
        training=training, bias_finite=padding or st.bias_finite(), bias_may_saturate=st.bias_may_saturate(),
        static_shapes=all(isinstance(d, int) for d in (qv.shape[-2], kv.shape[-2])), key_padding=padding,
        dropout=m.dropout.p if m.dropout is not None else 0.0, batch=_hint(qv.shape[0]))


def _refusal(m: Match, st: Structure, backend: Backend, v: fx.Node, kernel: Kernel) -> str:
    """Why the chosen kernel cannot take this site ("" when it can)."""
    if m.dropout is not None and kernel is EnnOpKernel and backend is not Backend.EXPLICIT:
        return (f"attention dropout: {backend} would run inside enn::attention here, where only the explicit "
                "math draws a dropout mask")
    if st.alibi is not None and st.alibi.positions != "exact" and backend is not Backend.FLEX:
        return (f"ALiBi positions rounded to {st.alibi.positions}: only FlexAttention reproduces them "
                f"({backend} would add exact positions)")
    out = (*shape(m.q)[:-1], shape(v)[-1])
    if out != shape(m.out):
        return f"output shape {out} != {shape(m.out)}"
    return ""


def _terms(st: Structure) -> list[tuple[fx.Node, float]]:
    """Each distinct bias term node with its factor in the kernel's bias, summed over its terms."""
    factors: dict[fx.Node, float] = {}
    for b in st.bias:
        factors[b.node] = factors.get(b.node, 0.0) + b.factor
    return list(factors.items())


def plan_site(graph: fx.Graph, m: Match, opts: Options) -> Plan:
    """Decide how to fuse match ``m``; raises Skip when it cannot be fused whatever the kernel."""
    k, v, rep = _kv(m)
    tq, tk = shape(m.q)[-2], shape(k)[-2]
    dims = Dims(tq, tk, 1 if m.three_d else shape(m.q)[1])
    st = classify(m.masks, m.bias_terms, dims, current_module_state())
    if m.dropout is None:
        padding, padding_refused = take(st, m, dims, current_module_state())
    else:  # DeadRows' closed form is the uniform row without dropout: the mask stays a tensor
        padding, padding_refused = None, ("attention dropout: eager drops keys of the rows that keep none too, "
                                          "which the closed form of those rows does not")
    if st.causal and tq != tk:
        raise Skip("causal mask with Tq != Tk (SDPA's causal is top-left aligned)")
    terms = _terms(st)
    inputs = [m.q, k, v] + [t for t, _ in terms] + ([st.alibi.term] if st.alibi else [])
    try:
        regions = find_regions(graph, m.out, inputs)
    except Leak as leak:
        raise Skip(leak_reason(leak, m)) from None
    q, k, v = regions.inputs[:3]  # a copy that is read outside too (a returned K/V cache) is read instead
    m = replace(m, q=q, k=k if rep == 1 else m.k, v=v if rep == 1 else m.v)
    grads = regions.grads
    if m.dropout is not None and any(u not in regions.forward and u not in regions.backward
                                     for u in m.dropout.keep.users):
        raise Skip(f"the dropout mask {m.dropout.keep.name} is also read outside the attention")
    if st.alibi is not None and len(inputs) - 1 in grads:
        raise Skip("ALiBi slopes that need a gradient")
    bias_grad = any(i >= 3 for i in grads)
    problem = _problem(m, k, v, st, bias_grad, bool(grads), padding is not None)
    # with measurement on (measure_ms, max-autotune), eligible SDPA kernels are timed on the site's shapes
    choice = choose(problem, opts.attention_backend, opts.attention_order, measurement=Measurement.of(opts))
    bias_shape = _bias_shape(st, m.three_d)
    kernel = kernel_for(choice.backend, problem, bias_shape[-1] if bias_shape else None)
    refusal = "" if choice.backend is Backend.INDUCTOR else _refusal(m, st, choice.backend, v, kernel)
    provenance = "; ".join(filter(None, (
        tensor_provenance(t, dims, shape(m.q)[0], current_module_state())
        for t in [b.node for b in st.bias] + [t.cond for t in st.keep + st.floors if t.keep_when_true])))
    masked_rows = "zero" if opts.masked_rows == "zero" or m.zero_rows else "eager"
    return Plan(m, k, v, rep, st, regions, bias_grad, terms, problem, choice, kernel, masked_rows, refusal, provenance,
                padding, padding_refused)
