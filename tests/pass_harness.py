"""Run named enn passes on a traced graph and check what they did (like vLLM's test backend).

    run = run_passes(fn, inputs, passes=["attention"], training=True)
    assert run.matches == {"attention": 1}
    assert_ops(run.after, present=[aten._scaled_dot_product_flash_attention_for_cpu],
               absent=[aten.bmm, aten._softmax])
    run.check_eager()  # outputs (and input gradients) equal eager's at the dtype's tolerance

``fn`` is captured by Dynamo as one graph and traced by Inductor's ``compile_fx`` with enn's
decomposition table, as ``backend="enn"`` traces it, so each pass sees the graphs it sees under
enn (joint forward + backward when an input requires grad, else the inference graph). Only the
named passes are installed, each at its stage(s); Inductor's own joint passes still run between
enn's ``joint_pre`` and ``joint`` stages. The compiled graphs then run eagerly (no code
generation): the numbers check the rewrite, not Inductor's kernels. Module buffers a pass relies
on are visible to it (ModuleState) and listed in ``PassRun.assumed``, not guarded per call (that
is backend.py's job).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.fx as fx

from enn_backend import compat
from enn_backend.decompositions import decomposition_table
from enn_backend.graph_compiler import boxed_eager
from enn_backend.options import Options
from enn_backend.passes import PASS_ORDER, PASSES_BY_NAME, EnnPass, PassManager, module_state
from enn_backend.report import GraphRecord, report

# Per dtype (atol, rtol) for comparisons with eager.
TOLERANCES = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}
_STAGE_PATCH = {"joint_pre": "joint_custom_pre_pass", "joint": "joint_custom_post_pass",
                "post_grad": "post_grad_custom_post_pass"}


@dataclass
class StageRun:
    """One run of a stage's passes on one graph: the graph before and after, matches per pass."""

    stage: str
    before: fx.Graph
    after: fx.Graph
    matches: dict[str, int]
    graph_id: int  # which graph: Inductor also runs the joint stages on HOP subgraphs (a flex mask_mod)


@dataclass
class PassRun:
    fn: Callable[..., Any]
    inputs: list
    training: bool
    compiled: Callable[..., Any]
    output: Any
    record: GraphRecord  # the report's record of the run: what the passes recorded
    stages: list[StageRun] = field(default_factory=list)
    assumed: dict[int, torch.Tensor] = field(default_factory=dict)  # module buffers a pass relied on, by input index

    @property
    def matches(self) -> dict[str, int]:
        """Matches per pass over every stage run (a pass in two stages counts in both)."""
        total: dict[str, int] = {}
        for s in self.stages:
            for name, n in s.matches.items():
                total[name] = total.get(name, 0) + n
        return total

    def _joint(self) -> list[StageRun]:
        """The joint-stage runs on the top-level graph: the first graph a joint stage runs on
        (Inductor runs them on a graph's HOP subgraphs after the graph itself, on those the
        traced code had before it)."""
        runs = [s for s in self.stages if s.stage != "post_grad"]
        if not runs:
            raise AssertionError("no joint-graph stage ran (only post-grad passes were named?)")
        return [s for s in runs if s.graph_id == runs[0].graph_id]

    @property
    def before(self) -> fx.Graph:
        """The joint (or inference) graph before enn's first stage."""
        return self._joint()[0].before

    @property
    def after(self) -> fx.Graph:
        """The joint (or inference) graph after enn's last joint stage."""
        return self._joint()[-1].after

    @property
    def choices(self) -> list[dict]:
        """The kernel choices the passes recorded."""
        return list(self.record.kernel_choices)

    def check_eager(self, atol: Optional[float] = None, rtol: Optional[float] = None, seed: int = 0) -> None:
        """Outputs (and, in training, the gradients of the inputs and parameters that require grad)
        equal eager's."""
        outs, ref = _flat(self.output), _flat(self.fn(*self.inputs))
        assert len(outs) == len(ref), (len(outs), len(ref))
        for got, want in zip(outs, ref):
            _close(got, want, atol, rtol)
        if not self.training:
            return
        wrt = _grad_leaves(self.fn, self.inputs)
        g = torch.Generator().manual_seed(seed)
        gouts = [torch.randn(r.shape, generator=g).to(r.device, r.dtype) for r in ref if r.requires_grad]
        got_grads = torch.autograd.grad([o for o in outs if o.requires_grad], wrt, gouts)
        want_grads = torch.autograd.grad([r for r in ref if r.requires_grad], wrt, gouts)
        for got, want in zip(got_grads, want_grads):
            _close(got, want, atol, rtol)


