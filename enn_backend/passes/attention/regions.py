"""The part of the graph one fused attention replaces: :func:`find_regions`.

Forward: every node on a path from an input (q / k / v / bias terms) to the output, plus the
constants (scale, fill, mask nodes with no input in the region) feeding it. Backward (training):
every joint-graph node whose ``seq_nr`` belongs to a forward node of the region -- AOT Autograd
tags each backward node with the forward op it differentiates -- plus the accumulation nodes
between them, plus every node on a path from one backward node of the region to another.
A gradient accumulation (``is_gradient_acc``) carries the ``seq_nr`` of whatever op autograd was
at, not of an op it differentiates: it belongs to the region only when all its inputs do. The
gradients leaving the backward region are mapped to the inputs by shape, then by the forward op
they differentiate; anything ambiguous raises :class:`Skip` (the graph is left alone, recorded).

What the fused kernel keeps internal: every forward node of the region that mixes inputs -- the
scores, the softmax, the probabilities (and their dropout), the product before the output view --
may be read only inside the region or its backward; one that something else reads is a
:class:`Leak`. A form of one input alone may be read outside: a copy of Q, K or V in that
input's shape (clones, aliases, casts, views that keep the shape -- what a returned K/V cache
is) becomes the input itself, so the kernel reads that same tensor and the gradient it returns is
that tensor's, which autograd adds to what its other readers give (:func:`find_regions`). Any
other form (a transposed or scaled K, a repeated grouped-query K/V, a form of a bias term) is a
:class:`Leak`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from ... import blame
from ...fx_utils import CONVERT, VIEWS, ancestors, graph_order, is_call, shape, val
from .match import Match, Skip, skip_views

aten = torch.ops.aten
_TRANSPARENT_BWD = (aten.view.default, aten._unsafe_view.default, aten.permute.default, aten.clone.default,
                    aten.alias.default, aten.expand.default, aten.squeeze.dim, aten.unsqueeze.default)


_COPIES = (aten.clone.default, aten.alias.default, CONVERT)  # same values (a cast: the kernel casts anyway)
OPERANDS = ("Q", "K", "V")  # inputs 0..2; the bias terms (and ALiBi slopes) follow


class Leak(Skip):
    """``node``, a value the fused kernel keeps internal, is also read by ``user`` outside the
    attention; ``operand``: the index of the one input ``node`` is a form of (None: it mixes
    inputs -- the scores, the softmax, the probabilities)."""

    def __init__(self, node: fx.Node, user: fx.Node, operand: Optional[int]) -> None:
        super().__init__(f"intermediate {node.name} is also used by {user.name}")
        self.node, self.user, self.operand = node, user, operand


@dataclass
class Regions:
    inputs: list[fx.Node]  # the inputs the kernel reads: the caller's, or a copy of one that is read outside too
    forward: set[fx.Node]
    backward: set[fx.Node]
    grads: dict[int, fx.Node]  # input index -> the backward node that is that input's gradient
    grad_out: Optional[fx.Node]  # the gradient flowing into the attention output
    first_backward: Optional[fx.Node]  # where the fused backward goes


def is_backward(n: fx.Node) -> bool:
    return n.meta.get("partitioner_tag") == "is_backward" or bool(n.meta.get("autograd_backward"))


def _seq(n: fx.Node) -> Any:
    """The ``seq_nr`` of the forward op ``n`` is (or, in the backward, differentiates); None for a
    gradient accumulation."""
    return None if n.meta.get("is_gradient_acc") else n.meta.get("seq_nr")


def _on_path(region: set[fx.Node], inputs: list[fx.Node]) -> set[fx.Node]:
    """The inputs and the region nodes that depend on one (mask-only constants do not)."""
    on_path: set[fx.Node] = set(inputs)
    for n in sorted(region, key=graph_order(next(iter(region)).graph)):
        if any(a in on_path for a in n.all_input_nodes):
            on_path.add(n)
    return on_path


def _backward_region(graph: fx.Graph, region: set[fx.Node], inputs: list[fx.Node]) -> set[fx.Node]:
    """Backward nodes that differentiate forward nodes of ``region`` (by AOT's ``seq_nr``)."""
    on_path = _on_path(region, inputs)
    seqs = {_seq(n) for n in region if n in on_path and isinstance(val(n), torch.Tensor) and val(n).is_floating_point()}
    seqs.discard(None)
    bwd = {n for n in graph.nodes if n.op == "call_function" and is_backward(n) and _seq(n) in seqs}
    if not bwd:
        return bwd
    bwd |= _between(graph, bwd)
    # accumulation/helper nodes without a seq_nr whose inputs all come from the region
    changed = True
    allowed = region | set(inputs)
    while changed:
        changed = False
        for n in graph.nodes:
            if n in bwd or n.op != "call_function" or not is_backward(n) or _seq(n) is not None:
                continue
            ins = n.all_input_nodes
            if ins and any(i in bwd for i in ins) and all(i in bwd or i in allowed for i in ins):
                bwd.add(n)
                changed = True
    return bwd


def _between(graph: fx.Graph, bwd: set[fx.Node]) -> set[fx.Node]:
    """The nodes outside ``bwd`` on a path from one node of ``bwd`` to another: computed from the
    attention's backward and read by it, they are part of it whatever their ``seq_nr`` says.
    (Inductor's joint clean-up replaces forward nodes -- ``x * 1.0 + zeros`` becomes one new
    ``mul`` with the ``add``'s ``seq_nr`` -- and leaves the backward of the op it dropped with a
    ``seq_nr`` that no forward node has.)"""
    order = graph_order(graph)
    first = min(bwd, key=order)
    below: set[fx.Node] = set()  # depends on a node of bwd
    for n in graph.nodes:
        if order(n) > order(first) and n not in bwd and any(a in bwd or a in below for a in n.all_input_nodes):
            below.add(n)
    return ancestors([a for n in bwd for a in n.all_input_nodes if a in below], within=below.__contains__)


def _first_leak(region: set[fx.Node], bwd: set[fx.Node], out: fx.Node, inputs: list[fx.Node]) -> Optional[Leak]:
    """The first (in graph order) intermediate of the forward region that something outside the
    region and its backward reads; None when the region is closed.

    Constants (positions, masks built from sizes) depend on no input: the layers of a model
    share them after CSE, and leaving them in the graph for other users costs nothing.
    """
    on_path = _on_path(region, inputs)
    private = _private(region, inputs)
    for n in sorted(region, key=graph_order(out.graph)):
        if n is out or n not in on_path or not isinstance(val(n), torch.Tensor):
            continue
        for u in n.users:
            if u not in region and u not in bwd:
                return Leak(n, u, next((i for i, nodes in private.items() if n in nodes), None))
    return None


def _copy_of(n: fx.Node, root: fx.Node) -> bool:
    """``n`` holds ``root``'s values in ``root``'s shape: reached from it through copies (clone,
    alias, dtype casts) and views that keep the shape."""
    while n is not root:
        keeps_shape = is_call(n, *VIEWS, aten.expand.default) and shape(n) == shape(n.args[0])
        if not (is_call(n, *_COPIES) or keeps_shape) or not isinstance(n.args[0], fx.Node):
            return False
        n = n.args[0]
    return True


def leak_reason(leak: Leak, m: Match) -> str:
    """Why ``leak`` keeps the attention of ``m`` unfused, in the model's terms: what the value is
    (a form of Q / K / V or of a bias term, the scores, the probabilities), where the model
    computes it, who reads it, and the model-level setting that most likely asks for it."""
    n, user, i = leak.node, leak.user, leak.operand
    if i is not None:
        name = OPERANDS[i] if i < len(OPERANDS) else "a bias term"
        op = blame.site(n)["op"].removeprefix("aten.").split(".")[0]
        what, verb = f"a {op} of {name} ({n.name}", "is"
        rule = f"the kernel reads {name} itself, and shares only a copy of it in its own shape"
        hint = " (a returned K/V cache? use_cache=True returns it)" if name in ("K", "V") else ""
    else:
        if m.scores is not None and n in ancestors([m.scores]):
            what, verb, hint = "the attention scores", "are", ""
        elif n is m.probs or m.probs in ancestors([n]):
            what, verb, hint = "the attention probabilities", "are", \
                " (returned attention weights? output_attentions=True returns them)"
        else:
            what, verb, hint = "the softmax's intermediate", "is", ""
        what += f" ({n.name}"
        rule = "a fused attention keeps its scores and probabilities internal"
    where = blame.location(blame.site(n))
    what += f", {where})" if where else ")"
    if user.op == "output":
        return f"{what} {verb} a graph output{hint}: {rule}"
    at = blame.location(blame.site(user))
    return f"{what} {verb} also read by {user.name}{f' ({at})' if at else ''}: {rule}"


def _private(region: set[fx.Node], inputs: list[fx.Node]) -> dict[int, set[fx.Node]]:
    """For each input index: the region nodes that depend on that input alone."""
    deps: dict[fx.Node, set[int]] = {}
    for n in sorted(region | set(inputs), key=graph_order(next(iter(region)).graph)):
        if n in inputs:
            deps[n] = {inputs.index(n)}
        else:
            deps[n] = set().union(*(deps.get(a, set()) for a in n.all_input_nodes))
    return {i: {n for n in region if deps.get(n) == {i}} for i in range(len(inputs))}


def _map_exits(exits: list[fx.Node], inputs: list[fx.Node], region: set[fx.Node], bwd: set[fx.Node]) -> dict[int, fx.Node]:
    """{input index: exit node}: which gradient each exit is.

    Each exit's candidates are the inputs of its shape and dtype, narrowed by the forward node of
    the same seq_nr, then by the operand of the backward bmm that computes it. Where inputs share
    a shape (T5's encoder at a sequence length equal to the head size: Q, K, V and the position
    bias with the padding mask added, all [B, H, T, T]), an input settled for one exit is no
    other's candidate, until each exit has one input, or the mapping is refused."""
    private = _private(region, inputs)
    cands: dict[fx.Node, list[int]] = {}
    for e in exits:
        c = [i for i, x in enumerate(inputs) if shape(x) == shape(e) and val(x).dtype == val(e).dtype]
        if len(c) > 1:
            by_seq = [i for i in c if _seq(e) is not None and any(_seq(p) == _seq(e) for p in private[i])]
            c = by_seq if len(by_seq) == 1 else _by_bmm_operand(e, c, inputs, bwd)
        cands[e] = c
    result: dict[int, fx.Node] = {}
    while True:
        settled = [(e, c[0]) for e, c in cands.items() if len(c) == 1]
        if not settled:
            break
        for e, i in settled:
            if i in result:
                raise Skip(f"cannot tell which input backward node {e.name} is the gradient of")
            result[i] = e
            del cands[e]
        taken = {i for _, i in settled}
        cands = {e: [i for i in c if i not in taken] for e, c in cands.items()}
    if cands:
        e = next(iter(cands))
        raise Skip(f"cannot tell which input backward node {e.name} is the gradient of")
    return result


def _by_bmm_operand(e: fx.Node, cands: list[int], inputs: list[fx.Node], bwd: set[fx.Node]) -> list[int]:
    """bmm backward: grad(self) = bmm(g, permute(mat2)); grad(mat2) = bmm(permute(self), g)."""
    n = e
    while is_call(n, *_TRANSPARENT_BWD) and n in bwd:
        n = n.args[0]
    if not is_call(n, aten.bmm.default):
        return cands
    a, b = n.args
    for i in cands:
        x = inputs[i]
        if is_call(a, aten.permute.default) and skip_views(a.args[0]) is x:
            return [i]
        if is_call(b, aten.permute.default) and skip_views(b.args[0]) is x:
            return [j for j in cands if j != i][:1] if len(cands) == 2 else cands
    return cands


def _grad_out(bwd: set[fx.Node], region: set[fx.Node], inputs: list[fx.Node], out: fx.Node) -> Optional[fx.Node]:
    """The gradient flowing into the attention output: the outside tensor the backward reads that
    has the output's shape and is not a forward value."""
    allowed = region | set(inputs)
    found = set()
    for n in bwd:
        for a in n.all_input_nodes:
            if a in bwd or a in allowed:
                continue
            if shape(a) == shape(out) and is_backward(a):
                found.add(a)
            elif isinstance(val(a), torch.Tensor) and val(a).dim() > 0 and not is_call(a, aten.full.default):
                raise Skip(f"backward of the attention reads an unexpected value {a.name}")
    return found.pop() if len(found) == 1 else None


def find_regions(graph: fx.Graph, out: fx.Node, inputs: list[fx.Node]) -> Regions:
    """The forward and backward regions of the attention ``inputs -> out`` and its gradients.

    A copy of Q, K or V that is read outside the attention (a returned K/V cache) becomes that
    input: the regions start below it. Any other value read outside raises :class:`Leak`."""
    inputs = list(inputs)
    training = any(n.op == "placeholder" and is_backward(n) for n in graph.nodes)
    while True:
        inside = set(inputs)
        region = ancestors([out], within=lambda n: n.op == "call_function" and n not in inside)
        bwd = _backward_region(graph, region, inputs) if training else set()
        leak = _first_leak(region, bwd, out, inputs)
        if leak is None:
            break
        i = leak.operand
        if i is None or i >= len(OPERANDS) or not _copy_of(leak.node, inputs[i]):
            raise leak
        inputs[i] = leak.node  # strictly below the old input: the loop ends
    if not training:
        return Regions(inputs, region, bwd, {}, None, None)
    exits = sorted((n for n in bwd if any(u not in bwd for u in n.users)), key=graph_order(graph))
    grads = _map_exits(exits, inputs, region, bwd)
    grad_out = _grad_out(bwd, region, inputs, out) if grads else None
    if grads and grad_out is None:
        raise Skip("could not find the gradient of the attention output")
    first = min(bwd, key=graph_order(graph)) if grads else None
    return Regions(inputs, region, bwd, grads, grad_out, first)
