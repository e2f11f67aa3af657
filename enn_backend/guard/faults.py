"""Parsing of ``ENN_FAULT_INJECT`` / ``options={"fault_inject": ...}``.

Grammar: ``<op>:<kind>[@<n>][:<phase>][,<op>:<kind>[@<n>][:<phase>]...]``

- ``<op>``: an op packet or overload as printed by torch, e.g. ``aten.mm``,
  ``aten.addmm.default``, ``aten._softmax``, or an enn op such as ``enn.attention``.
- ``<kind>``: ``raise`` | ``nan`` | ``inf`` | ``scale<f>`` (the output times ``f``, e.g.
  ``scale1.01``: finite but wrong values, which only the guard's value check sees). ``@<n>`` (an integer, at least 2) makes the
  fault intermittent, a flaky kernel: it strikes on every n-th call of each planted node
  (calls n, 2n, ...), and the other calls return the node's true output. Each planted node
  counts its own calls, and the count belongs to that node of the compiled unit: every
  artifact built from the graph (the guard's trial recompiles, the pinned fix) shares it,
  so a recompile does not restart it, and a new compile (a new unit) starts from zero.
- ``<phase>``: ``fwd`` | ``bwd`` | ``compile`` | ``any`` (default ``any``): ``fwd`` hits
  forward and inference graphs, ``bwd`` backward graphs, ``compile`` makes the
  lowering of the planted op raise while Inductor compiles (any graph).

A spec that plants nothing in a compiled unit is reported (:class:`FaultPlan`).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

from ..custom_ops.faults import scale_of
from ..report import FallbackKind, report

FAULT_KINDS = ("raise", "nan", "inf")
FAULT_PHASES = ("fwd", "bwd", "compile", "any")
_parses = itertools.count(1)  # one number per parse: the planted nodes' call counts are per compiled unit


@dataclass(frozen=True)
class FaultSpec:
    op: str
    kind: str
    phase: str = "any"
    every: int = 1  # strike on every n-th call of a planted node (1: every call)
    plan: int = field(default=0, compare=False, repr=False)  # the parse it came from (its unit)

    @property
    def text(self) -> str:
        """The spec as written in ``fault_inject``."""
        return f"{self.op}:{self.kind}{f'@{self.every}' if self.every > 1 else ''}:{self.phase}"

    def matches_target(self, target: object) -> bool:
        names = target_names(target)
        return self.op in names

    def applies_to(self, graph_phase: str) -> bool:
        """Whether this run-time fault is planted in a graph of ``graph_phase``."""
        if self.phase == "any":
            return True
        if self.phase == "fwd":
            return graph_phase in ("forward", "inference")
        if self.phase == "bwd":
            return graph_phase == "backward"
        return False

    def planted_kind(self, site: str) -> str:
        """The ``kind`` argument of the ``enn::fault`` planted at ``site`` (``<graph phase>/<node>``):
        ``<kind>@<n>#<plan>/<site>`` for an intermittent fault, whose calls are counted per site."""
        if self.phase == "compile":
            return "compile"
        return self.kind if self.every == 1 else f"{self.kind}@{self.every}#{self.plan}/{site}"


def target_names(target: object) -> tuple[str, ...]:
    """('aten.mm.default', 'aten.mm') for torch.ops.aten.mm.default; () for non-ops."""
    try:
        overload = str(target)
        packet = str(target.overloadpacket)  # type: ignore[attr-defined]
    except AttributeError:
        return ()
    return (overload, packet)


@dataclass
class _Graph:
    """What one graph of a unit held for each spec."""

    phase: str  # forward | backward | inference
    reached: set[FaultSpec]  # specs planted here, or whose nodes here are pinned to eager
    nodes: dict[FaultSpec, list[str]]  # nodes of each spec's op, whatever the phase
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
    name an op of the decomposed graph), it appears only in graphs of another phase, or its
    nodes have no floating-point output to spoil.
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
    graph = _Graph(phase, set(), {sp: [] for sp in specs}, set(), set(planted))
    for n in gm.graph.nodes:
        names = target_names(n.target) if n.op == "call_function" else ()
        if not names:
            continue
        graph.ops.add(names[1])
        for sp in specs:
            if sp.matches_target(n.target):
                graph.nodes[sp].append(n.name)
        if n.name in planted:
            graph.reached.add(next(sp for sp in applies if sp.matches_target(n.target)))
        elif n.name in pins:
            graph.reached.update(sp for sp in applies if sp.matches_target(n.target))
    return graph


def _why_not(spec: FaultSpec, graphs: list[_Graph], opts: Any) -> str:
    """The likely reason ``spec`` planted nothing in a unit of ``graphs``."""
    import torch

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
    namespace, _, rest = spec.op.partition(".")
    name, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        overloads = [getattr(packet, o) for o in packet.overloads() if not overload or o == overload]
    except (AttributeError, RuntimeError):
        overloads = []
    if not overloads:
        return f"no op {spec.op} is registered with torch (names look like aten.mm or aten.addmm.default)"
    from ..decompositions import decomposition_table

    if any(torch._C._dispatch_has_kernel_for_dispatch_key(o.name(), "CompositeImplicitAutograd") for o in overloads):
        return (f"{spec.op} is decomposed before faults are planted (it is CompositeImplicitAutograd: tracing "
                f"replaces it by the ops it is made of); name an op of the decomposed graph: {listed}")
    if any(o in decomposition_table(opts.precision) for o in overloads):
        return (f"{spec.op} does not appear in this unit's graphs; it is in the decomposition table enn hands to "
                f"Inductor, so it was likely decomposed before faults are planted; name an op of the decomposed "
                f"graph: {listed}")
    return f"{spec.op} does not appear in this unit's graphs (their ops: {listed})"


def parse_fault_spec(text: str) -> FaultPlan:
    """The specs of ``text``, as a :class:`FaultPlan` for one compiled unit."""
    from ..options import OptionsError

    specs = []
    plan = next(_parses)
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) not in (2, 3):
            raise OptionsError(
                f"enn: bad fault_inject entry {item!r}; expected <op>:<kind>[@<n>][:<phase>], "
                f"kind in {FAULT_KINDS}, phase in {FAULT_PHASES}"
            )
        op, kind = parts[0].strip(), parts[1].strip()
        phase = parts[2].strip() if len(parts) == 3 else "any"
        kind, at, every_text = kind.partition("@")
        if op.count(".") not in (1, 2) or not all(op.split(".")):
            raise OptionsError(f"enn: fault_inject op {op!r} must look like 'aten.mm' or 'aten.mm.default'")
        if kind not in FAULT_KINDS and not scale_of(kind):
            raise OptionsError(f"enn: fault_inject kind {kind!r} must be one of {', '.join(FAULT_KINDS)} or "
                               "scale<f> (f a positive number other than 1, e.g. scale1.01)")
        if phase not in FAULT_PHASES:
            raise OptionsError(f"enn: fault_inject phase {phase!r} must be one of {', '.join(FAULT_PHASES)}")
        every = 1
        if at:
            if not every_text.isdigit() or int(every_text) < 2:
                raise OptionsError(f"enn: fault_inject entry {item!r}: the n of {kind}@<n> must be an integer of at "
                                   f"least 2 (the fault strikes on every n-th call; plain {kind!r} strikes on every call)")
            if phase == "compile":
                raise OptionsError(f"enn: fault_inject entry {item!r}: a compile fault strikes once, at compile "
                                   f"time; @<n> is for run-time faults (phase fwd, bwd or any)")
            every = int(every_text)
        specs.append(FaultSpec(op, kind, phase, every, plan))
    return FaultPlan(tuple(specs))