def _grad_leaves(fn: Callable[..., Any], inputs: Sequence[Any]) -> list[torch.Tensor]:
    """The inputs that require grad, and a module's parameters that do."""
    params = [p for p in fn.parameters() if p.requires_grad] if isinstance(fn, torch.nn.Module) else []
    return [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad] + params


def _flat(x: Any) -> list[torch.Tensor]:
    return [t for t in (x if isinstance(x, (tuple, list)) else (x,)) if isinstance(t, torch.Tensor)]


def _close(got: torch.Tensor, want: torch.Tensor, atol: Optional[float], rtol: Optional[float]) -> None:
    a, r = TOLERANCES.get(want.dtype, (1e-5, 1e-4))
    torch.testing.assert_close(got, want, atol=a if atol is None else atol, rtol=r if rtol is None else rtol,
                               equal_nan=True)


class _Recording(PassManager):
    def __init__(self, opts: Options, unit: str, stage: str, passes: Sequence[type[EnnPass]],
                 runs: list[StageRun]) -> None:
        super().__init__(opts, unit, stage, passes)
        self.runs = runs

    def __call__(self, graph: fx.Graph) -> None:
        before = copy.deepcopy(graph)
        super().__call__(graph)
        self.runs.append(StageRun(self.stage, before, copy.deepcopy(graph), dict(self.matches), id(graph)))


def run_passes(fn: Callable[..., Any], inputs: Sequence[Any], passes: Sequence[str] = ("attention",), *,
               training: bool = True, options: Optional[dict] = None, dynamic: bool = False) -> PassRun:
    """Compile ``fn`` with only the enn passes named in ``passes``, run it once on ``inputs``.

    ``training``: run with gradients on (AOT Autograd traces a joint graph when an input requires
    grad); else under ``torch.no_grad()`` (the inference graph).
    """
    unknown = [p for p in passes if p not in PASSES_BY_NAME]
    if unknown:
        raise ValueError(f"unknown enn pass(es) {unknown}; valid: {', '.join(PASSES_BY_NAME)}")
    classes = [cls for cls in PASS_ORDER if cls.name in passes]  # in enn's order, whatever the order named
    if training and not _grad_leaves(fn, inputs):
        raise ValueError("training=True needs an input (or a parameter of the module) that requires grad")
    opts = Options.from_sources(options)
    unit = report().new_unit()
    runs: list[StageRun] = []
    stages = {s for cls in classes for s in cls.stages()}
    patches = {_STAGE_PATCH[s]: _Recording(opts, unit, s, classes, runs) for s in stages if s != "post_grad"}
    post_grad = _Recording(opts, unit, "post_grad", classes, runs) if "post_grad" in stages else None

    def inner_compile(gm: fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable[[list], Any]:
        if post_grad is not None:
            post_grad(gm.graph)
        gm.recompile()  # the graph as enn hands it to Inductor runs eagerly: it must be valid ATen
        return boxed_eager(gm)

    assumed: dict[int, torch.Tensor] = {}

    def backend(gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        with module_state(list(example_inputs)) as state, compat.no_aot_autograd_cache():
            compiled = compat.compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches,
                                         decompositions=decomposition_table(opts.precision))
        assumed.update(state.assumed)
        return compiled

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)
    with torch.set_grad_enabled(training):
        output = compiled(*inputs)
    # what the passes recorded for the unit (fusions, kernel choices) lands in one report record
    record = report().new_graph(unit, "forward" if training else "inference")
    return PassRun(fn, list(inputs), training, compiled, output, record, runs, assumed)


def _matches(n: fx.Node, op: Any) -> bool:
    t = n.target
    return n.op == "call_function" and (t is op or getattr(t, "overloadpacket", None) is op)


def count_ops(graph: fx.Graph, op: Any) -> int:
    """How many nodes call ``op`` (an OpOverload, or an OpOverloadPacket for any of its overloads)."""
    return sum(1 for n in graph.nodes if _matches(n, op))


def find_ops(graph: fx.Graph, op: Any) -> list[fx.Node]:
    return [n for n in graph.nodes if _matches(n, op)]


def assert_ops(graph: fx.Graph, present: Iterable[Any] = (), absent: Iterable[Any] = ()) -> None:
    """Every op in ``present`` appears in ``graph``, no op in ``absent`` does."""
    missing = [op for op in present if count_ops(graph, op) == 0]
    found = [op for op in absent if count_ops(graph, op) > 0]
    assert not missing and not found, (f"missing: {missing}, unexpectedly present: {found}\n{graph}")
