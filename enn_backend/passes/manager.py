"""How enn's passes run: :class:`EnnPass`, :class:`PassContext`, :class:`PassManager`,
:class:`PassFailed`, and the module state of the compile they run for.

:class:`PassManager` runs the enabled passes of one stage as one Inductor ``CustomGraphPass``.
Its ``uuid()`` keys Inductor's FX graph cache: per pass, the pass's own sources (its module and
the enn modules it imports, :func:`enn_backend.passes.sources.module_files`) and the options
that change generated code; then the stage, the pass order and enn's lowerings. A file no pass
imports (the demo, the benchmark, the CLI) does not change it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Sequence

import torch
import torch.fx as fx

from .. import blame, compat
from ..options import Options
from ..report import FallbackKind, report
from .sources import sources_hash

log = logging.getLogger(__name__)

STAGES = ("joint_pre", "joint", "post_grad")


class PassFailed(RuntimeError):
    """A pass raised; the backend recompiles the graph without it."""

    def __init__(self, pass_name: str, option: str, cause: BaseException) -> None:
        super().__init__(f"enn pass {pass_name!r} failed: {type(cause).__name__}: {cause}")
        self.pass_name = pass_name
        self.option = option
        self.cause = cause


class ModuleState:
    """The real values of the module buffers a graph reads, for the graph being compiled.

    Dynamo passes a module's parameters and buffers as graph inputs and marks them
    (``_dynamo_static_input_type``); the joint graph sees them as fake tensors. A pass may
    specialize on a *buffer's content* -- nanoGPT's ``tril`` mask buffer is causal -- through
    :meth:`value_of`; every content it relies on is recorded with :meth:`assume`, and the
    backend checks those buffers before each call (enn_backend.backend.BufferContentGuard):
    a buffer whose content changed runs the graph eagerly, recorded, instead of a graph
    compiled for the old content.
    """

    def __init__(self, inputs: list[Any]) -> None:
        self.inputs = list(inputs)
        self.assumed: dict[int, Any] = {}  # input index -> the content relied on (a copy)

    def value_of(self, node: fx.Node) -> tuple[int, Any] | None:
        """(input index, real tensor) if placeholder ``node`` is a module buffer of this compile."""
        if node.op != "placeholder":
            return None
        primals = [n for n in node.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
        if len(primals) != len(self.inputs):
            return None  # AOT deduplicated or regrouped inputs: the order is not the Dynamo order
        i = primals.index(node)
        x = self.inputs[i]
        fake = node.meta.get("val")
        if (not isinstance(x, torch.Tensor) or getattr(x, "_dynamo_static_input_type", None) is None
                or isinstance(x, torch.nn.Parameter) or x.requires_grad or not isinstance(fake, torch.Tensor)
                or tuple(fake.shape) != tuple(x.shape) or fake.dtype != x.dtype or fake.device != x.device):
            return None  # only a module buffer whose value is the one being compiled
        return i, x

    def assume(self, index: int, value: Any) -> None:
        with compat.real_tensor_mode():  # passes run inside the compile's FakeTensorMode
            self.assumed[index] = value.detach().clone()


# Process-wide: the module state of the enn compiles in progress, innermost last; pushed and
# popped under Dynamo's compile lock, which every compile holds.
_MODULE_STATE: list[ModuleState] = []


@contextlib.contextmanager
def module_state(inputs: list[Any]) -> Iterator[ModuleState]:
    """Make the real example inputs of one compile visible to the passes."""
    state = ModuleState(inputs)
    _MODULE_STATE.append(state)
    try:
        yield state
    finally:
        _MODULE_STATE.pop()


def current_module_state() -> ModuleState | None:
    return _MODULE_STATE[-1] if _MODULE_STATE else None


@dataclass
class PassContext:
    """What a pass may record: fusions, kernel choices, precision promotions and fallbacks."""

    opts: Options
    unit: str
    stage: str
    # what this unit's passes have said already, shared by its stages (a site a pass leaves is
    # there at every stage the pass runs in): each says it once
    said: set[str] = field(default_factory=set)

    def once(self, text: str) -> bool:
        """True the first time ``text`` is said for this unit."""
        if text in self.said:
            return False
        self.said.add(text)
        return True

    def fusion(self, kind: str, count: int = 1) -> None:
        report().add_unit_fusion(self.unit, kind, count)

    def kernel_choice(self, node: fx.Node, choice: str, reason: str, **extra: Any) -> None:
        report().add_unit_kernel_choice(self.unit, {"node": node.name, "choice": choice, "reason": reason,
                                                    "site": blame.site(node), **_plain(extra)})

    def promotion(self, node: fx.Node, reason: str, **extra: Any) -> None:
        report().add_unit_promotion(self.unit, {"node": node.name, "reason": reason, "site": blame.site(node),
                                                **_plain(extra)})

    def fallback(self, kind: FallbackKind, nodes: Sequence[fx.Node], *, reason: str, action: str,
                 level: int = logging.INFO) -> None:
        """A compile-time fallback of this unit at ``nodes``, named by their sites."""
        report().add_fallback(kind, node=",".join(n.name for n in nodes), phase="compile", graph=self.unit,
                              reason=reason, action=action, level=level, sites=[blame.site(n) for n in nodes])


def _plain(extra: dict[str, Any]) -> dict[str, Any]:
    """Report values must be plain data: symbolic sizes are recorded as their expression."""
    return {k: (v if isinstance(v, (str, int, float, bool, type(None), list, tuple, dict)) else str(v)) for k, v in extra.items()}


class EnnPass:
    """Base class of enn's passes."""

    name: ClassVar[str] = ""
    option: ClassVar[str] = ""  # the Options field that switches the pass on/off
    stage: ClassVar[str | tuple[str, ...]] = "joint"  # joint_pre | joint | post_grad, or several

    def __init__(self, opts: Options) -> None:
        self.opts = opts

    def __call__(self, graph: fx.Graph, ctx: PassContext) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def stages(cls) -> tuple[str, ...]:
        return cls.stage if isinstance(cls.stage, tuple) else (cls.stage,)

    def uuid(self) -> str:
        """Changes when the pass's sources or the options that change generated code do."""
        return hashlib.sha256(f"{sources_hash(type(self).__module__)}|{self.opts.codegen_hash()}".encode()).hexdigest()


