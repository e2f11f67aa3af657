"""NVTX pass (option ``nvtx``): every fused site's kernel runs inside a named profiler range.

Runs last, on the forward and backward graphs after partitioning (post-grad), so both halves of
a fused site are covered. A site is a node whose op is in :data:`SITES` (an enn kernel op, or an
SDPA kernel an enn pass emitted, ``meta[EMITTED]``); it is replaced by ``enn::ranged(name, spec,
...)`` running the same op (custom_ops/ranged.py), named ``enn/<kind>/<kernel> <module path>``
(enn_backend.nvtx). Its tensor outputs come back through the wrapper; an output that is an int
(SDPA's ``max_q`` / ``max_k`` on fixed shapes) or undefined (``cum_seq_q`` of a dense batch) is
put in the graph as the constant the op returns. A node with a symbolic int output is left as it
is (named in the debug log). The wrapper is one extern call per site, the cost of profiling.

Off (the default), the pass does not run: the graph and its FX-cache key are unchanged.
"""

from __future__ import annotations

import json
import logging
import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from .. import blame
from ..custom_ops.gemm import GemmKernel, problem_of, select_kernel
from ..custom_ops.pinned import EMITTED, encode_args, make_spec
from ..nvtx import range_name
from ..fx_utils import insert, val
from .manager import EnnPass, PassContext

log = logging.getLogger(__name__)

aten, enn = torch.ops.aten, torch.ops.enn


def _gemm_kernel(n: fx.Node) -> str:
    """The epilogue op's kernel argument, or the rules' choice for a direct call."""
    kernel = n.args[4] if len(n.args) > 4 else n.kwargs.get("kernel", "")
    if kernel:
        return str(kernel)
    residual = n.args[3] if n.target is enn.gemm_residual.default else None
    act = "none" if residual is not None else n.args[3]
    x, w, b = (val(a) if isinstance(a, fx.Node) else None for a in n.args[:3])
    return select_kernel(problem_of(x, w, b, act, val(residual) if residual is not None else None)).kernel.value


def _sdpa(kind: str, kernel: str) -> Callable[[fx.Node], tuple[str, str]]:
    return lambda n: (kind, kernel)


# op -> (node -> (kind, kernel)); SDPA's ops count only where an enn pass emitted them
SITES: dict[Any, Callable[[fx.Node], tuple[str, str]]] = {
    enn.attention.default: lambda n: ("attention", str(n.args[11])),
    enn.attention_backward.default: lambda n: ("attention_backward", str(n.args[13])),
    enn.gemm_bias_act.default: lambda n: ("epilogue", _gemm_kernel(n)),
    enn.gemm_residual.default: lambda n: ("epilogue", _gemm_kernel(n)),
}
for _fwd, _kernel in (("_scaled_dot_product_cudnn_attention", "cudnn"), ("_scaled_dot_product_flash_attention", "flash"),
                      ("_scaled_dot_product_efficient_attention", "efficient"),
                      ("_scaled_dot_product_flash_attention_for_cpu", "cpu_flash")):
    for _op_name, _kind in ((_fwd, "attention"), (_fwd + "_backward", "attention_backward")):
        _op = getattr(aten, _op_name, None)
        if _op is not None:
            SITES[_op.default] = _sdpa(_kind, _kernel)
_EMITTED_ONLY = {op for op in SITES if op.namespace == "aten"}


class NvtxPass(EnnPass):
    """Fused sites -> ``enn::ranged`` with the site's name (see the module doc)."""

    name = "nvtx"
    option = "nvtx"
    stage = "post_grad"

    def __call__(self, graph: fx.Graph, ctx: PassContext) -> int:
        wrapped = 0
        for n in list(graph.nodes):
            if n.op != "call_function" or n.target not in SITES:
                continue
            if n.target in _EMITTED_ONLY and not n.meta.get(EMITTED):
                continue
            kind, kernel = SITES[n.target](n)
            if wrap_node(graph, n, range_name(kind, kernel, blame.module_of(n))):
                wrapped += 1
        if wrapped:
            graph.lint()
        return wrapped


def wrap_node(graph: fx.Graph, n: fx.Node, name: str) -> bool:
    """Replace ``n`` by ``enn::ranged(name, ...)`` running the same op; False (unchanged) when an
    output cannot pass through the wrapper (a symbolic int)."""
    out = val(n)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if any(isinstance(o, torch.SymInt) for o in outs) or not any(isinstance(o, torch.Tensor) for o in outs):
        log.debug("enn nvtx: %s (%s) not ranged: an output is a symbolic int", n.name, n.target)
        return False
    keep = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor)]

    def is_tensor(x: Any) -> bool:
        return isinstance(x, fx.Node) and isinstance(val(x), torch.Tensor)

    def is_symint(x: Any) -> bool:
        return isinstance(x, fx.Node) and isinstance(val(x), torch.SymInt)

    template, tensors, ints = encode_args(n.args, dict(n.kwargs), is_tensor, is_symint)
    spec = json.dumps({**json.loads(make_spec(n.target, template)), "keep": keep}, sort_keys=True)
    mode = next((getattr(o, "fake_mode", None) for o in outs if isinstance(o, torch.Tensor)), None)
    meta = {k: n.meta[k] for k in ("stack_trace", "nn_module_stack", "fwd_nn_module_stack", EMITTED) if k in n.meta}
    r = insert(graph, enn.ranged.default, (name, spec, tensors, ints), before=n, mode=mode, meta=meta)
    if not isinstance(out, (tuple, list)):
        n.replace_all_uses_with(insert(graph, operator.getitem, (r, 0), after=r, mode=mode))
    else:
        for u in list(n.users):
            if u.op != "call_function" or u.target is not operator.getitem:
                raise ValueError(f"enn nvtx: {n.name} is read whole by {u.name}")
            i = u.args[1]
            if i in keep:
                u.replace_all_uses_with(insert(graph, operator.getitem, (r, keep.index(i)), after=r, mode=mode))
            else:
                const = outs[i]  # an int, or None for an undefined tensor
                for w in list(u.users):
                    w.args = fx.node.map_arg(w.args, lambda a, u=u, c=const: c if a is u else a)
                    w.kwargs = fx.node.map_arg(w.kwargs, lambda a, u=u, c=const: c if a is u else a)
            graph.erase_node(u)
    graph.erase_node(n)
    return True


__all__ = ["NvtxPass", "SITES", "wrap_node"]
