"""What the guard may use of the graph it guards: two typed seams.

:class:`GraphFacts` is what the fast path reads on every call; a graph loaded from AOT
Autograd's cache has a stand-in that provides only these (``enn_backend.aot_cache.CachedGraph``)
and turns into the full :class:`GuardedCompiler` -- the one ``graph_compiler.GraphCompiler``
implements -- through ``full()`` when the fallback ladder needs the graph itself. The guard uses
nothing else of either: a new stand-in, or a new way to build graphs, implements these.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import torch.fx as fx

from ..options import Options
from ..report import GraphRecord


@runtime_checkable
class GraphFacts(Protocol):
    """What the fast path reads."""

    opts: Options
    phase: str  # forward | backward | inference
    record: GraphRecord
    from_cache: bool  # loaded from AOT Autograd's cache (checked when it was compiled)
    random: bool  # draws random numbers: re-runs replay the RNG, values are not compared
    mutated: list[int]  # inputs the graph writes in place (in the graph: copy_ into a placeholder)
    written: list[int]  # inputs a compiled call may write: the mutated ones and any donated buffer
    kernel_state: frozenset[int]  # outputs that are an attention kernel's saved state: not screened

    def full(self) -> "GuardedCompiler":
        """The compiler of this graph (a stand-in traces the graph again)."""


@runtime_checkable
class GuardedCompiler(GraphFacts, Protocol):
    """What the fallback ladder and the ranks' agreement use, on top of :class:`GraphFacts`."""

    eager_gm: fx.GraphModule  # the ATen graph as AOT Autograd handed it over
    compute_nodes: int
    pinned_names: frozenset[str]
    fp32: bool
    cudagraphs: bool
    cudagraphs_ok: bool
    bookkeeping: frozenset[int]  # forward outputs saved for the backward: integers compared by layout
    state: Any  # guard.kernel_state.KernelState: where faults are recorded

    def node(self, name: str) -> fx.Node: ...
    def safe_gm(self, pins: frozenset[str] | None = None) -> fx.GraphModule: ...
    def reference_pins(self, pins: frozenset[str] | None = None) -> frozenset[str]: ...
    def fp32_gm(self) -> fx.GraphModule: ...
    def fp64_gm(self, pins: frozenset[str] | None = None) -> fx.GraphModule: ...
    def runs_eagerly(self, gm: fx.GraphModule) -> fx.GraphModule: ...
    def eager_callable(self) -> Callable[[list], Any]: ...
    def pinned_now(self, extra: frozenset[str] = frozenset()) -> frozenset[str]: ...
    def recorded_pins(self) -> frozenset[str]: ...
    def build(self, extra_pins: frozenset[str] = frozenset(), fp32: bool | None = None,
              quiet: bool = False) -> Callable[[list], Any]: ...
    def adopt(self, compiled: Any, pins: frozenset[str] = frozenset(), fp32: bool = False) -> None: ...
    def write_repro(self, **info: Any) -> None: ...
