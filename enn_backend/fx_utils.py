"""FX helpers that enn's passes, its guard, its compiler and its debug tools share: a node's
value, shape and dtype, op tests, the graph's fake mode, ancestor walks, inserting a node with its
metadata, copying a graph module, its outputs and the inputs it writes, a tensor's content digest,
and moving a graph to another dtype.

Neutral: it imports torch and ``compat`` only, never a pass or the guard (tests/test_import_graph.py).
What is one side's business stays there: pinning nodes and planting faults in
``guard/graph_edit.py``, pattern matching in ``passes/``.

The graphs are ATen graphs whose nodes carry ``meta["val"]`` (a FakeTensor, a SymInt, or a tuple
of them). A node a pass creates must get one too: :func:`insert` computes it by running the op on
the inputs' values inside the graph's fake mode.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import operator
from typing import Any, Callable, Iterable, Optional

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from . import compat

aten = torch.ops.aten
prims = torch.ops.prims

# Shape-only ops: the value is the input's, seen through another shape (or as is: alias).
VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default})
CONVERT = prims.convert_element_type.default
LOW_PRECISION = (torch.float16, torch.bfloat16)


def val(n: Any) -> Any:
    """``meta["val"]`` of a node (None for anything else)."""
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def shape(n: Any) -> Optional[tuple]:
    """The shape of a tensor-valued node (sizes may be SymInts), else None."""
    v = val(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def tensor_dtype(n: Any) -> Optional[torch.dtype]:
    v = val(n)
    return v.dtype if isinstance(v, torch.Tensor) else None


def tensors_in(v: Any) -> list[torch.Tensor]:
    """The tensors of a value: itself, or the tensor items of a list / tuple."""
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for t in v if isinstance(t, torch.Tensor)]
    return []


def is_call(n: Any, *targets: Any) -> bool:
    """``n`` is a ``call_function`` node of one of ``targets``."""
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def fake_mode(graph: fx.Graph) -> Any:
    """The FakeTensorMode of the graph's values (None for a graph without fake values)."""
    for n in graph.nodes:
        v = val(n)
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            mode = getattr(t, "fake_mode", None)
            if mode is not None:
                return mode
    return None


def ancestors(roots: Iterable[fx.Node], within: Optional[Callable[[fx.Node], bool]] = None) -> set[fx.Node]:
    """``roots`` and every node they depend on (a root that is no node, a graph output's ``None``,
    is skipped). With ``within``, a node for which it is false is neither included nor walked
    through."""
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen or (within is not None and not within(n)):
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def graph_order(graph: fx.Graph) -> Callable[[fx.Node], int]:
    """A sort key: a node's position in ``graph`` (a topological order)."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    return index.__getitem__


def fake_value(target: Any, args: tuple, kwargs: dict, mode: Any) -> Any:
    """What ``target`` returns for these arguments, nodes replaced by their values, run in ``mode``
    (None: no mode is entered, the values run as they are)."""
    a, kw = fx.map_arg((args, kwargs), val)
    with mode if mode is not None else contextlib.nullcontext():
        return target(*a, **kw)


def refresh(n: fx.Node, mode: Any) -> None:
    """Recompute ``meta["val"]`` of ``n`` from its inputs' (possibly changed) values."""
    n.meta["val"] = fake_value(n.target, n.args, n.kwargs, mode)


def insert(graph: fx.Graph, target: Any, args: tuple, kwargs: Optional[dict] = None, *,
           before: Optional[fx.Node] = None, after: Optional[fx.Node] = None, mode: Any = None,
           meta: Optional[dict] = None) -> fx.Node:
    """A new ``call_function`` node right before ``before`` (or right after ``after``), with its
    value computed in ``mode`` and ``meta`` added."""
    if (before is None) == (after is None):
        raise ValueError("insert: give exactly one of before= / after=")
    where = graph.inserting_before(before) if before is not None else graph.inserting_after(after)
    with where:
        n = graph.call_function(target, args, kwargs or {})
    refresh(n, mode)
    n.meta.update(meta or {})
    return n


def _layout(v: Any) -> Any:
    return (tuple(v.shape), v.stride()) if isinstance(v, torch.Tensor) else None


def follow_layout(n: fx.Node, mode: Any) -> list[fx.Node]:
    """Recompute the values downstream of ``n`` after its value changed layout (a fused kernel's
    contiguous gradient in place of a transposed one); return the views made reshapes.

    A ``view`` of the new layout may be impossible (a permuted contiguous gradient viewed as
    ``[B, T, H * D]``). Inductor lowers any view as a reshape, but eager -- the guard's reference,
    a pinned node's neighbours -- refuses it, so such a view becomes ``aten.reshape``: the same
    values, a copy where a view cannot be had. The walk stops where a value's layout is as before.
    """
    reshaped: list[fx.Node] = []
    stack = list(n.users)
    while stack:
        u = stack.pop()
        old = val(u)
        if u.op != "call_function" or not isinstance(old, torch.Tensor):
            continue
        try:
            refresh(u, mode)
        except (RuntimeError, ValueError):  # eager raises the one, fake tensors the other
            if u.target not in (aten.view.default, aten._unsafe_view.default):
                raise
            u.target = aten.reshape.default
            refresh(u, mode)
            reshaped.append(u)
        if _layout(val(u)) != _layout(old):
            stack.extend(u.users)
    return reshaped


