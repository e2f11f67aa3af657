"""enn's FX passes: one pattern family per module, run in one fixed order.

Each pass is a small class (:class:`EnnPass`) with ``__call__(graph, ctx) -> matches``,
the option that switches it, and the stage it runs at. :class:`PassManager` runs
the passes of a stage as one ``CustomGraphPass`` whose ``uuid()`` hashes every file
that decides enn's graphs (passes, patterns, decompositions, lowerings, custom ops)
plus the options that change code, so Inductor's FX graph cache stays correct and on.

Graph invariants every pass keeps: the graph stays functional (no new mutation or
aliasing), ``meta['val']`` is current on every node it creates, and a pass that
raises leaves enn to recompile the graph without it (recorded in the report).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator

import torch.fx as fx

from .. import compat
from ..options import Options
from ..report import report

log = logging.getLogger(__name__)


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
        import torch

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
    """What a pass may record: fusions, kernel choices and precision promotions."""

    opts: Options
    unit: str
    stage: str

    def fusion(self, kind: str, count: int = 1) -> None:
        report().add_unit_fusion(self.unit, kind, count)

    def kernel_choice(self, node: str, choice: str, reason: str, **extra: Any) -> None:
        report().add_unit_kernel_choice(self.unit, {"node": node, "choice": choice, "reason": reason, **_plain(extra)})

    def promotion(self, node: str, reason: str, **extra: Any) -> None:
        report().add_unit_promotion(self.unit, {"node": node, "reason": reason, **_plain(extra)})


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
    def sources(cls) -> list[str]:
        import sys

        return [sys.modules[cls.__module__].__file__]


def registered_passes() -> list[type[EnnPass]]:
    """All enn passes in run order.

    Ordering rules:
    - attention first, and in the joint *pre* stage: it must see softmax/masked_fill before
      Inductor's own fuse_attention (which runs between the pre and post stages) takes the
      patterns it knows, and before precision rewrites softmax.
    - epilogue before precision: it matches addmm + activation as Inductor emits them.
    - precision after the fusions: it promotes whatever low-precision reductions remain.
    - fp32 tail last: it wraps the output tail the other passes left.
    - flex constants (post-grad) after Inductor's fake-tensor propagation, which needs the
      lifts the attention pass put around them.
    """
    from .attention import AttentionPass
    from .attention_flex import FlexConstantsPass
    from .epilogue import EpiloguePass
    from .fp32_tail import Fp32TailPass
    from .precision import PrecisionPass

    return [AttentionPass, EpiloguePass, PrecisionPass, Fp32TailPass, FlexConstantsPass]


def _stages(cls: type[EnnPass]) -> tuple[str, ...]:
    return cls.stage if isinstance(cls.stage, tuple) else (cls.stage,)


def enn_source_files() -> list[str]:
    """Every file whose content decides what enn does to a graph."""
    root = os.path.dirname(os.path.dirname(__file__))
    files = glob.glob(os.path.join(root, "passes", "*.py"))
    files += glob.glob(os.path.join(root, "*.py"))
    files += glob.glob(os.path.join(root, "guard", "*.py"))
    from enn_backend import custom_ops, lowerings

    files += glob.glob(os.path.join(os.path.dirname(custom_ops.__file__), "*.py"))
    files += lowerings.lowering_sources()
    return sorted(set(files))


_SOURCE_HASH: str | None = None


def source_hash() -> str:
    global _SOURCE_HASH
    if _SOURCE_HASH is None:
        _SOURCE_HASH = compat.hash_files(enn_source_files())
    return _SOURCE_HASH


class PassManager(compat.CustomGraphPass):
    """Runs the enabled passes of one stage, in order, on a graph."""

    def __init__(self, opts: Options, unit: str, stage: str, passes: list[type[EnnPass]] | None = None) -> None:
        self.opts = opts
        self.unit = unit
        self.stage = stage
        classes = registered_passes() if passes is None else passes
        self.passes = [cls(opts) for cls in classes if stage in _stages(cls) and getattr(opts, cls.option, True)]

    def __call__(self, graph: fx.Graph) -> None:
        ctx = PassContext(self.opts, self.unit, self.stage)
        if self.passes and self.stage == "joint_pre":
            # The pre pass runs before Inductor's own clean-up: leftover aten.alias / no-op
            # views would hide patterns (TORCH_NOTES). Inductor runs this again later.
            compat.remove_noop_ops(graph)
        if self.stage == "joint":
            # Inductor's joint passes (between enn's pre and post stages) insert a replacement at
            # the replaced node's position, which can come after a user enn inserted earlier (a
            # fused attention backward reading a rewritten gradient): restore a topological order.
            compat.stable_topological_sort(graph)
        for p in self.passes:
            t0 = time.perf_counter()
            try:
                matches = p(graph, ctx)
            except Exception as exc:  # noqa: BLE001 - any failure disables this pass for the graph
                raise PassFailed(p.name, p.option, exc) from exc
            log.debug("enn pass %s (%s, %s): %d match(es) in %.1f ms", p.name, self.stage, self.unit, matches or 0,
                      1e3 * (time.perf_counter() - t0))
            if log.isEnabledFor(logging.DEBUG) and os.environ.get("ENN_DEBUG_GRAPHS") == "1" and matches:
                log.debug("graph after %s:\n%s", p.name, graph)
        if self.passes:
            graph.lint()

    def uuid(self) -> Any:
        h = hashlib.sha256()
        h.update(source_hash().encode())
        h.update(self.opts.codegen_hash().encode())
        h.update(self.stage.encode())
        h.update(",".join(p.name for p in self.passes).encode())
        return h.hexdigest()
