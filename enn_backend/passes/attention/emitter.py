"""The one way the attention pass adds a node to the graph: :class:`Emitter`.

Every node it creates has its fake value (Inductor lowers from it) and ``meta[EMITTED]``: the
guard's eager reference runs enn's safe path for the nodes enn emitted, and ATen for the nodes
the user wrote (enn_backend/graph_compiler.py).

Activation checkpointing (``torch.utils.checkpoint``, transformers' gradient checkpointing) tags
the forward nodes of a checkpointed region (``meta["recompute"]``, ``meta["ac_graph_id"]``): AOT
Autograd's partitioner recomputes them in the backward instead of saving what they compute. The
forward nodes the pass adds carry the tags of the attention output they replace, so the fused
kernel is recomputed where the ops it replaces would have been, and saves no more than they did.
A site with attention dropout is not tagged (``recompute=False``): the kernel draws its own mask
(or the graph a seed for it), and a recomputation would draw another one than the forward's; its
forward outputs are saved, as without checkpointing.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple, Optional

import torch
import torch.fx as fx

from ...custom_ops.pinned import EMITTED
from ...fx_utils import CONVERT, insert, shape, tensor_dtype

aten = torch.ops.aten


_CHECKPOINT_TAGS = ("recompute", "ac_graph_id")


class Emitter:
    """Adds nodes to ``graph`` before ``before`` (the attention output) unless told otherwise;
    with ``recompute``, those get ``before``'s activation-checkpointing tags."""

    def __init__(self, graph: fx.Graph, mode: Any, before: fx.Node, recompute: bool = True) -> None:
        self.graph, self.mode, self.before = graph, mode, before
        self.tags = {k: before.meta[k] for k in _CHECKPOINT_TAGS if k in before.meta} if recompute else {}

    def call(self, target: Any, args: tuple, kwargs: Optional[dict] = None, before: Optional[fx.Node] = None) -> fx.Node:
        meta = {EMITTED: True, **(self.tags if before is None else {})}
        return insert(self.graph, target, args, kwargs, before=before or self.before, mode=self.mode, meta=meta)

    def tag(self, n: fx.Node) -> fx.Node:
        """Mark a node made another way (a spliced subgraph) as emitted."""
        n.meta[EMITTED] = True
        return n

    def items(self, node: fx.Node, count: int, before: Optional[fx.Node] = None) -> list[fx.Node]:
        """The first ``count`` outputs of a multi-output node."""
        return [self.call(operator.getitem, (node, i), before=before) for i in range(count)]

    def cast(self, n: fx.Node, dtype: Optional[torch.dtype], before: Optional[fx.Node] = None) -> fx.Node:
        if dtype is None or tensor_dtype(n) == dtype:
            return n
        return self.call(CONVERT, (n, dtype), before=before)

    def size(self, n: fx.Node, dim: int) -> Any:
        """Size ``dim`` of ``n``: an int, or a ``sym_size`` node for a symbolic size."""
        s = shape(n)[dim]
        return s if isinstance(s, int) else self.call(aten.sym_size.int, (n, dim))


class Operands(NamedTuple):
    """One fused attention's inputs as graph nodes: q / k / v ``[B, H, T, D]`` in the matmul dtype
    (k / v with their own, grouped-query, heads), the additive float bias, the boolean keep-mask
    and the ALiBi slopes ``[H]``."""

    q: fx.Node
    k: fx.Node
    v: fx.Node
    bias: Optional[fx.Node]
    mask: Optional[fx.Node]
    alibi: Optional[fx.Node]
