"""Run named enn passes on a traced graph and check what they did (like vLLM's test backend).

    run = run_passes(fn, inputs, passes=["attention"], training=True)
    assert run.matches == {"attention": 1}
    assert_ops(run.after, present=[aten._scaled_dot_product_flash_attention_for_cpu],
               absent=[aten.bmm, aten._softmax])
    run.check_eager()  # outputs (and input gradients) equal eager's: see PassRun.check_eager

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
from enn_backend.bench.accuracy import check_tensor
from enn_backend.debug.replay import fp64_graph, trace
from enn_backend.decompositions import decomposition_table
from enn_backend.graph_compiler import boxed_eager
from enn_backend.options import Options
from enn_backend.passes import PASS_ORDER, PASSES_BY_NAME, EnnPass, PassManager, module_state
from enn_backend.report import GraphRecord, report

# Per dtype (atol, rtol) for comparisons with eager.
TOLERANCES = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}
# Dtypes whose results past that tolerance are judged against fp64 (bench.accuracy's names)
_LOW = {torch.bfloat16: "bf16", torch.float16: "fp16"}
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
    source: tuple[fx.GraphModule, list]  # Dynamo's graph of fn and its inputs (closures, parameters lifted)
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
        equal eager's: within (atol, rtol) (the dtype's TOLERANCES unless given); a bf16 / fp16
        tensor past it passes if it is no further from an fp64 run than eager is, by torch's
        accuracy rule (bench.accuracy.check_tensor: RMSE vs fp64 at most 3x eager's + tol / 10)."""
        outs, ref = _flat(self.output), _flat(self.fn(*self.inputs))
        assert len(outs) == len(ref), (len(outs), len(ref))
        gouts: list[torch.Tensor] = []
        if self.training:
            wrt = _grad_leaves(self.fn, self.inputs)
            g = torch.Generator().manual_seed(seed)
            gouts = [torch.randn(r.shape, generator=g).to(r.device, r.dtype) for r in ref if r.requires_grad]
            got_grads = torch.autograd.grad([o for o in outs if o.requires_grad], wrt, gouts)
            want_grads = torch.autograd.grad([r for r in ref if r.requires_grad], wrt, gouts)
            outs, ref = outs + list(got_grads), ref + list(want_grads)
        fp64: Optional[list[torch.Tensor]] = None
        for i, (got, want) in enumerate(zip(outs, ref)):
            a, r = TOLERANCES.get(want.dtype, (1e-5, 1e-4))
            a, r = a if atol is None else atol, r if rtol is None else rtol
            if want.dtype not in _LOW or torch.allclose(got, want, atol=a, rtol=r, equal_nan=True):
                torch.testing.assert_close(got, want, atol=a, rtol=r, equal_nan=True)
                continue
            if fp64 is None:
                fp64 = self.fp64_reference(gouts)
                assert len(fp64) == len(ref), f"fp64 reference has {len(fp64)} results, eager {len(ref)}"
            check = check_tensor(i, got, want, fp64[i], tol=max(a, r), dtype=_LOW[want.dtype])
            assert check.passed, f"result {i} ({want.dtype}): {check.method}: {check.detail}"

    def fp64_reference(self, gouts: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
        """fn's outputs computed in fp64 from the same values (Dynamo's graph as ATen, every float
        dtype it names made float64), then in training the gradients by ``gouts`` of the inputs
        and parameters that require grad: the order of :meth:`check_eager`'s results."""
        gm, inputs = self.source
        wrt = _grad_leaves(self.fn, self.inputs) if self.training else []
        unknown = [i for i, t in enumerate(wrt) if not any(x is t for x in inputs)]
        if unknown:
            raise AssertionError(f"no fp64 reference: gradient leaves {unknown} are not inputs of Dynamo's graph")
        up = [x.detach().double().requires_grad_(any(x is t for t in wrt))
              if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]
        with torch.set_grad_enabled(self.training):
            outs = _flat(fp64_graph(trace(gm, inputs))(*up))
        if self.training:
            leaves = [next(u for x, u in zip(inputs, up) if x is t) for t in wrt]
            needs = [o for o in outs if o.requires_grad]
            outs += list(torch.autograd.grad(needs, leaves, [g.double() for g in gouts]))
        return [o.detach() for o in outs]


def _grad_leaves(fn: Callable[..., Any], inputs: Sequence[Any]) -> list[torch.Tensor]:
    """The inputs that require grad, and a module's parameters that do."""
    params = [p for p in fn.parameters() if p.requires_grad] if isinstance(fn, torch.nn.Module) else []
    return [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad] + params


def _flat(x: Any) -> list[torch.Tensor]:
    return [t for t in (x if isinstance(x, (tuple, list)) else (x,)) if isinstance(t, torch.Tensor)]


class _Recording(PassManager):
    def __init__(self, opts: Options, unit: str, stage: str, passes: Sequence[type[EnnPass]],
                 runs: list[StageRun], said: set[str]) -> None:
        super().__init__(opts, unit, stage, passes, said=said)
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
    said: set[str] = set()  # one unit's stages share what their passes said, as under the backend
    patches = {_STAGE_PATCH[s]: _Recording(opts, unit, s, classes, runs, said) for s in stages if s != "post_grad"}
    post_grad = _Recording(opts, unit, "post_grad", classes, runs, said) if "post_grad" in stages else None

    def inner_compile(gm: fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable[[list], Any]:
        if post_grad is not None:
            post_grad(gm.graph)
        gm.recompile()  # the graph as enn hands it to Inductor runs eagerly: it must be valid ATen
        return boxed_eager(gm)

    assumed: dict[int, torch.Tensor] = {}
    sources: list[tuple[fx.GraphModule, list]] = []

    def backend(gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        sources.append((gm, list(example_inputs)))
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
    return PassRun(fn, list(inputs), training, compiled, output, record, sources[0], runs, assumed)


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