class PassManager(compat.CustomGraphPass):
    """Runs the enabled ``passes`` of one stage, in order, on a graph."""

    def __init__(self, opts: Options, unit: str, stage: str, passes: Sequence[type[EnnPass]],
                 said: set[str] | None = None) -> None:
        if stage not in STAGES:
            raise ValueError(f"enn: unknown pass stage {stage!r}; valid: {', '.join(STAGES)}")
        self.opts = opts
        self.unit = unit
        self.stage = stage
        self.passes = [cls(opts) for cls in passes if stage in cls.stages() and getattr(opts, cls.option, True)]
        self.said = set() if said is None else said  # shared by the PassManagers of one unit
        self.matches: dict[str, int] = {}  # pass name -> matches in the last graph it ran on

    def __call__(self, graph: fx.Graph) -> None:
        ctx = PassContext(self.opts, self.unit, self.stage, self.said)
        if self.passes and self.stage == "joint_pre":
            # The pre pass runs before Inductor's own clean-up: leftover aten.alias / no-op
            # views would hide patterns (TORCH_NOTES). Inductor runs this again later.
            compat.remove_noop_ops(graph)
        if self.stage == "joint":
            # Inductor's joint passes (between enn's pre and post stages) insert a replacement at
            # the replaced node's position, which can come after a user enn inserted earlier (a
            # fused attention backward reading a rewritten gradient): restore a topological order.
            compat.stable_topological_sort(graph)
        self.matches = {}
        with compat.compile_event("enn_backend.passes"):  # shown among torch's compile events
            self._run(graph, ctx)
        if self.passes:
            graph.lint()

    def _run(self, graph: fx.Graph, ctx: PassContext) -> None:
        for p in self.passes:
            t0 = time.perf_counter()
            try:
                matches = p(graph, ctx)
            except Exception as exc:  # noqa: BLE001 - any failure disables this pass for the graph
                raise PassFailed(p.name, p.option, exc) from exc
            self.matches[p.name] = matches or 0
            log.debug("enn pass %s (%s, %s): %d match(es) in %.1f ms", p.name, self.stage, self.unit, matches or 0,
                      1e3 * (time.perf_counter() - t0))
            if log.isEnabledFor(logging.DEBUG) and os.environ.get("ENN_DEBUG_GRAPHS") == "1" and matches:
                log.debug("graph after %s:\n%s", p.name, graph)

    def uuid(self) -> Any:
        h = hashlib.sha256()
        # A guarded compile gives a backward no donated buffers (compat.saved_tensors_kept): its
        # code never writes into its inputs, which the guard's re-runs read. The artifacts of the
        # two kinds of compile must not be served for each other from Inductor's caches.
        donates = not self.opts.guard.guarded
        h.update(f"{self.stage}|{self.opts.codegen_hash()}|donates={donates}".encode())
        for p in self.passes:
            h.update(f"|{p.name}:{p.uuid()}".encode())
        h.update(sources_hash("enn_backend.lowerings").encode())  # the lowerings of the ops passes emit
        return h.hexdigest()
