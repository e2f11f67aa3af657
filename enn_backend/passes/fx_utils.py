"""FX helpers shared by enn's passes: a node's value, shape and dtype, op tests, the graph's fake
mode, ancestor walks, and inserting a node with its metadata.

A pass sees post-decomposition ATen graphs whose nodes carry ``meta["val"]`` (a FakeTensor, a
SymInt, or a tuple of them). A node a pass creates must get one too: :func:`insert` computes it
by running the op on the inputs' values inside the graph's fake mode.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Optional

import torch
import torch.fx as fx

aten = torch.ops.aten
prims = torch.ops.prims

# Shape-only ops: the value is the input's, seen through another shape (or as is: alias).
VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default})
CONVERT = prims.convert_element_type.default


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
    """``roots`` and every node they depend on. With ``within``, a node for which it is false is
    neither included nor walked through."""
    seen: set[fx.Node] = set()
    stack = list(roots)
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
