"""What the specs of ``fault_inject`` (its grammar: :mod:`enn_backend.fault_spec`) planted in
a compiled unit: :class:`FaultPlan` reports each spec that planted nothing, with the likely reason.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ..blame import site
from ..decompositions import decomposition_table
from ..fault_spec import FaultSpec, parse_fault_specs, target_names
from ..report import FallbackKind, report


@dataclass
class _Graph:
    """What one graph of a unit held for each spec."""

    phase: str  # forward | backward | inference
    reached: set[FaultSpec]  # specs planted here, or whose nodes here are pinned to eager
    nodes: dict[FaultSpec, list[str]]  # nodes of each spec's op in its modules, whatever the phase
    modules: dict[FaultSpec, set[str]]  # modules of each spec's op's nodes, whatever its module glob
    ops: set[str]  # op packets of the graph ("aten.addmm")
    planted: set[str]  # nodes that received a fault (of any spec)


class FaultPlan:
    """The specs of one ``fault_inject`` value, parsed for one compiled unit (enn parses once
    per unit), and the check that each of them planted something in it.

    A spec *planted nothing* when no graph of the unit that its phase reaches (forward and
    backward, or the one inference graph) received it: a test that believes it injected the
    fault tests nothing. That is decided as soon as those graphs are compiled: a ``fwd`` spec
    with the forward (or inference) graph, a ``bwd``, ``any`` or ``compile`` one with the
    backward graph (compiled lazily, at the first backward) or the inference graph (a unit
    with no backward). A spec that matches in some graphs of the unit only (``any`` planted
    in the forward graph alone) planted something. Nodes of the op left out because they are
    pinned to eager count as reached: their ``pinned_from_state`` or ``known_miscompile`` line says so.

    Each spec that planted nothing is a WARNING and a ``fault_not_planted`` report line, with
    the likely reason: no such op, the op is decomposed before faults are planted (``aten.gelu``:
    name an op of the decomposed graph), it appears only in graphs of another phase, none of its
    nodes runs in a module the spec's ``/<module>`` glob matches (the modules they run in are
    listed), or its nodes have no floating-point output to spoil.
    """

    def __init__(self, specs: tuple[FaultSpec, ...]) -> None:
        self.specs = specs
        self._graphs: dict[str, _Graph] = {}  # by graph record id
        self._decided: set[FaultSpec] = set()
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[FaultSpec]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def __getitem__(self, i: int) -> FaultSpec:
        return self.specs[i]

    def graph_built(self, compiler: Any, planted: list[str], pins: frozenset[str]) -> None:
        """Record what ``compiler``'s graph (an enn GraphCompiler) received, and report each
        spec whose graphs in this unit are all compiled now without receiving it."""
        with self._lock:
            if compiler.record.id in self._graphs:  # a later build of the same graph
                return
            self._graphs[compiler.record.id] = _scan(compiler.eager_gm, compiler.phase, self.specs, planted, pins)
            due = [sp for sp in self.specs if sp not in self._decided and self._complete(sp)]
            self._decided.update(due)
            missed = [sp for sp in due if not any(sp in g.reached for g in self._graphs.values())]
            graphs = list(self._graphs.values())
        for sp in missed:
            phases = ", ".join(g.phase for g in graphs)
            report().add_fallback(
                FallbackKind.FAULT_NOT_PLANTED, node="<none>", phase="compile", graph=compiler.record,
                reason=f"fault_inject {sp.text!r} planted nothing in unit {compiler.unit} (graphs: {phases}): "
                       f"{_why_not(sp, graphs, compiler.opts)}",
                action="no fault injected for this spec in this unit: a test that counts on it tests nothing here")

    def _complete(self, spec: FaultSpec) -> bool:
        """Have all graphs of the unit that ``spec`` can reach been compiled?"""
        phases = {g.phase for g in self._graphs.values()}
        if spec.phase == "fwd":
            return bool(phases & {"forward", "inference"})
        if any(spec in g.reached for g in self._graphs.values()):
            return True
        return bool(phases & {"backward", "inference"})


def _scan(gm: Any, phase: str, specs: tuple[FaultSpec, ...], planted: list[str], pins: frozenset[str]) -> _Graph:
    # (the rule of enn_backend.guard.graph_edit.plant_faults: a node gets the first spec that applies)
    applies = [sp for sp in specs if sp.phase == "compile" or sp.applies_to(phase)]
    graph = _Graph(phase, set(), {sp: [] for sp in specs}, {sp: set() for sp in specs}, set(), set(planted))
    for n in gm.graph.nodes:
        names = target_names(n.target) if n.op == "call_function" else ()
        if not names:
            continue
        graph.ops.add(names[1])
        ops = [sp for sp in specs if sp.matches_target(n.target)]
        if not ops:
            continue
        module = site(n).get("module", "")
        for sp in ops:
            graph.modules[sp].add(module)
            if sp.matches_module(module):
                graph.nodes[sp].append(n.name)
        if n.name in planted:
            graph.reached.add(next(sp for sp in applies if sp.matches(n.target, module)))
        elif n.name in pins:
            graph.reached.update(sp for sp in applies if sp.matches(n.target, module))
    return graph


def _why_not(spec: FaultSpec, graphs: list[_Graph], opts: Any) -> str:
    """The likely reason ``spec`` planted nothing in a unit of ``graphs``."""
    ops = sorted(set().union(*(g.ops for g in graphs)))
    listed = ", ".join(ops[:12]) + (f", ... ({len(ops)} ops)" if len(ops) > 12 else "")
    found = {g.phase: g.nodes[spec] for g in graphs if g.nodes[spec]}
    reachable = {g.phase for g in graphs if spec.phase in ("any", "compile") or spec.applies_to(g.phase)}
    if found.keys() & reachable:
        nodes = [(n, g) for g in graphs if g.phase in reachable for n in g.nodes[spec]]
        if all(n in g.planted for n, g in nodes):
            return (f"its node(s) {', '.join(n for n, _ in nodes)} received an earlier spec of fault_inject "
                    "(a node gets the first spec that matches it)")
        return (f"its node(s) {', '.join(n for n, _ in nodes)} have no floating-point tensor output a fault could "
                "spoil (or are views / in-place ops)")
    if found:
        return (f"{spec.op} appears only in the {' and '.join(found)} graph(s) of this unit, which phase "
                f"{spec.phase!r} does not reach")
    modules = sorted(set().union(*(g.modules[spec] for g in graphs)))
    if spec.module and modules:
        shown = ", ".join(m or "<root>" for m in modules[:8]) + (f", ... ({len(modules)} modules)" if len(modules) > 8 else "")
        return f"no node of {spec.op} runs in a module matching {spec.module!r}; its nodes run in: {shown}"
    namespace, _, rest = spec.op.partition(".")
    name, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        overloads = [getattr(packet, o) for o in packet.overloads() if not overload or o == overload]
    except (AttributeError, RuntimeError):
        overloads = []
    if not overloads:
        return f"no op {spec.op} is registered with torch (names look like aten.mm or aten.addmm.default)"
    if any(_composite(o) for o in overloads):
        return (f"{spec.op} is decomposed before faults are planted (it is CompositeImplicitAutograd: tracing "
                f"replaces it by the ops it is made of); name an op of the decomposed graph: {listed}")
    if any(o in decomposition_table(opts.precision) for o in overloads):
        return (f"{spec.op} does not appear in this unit's graphs; it is in the decomposition table enn hands to "
                f"Inductor, so it was likely decomposed before faults are planted; name an op of the decomposed "
                f"graph: {listed}")
    return f"{spec.op} does not appear in this unit's graphs (their ops: {listed})"


def _composite(overload: Any) -> bool:
    """Is ``overload`` decomposed while the graph is traced (CompositeImplicitAutograd)? An
    overload the dispatcher does not know (``aten.sqrt.int``, a Python-only one) is not."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(), "CompositeImplicitAutograd")
    except RuntimeError:
        return False


def parse_fault_spec(text: str) -> FaultPlan:
    """The specs of ``text``, as a :class:`FaultPlan` for one compiled unit (``text`` is an
    Options' ``fault_inject``, already validated; a bad one raises FaultSpecError)."""
    return FaultPlan(parse_fault_specs(text))