# ----------------------------------------------------------------------------- graph modules
def content_digest(t: torch.Tensor) -> str:
    """A digest of a tensor's dtype, shape and values (module buffers a graph relies on, a
    graph's constants)."""
    with compat.real_tensor_mode():
        h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
        flat = t.detach().contiguous().reshape(-1)
        if flat.numel():
            h.update(flat.view(torch.uint8).cpu().numpy().tobytes())
        return h.hexdigest()


def copy_gm(gm: fx.GraphModule) -> fx.GraphModule:
    """A deep copy of ``gm``, graph and attributes. Inductor calls enn's inner compile with its
    fake mode active; tensor constants the traced code made (transformers' masks hold a
    ``torch.tensor(0.0)``) are real tensors and must be copied as such."""
    with compat.real_tensor_mode():
        return copy.deepcopy(gm)


def inline_subgraph_calls(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with every ``invoke_subgraph`` call (``torch.compiler.nested_compile_region``)
    replaced by the nodes of its subgraph: the same computation, runnable eagerly on every torch
    (2.13's eager ``invoke_subgraph`` is forward-only: autograd through it asks for a fake mode).
    Edits ``gm`` in place and returns it."""
    hop = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    if hop is None or not any(n.target is hop for n in gm.graph.nodes):
        return gm
    graph = gm.graph
    while True:  # a region inside a region comes up once its outer region is inlined
        calls = [n for n in graph.nodes if n.target is hop]
        if not calls:
            break
        for call in calls:
            _inline_call(gm, call)
    graph.lint()
    gm.recompile()
    return gm


def _inline_call(gm: fx.GraphModule, call: fx.Node) -> None:
    """Replace one ``invoke_subgraph`` call of ``gm`` by its subgraph's nodes."""
    graph = gm.graph
    sub = operator.attrgetter(call.args[0].target)(gm) if call.args[0].op == "get_attr" else call.args[0]
    env = dict(zip([p for p in sub.graph.nodes if p.op == "placeholder"], call.args[2:]))
    results: Any = None
    with graph.inserting_before(call):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                results = fx.map_arg(n.args[0], lambda a: env[a])
                break
            if n.op == "get_attr":  # the subgraph's own attribute, kept under a unique name
                name = f"{call.name}_{n.target.replace('.', '_')}"
                setattr(gm, name, operator.attrgetter(n.target)(sub))
                env[n] = graph.get_attr(name)
                continue
            env[n] = graph.node_copy(n, lambda a: env[a])
    outs = list(results) if isinstance(results, (tuple, list)) else [results]
    for user in list(call.users):
        if user.target is operator.getitem:
            user.replace_all_uses_with(outs[user.args[1]])
            graph.erase_node(user)
    if call.users:  # the tuple itself used whole
        with graph.inserting_before(call):
            whole = graph.call_function(tuple, (outs,))
        call.replace_all_uses_with(whole)
    holder = call.args[0]
    graph.erase_node(call)
    if isinstance(holder, fx.Node) and holder.op == "get_attr" and not holder.users:
        graph.erase_node(holder)


def refresh_all(gm: fx.GraphModule) -> None:
    """Recompute every node's ``meta["val"]`` from the placeholders' values, in the graph's fake
    mode (nothing for a graph without fake values)."""
    mode = fake_mode(gm.graph)
    if mode is None:
        return
    args = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*args)


def has_low_precision(gm: fx.GraphModule) -> bool:
    """Does a value of the graph have an fp16 / bf16 tensor?"""
    return any(t.dtype in LOW_PRECISION for n in gm.graph.nodes for t in tensors_in(val(n)))


def _retargeted(x: Any, source: tuple[torch.dtype, ...], target: torch.dtype) -> Any:
    if isinstance(x, torch.dtype) and x in source:
        return target
    if isinstance(x, (list, tuple)):
        return type(x)(_retargeted(v, source, target) for v in x)
    return x


def retarget_dtypes(n: fx.Node, source: tuple[torch.dtype, ...], target: torch.dtype) -> None:
    """Every dtype in ``source`` among ``n``'s arguments (nested lists / tuples too) replaced by
    ``target``: how a graph is moved to another compute precision. ``meta["val"]`` is not
    refreshed."""
    n.args = _retargeted(n.args, source, target)
    n.kwargs = {k: _retargeted(v, source, target) for k, v in n.kwargs.items()}


def writes(n: fx.Node, target: fx.Node) -> bool:
    """``n`` writes into ``target`` (an argument its schema marks as written)."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return False
    return any(arg.alias_info is not None and arg.alias_info.is_write and a is target
               for arg, a in zip(n.target._schema.arguments, n.args))


def mutated_input_indices(gm: fx.GraphModule) -> list[int]:
    """Indices of placeholders the graph writes into (``copy_`` epilogues of AOT)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [i for i, p in enumerate(placeholders) if any(writes(u, p) for u in p.users)]


def output_nodes(gm: fx.GraphModule) -> list[Any]:
    """The graph's outputs (nodes, or ``None`` and constants where the graph returns them)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]


def result_nodes(gm: fx.GraphModule) -> list[Any]:
    """A graph's results as the guard compares them: its outputs, then for each input it writes
    (in :func:`mutated_input_indices` order) the node that writes it."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    writers = [next(u for u in placeholders[i].users if writes(u, placeholders[i]))
               for i in mutated_input_indices(gm)]
    return output_nodes(gm) + writers
