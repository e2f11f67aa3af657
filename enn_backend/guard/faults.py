"""Parsing of ``ENN_FAULT_INJECT`` / ``options={"fault_inject": ...}``.

Grammar: ``<op>:<kind>[:<phase>][,<op>:<kind>[:<phase>]...]``

- ``<op>``: an op packet or overload as printed by torch, e.g. ``aten.mm``,
  ``aten.addmm.default``, ``aten._softmax``, or an enn op such as ``enn.attention``.
- ``<kind>``: ``raise`` | ``nan`` | ``inf``.
- ``<phase>``: ``fwd`` | ``bwd`` | ``compile`` | ``any`` (default ``any``): ``fwd`` hits
  forward and inference graphs, ``bwd`` backward graphs, ``compile`` makes the
  lowering of the planted op raise while Inductor compiles (any graph).
"""

from __future__ import annotations

from dataclasses import dataclass

FAULT_KINDS = ("raise", "nan", "inf")
FAULT_PHASES = ("fwd", "bwd", "compile", "any")


@dataclass(frozen=True)
class FaultSpec:
    op: str
    kind: str
    phase: str = "any"

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

    def planted_kind(self) -> str:
        return "compile" if self.phase == "compile" else self.kind


def target_names(target: object) -> tuple[str, ...]:
    """('aten.mm.default', 'aten.mm') for torch.ops.aten.mm.default; () for non-ops."""
    try:
        overload = str(target)
        packet = str(target.overloadpacket)  # type: ignore[attr-defined]
    except AttributeError:
        return ()
    return (overload, packet)


def parse_fault_spec(text: str) -> tuple[FaultSpec, ...]:
    from ..options import OptionsError

    specs = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) not in (2, 3):
            raise OptionsError(
                f"enn: bad fault_inject entry {item!r}; expected <op>:<kind>[:<phase>], "
                f"kind in {FAULT_KINDS}, phase in {FAULT_PHASES}"
            )
        op, kind = parts[0].strip(), parts[1].strip()
        phase = parts[2].strip() if len(parts) == 3 else "any"
        if op.count(".") not in (1, 2) or not all(op.split(".")):
            raise OptionsError(f"enn: fault_inject op {op!r} must look like 'aten.mm' or 'aten.mm.default'")
        if kind not in FAULT_KINDS:
            raise OptionsError(f"enn: fault_inject kind {kind!r} must be one of {', '.join(FAULT_KINDS)}")
        if phase not in FAULT_PHASES:
            raise OptionsError(f"enn: fault_inject phase {phase!r} must be one of {', '.join(FAULT_PHASES)}")
        specs.append(FaultSpec(op, kind, phase))
    return tuple(specs)
