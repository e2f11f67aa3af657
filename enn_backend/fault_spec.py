"""The grammar of the ``fault_inject`` option (``ENN_FAULT_INJECT``): :class:`FaultSpec` and
its parser, below :mod:`enn_backend.options` (which validates the option with it) and the
guard (which plants the specs: :mod:`enn_backend.guard.faults`). Plain Python: importing it
imports no torch.

Grammar: ``<op>[/<module>]:<kind>[@<n>[+]][:<phase>][,<op>[/<module>]:<kind>[@<n>[+]][:<phase>]...]``

- ``<op>``: an op packet or overload as printed by torch, e.g. ``aten.mm``,
  ``aten.addmm.default``, ``aten._softmax``, or an enn op such as ``enn.attention``.
- ``/<module>``: only the op's nodes that run in a module whose path matches this glob (as
  ``fp8_exclude``'s globs: ``fnmatch``, the whole path), the module path being the one the
  report's sites give the node (``model.layers.3.mlp.down_proj``; a backward node has the
  module of the forward node it differentiates). ``enn.fp8_mm/model.layers.3.mlp.down_proj:nan:bwd``
  spoils that one FP8 layer's backward GEMMs; ``aten.mm/layers.*:inf`` the ``mm`` nodes of every
  module under ``layers``. Without it, every node of the op. A glob that matches none of the
  op's nodes plants nothing, which is reported like any spec that planted nothing.
- ``<kind>``: ``raise`` | ``nan`` | ``inf`` | ``scale<f>`` (the output times ``f``, e.g.
  ``scale1.01``: finite but wrong values, which only the guard's value check sees). ``@<n>`` (an integer, at least 2) makes the
  fault intermittent, a flaky kernel: it strikes on every n-th call of each planted node
  (calls n, 2n, ...), and the other calls return the node's true output; ``@<n>+`` makes it
  strike on every call from the n-th on (a kernel that breaks mid-run). Each planted node
  counts its own calls, and the count belongs to that node of the compiled unit: every
  artifact built from the graph (the guard's trial recompiles, the pinned fix) shares it,
  so a recompile does not restart it, and a new compile (a new unit) starts from zero.
- ``<phase>``: ``fwd`` | ``bwd`` | ``compile`` | ``any`` (default ``any``): ``fwd`` hits
  forward and inference graphs, ``bwd`` backward graphs, ``compile`` makes the
  lowering of the planted op raise while Inductor compiles (any graph).
"""

from __future__ import annotations

import fnmatch
import itertools
from dataclasses import dataclass, field

FAULT_KINDS = ("raise", "nan", "inf")
FAULT_PHASES = ("fwd", "bwd", "compile", "any")
_parses = itertools.count(1)  # one number per parse: the planted nodes' call counts are per compiled unit


class FaultSpecError(ValueError):
    """A ``fault_inject`` value that does not follow the grammar (Options raises it as OptionsError)."""


@dataclass(frozen=True)
class FaultSpec:
    op: str
    kind: str
    phase: str = "any"
    every: int = 1  # strike on every n-th call of a planted node (1: every call)
    onward: bool = False  # with ``every`` n: strike on every call from the n-th on (``@<n>+``), a kernel that breaks
    module: str = ""  # a glob of module paths (``/<module>``): only the op's nodes in a matching module ("": all)
    plan: int = field(default=0, compare=False, repr=False)  # the parse it came from (its unit)

    @property
    def text(self) -> str:
        """The spec as written in ``fault_inject``."""
        at = f"@{self.every}{'+' if self.onward else ''}" if self.every > 1 else ""
        where = f"/{self.module}" if self.module else ""
        return f"{self.op}{where}:{self.kind}{at}:{self.phase}"

    def matches_target(self, target: object) -> bool:
        """Whether ``target`` is this spec's op (whatever the module)."""
        return self.op in target_names(target)

    def matches(self, target: object, module: str) -> bool:
        """Whether a node of ``target`` that runs in module path ``module`` gets this fault."""
        return self.matches_target(target) and self.matches_module(module)

    def matches_module(self, module: str) -> bool:
        """Whether module path ``module`` matches this spec's ``/<module>`` glob (always, without one)."""
        return not self.module or fnmatch.fnmatchcase(module, self.module)

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
        if self.every == 1:
            return self.kind
        return f"{self.kind}@{self.every}{'+' if self.onward else ''}#{self.plan}/{site}"


def target_names(target: object) -> tuple[str, ...]:
    """('aten.mm.default', 'aten.mm') for torch.ops.aten.mm.default; () for non-ops."""
    try:
        overload = str(target)
        packet = str(target.overloadpacket)  # type: ignore[attr-defined]
    except AttributeError:
        return ()
    return (overload, packet)


def scale_of(kind: str) -> float:
    """``f`` of a ``scale<f>`` kind (a positive, finite factor other than 1), else 0."""
    try:
        f = float(kind[len("scale"):]) if kind.startswith("scale") else 0.0
    except ValueError:
        return 0.0
    return f if 0 < f < float("inf") and f != 1 else 0.0


def parse_fault_specs(text: str) -> tuple[FaultSpec, ...]:
    """The specs of ``text`` (one parse: one compiled unit's call counts); raises
    :class:`FaultSpecError` naming what is wrong and what is valid."""
    specs = []
    plan = next(_parses)
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) not in (2, 3):
            raise FaultSpecError(
                f"enn: bad fault_inject entry {item!r}; expected <op>[/<module>]:<kind>[@<n>[+]][:<phase>], "
                f"kind in {FAULT_KINDS}, phase in {FAULT_PHASES}"
            )
        op, slash, module = (p.strip() for p in parts[0].partition("/"))
        kind = parts[1].strip()
        if slash and not module:
            raise FaultSpecError(f"enn: fault_inject entry {item!r}: '/' must be followed by a module path or glob, "
                                 "e.g. enn.fp8_mm/model.layers.3.mlp.down_proj:nan")
        phase = parts[2].strip() if len(parts) == 3 else "any"
        kind, at, every_text = kind.partition("@")
        if op.count(".") not in (1, 2) or not all(op.split(".")):
            raise FaultSpecError(f"enn: fault_inject op {op!r} must look like 'aten.mm' or 'aten.mm.default'")
        if kind not in FAULT_KINDS and not scale_of(kind):
            raise FaultSpecError(f"enn: fault_inject kind {kind!r} must be one of {', '.join(FAULT_KINDS)} or "
                                 "scale<f> (f a positive number other than 1, e.g. scale1.01)")
        if phase not in FAULT_PHASES:
            raise FaultSpecError(f"enn: fault_inject phase {phase!r} must be one of {', '.join(FAULT_PHASES)}")
        every, onward = 1, every_text.endswith("+")
        every_text = every_text.removesuffix("+")
        if at:
            if not every_text.isdigit() or int(every_text) < 2:
                raise FaultSpecError(f"enn: fault_inject entry {item!r}: the n of {kind}@<n> must be an integer of "
                                     f"at least 2 (the fault strikes on every n-th call; plain {kind!r} strikes on "
                                     "every call)")
            if phase == "compile":
                raise FaultSpecError(f"enn: fault_inject entry {item!r}: a compile fault strikes once, at compile "
                                     f"time; @<n> is for run-time faults (phase fwd, bwd or any)")
            every = int(every_text)
        specs.append(FaultSpec(op, kind, phase, every, onward, module, plan))
    return tuple(specs)
