"""Compile each distinct repeated block once (option ``blocks``).

A transformer reaches enn as one Dynamo graph holding every layer of its ``ModuleList`` one
after another; Inductor compiles that graph whole, so a 32-layer model costs 32 layers of
lowering, code generation and kernel builds although its layers are one block repeated. With
``blocks`` on, enn compiles the graph as a chain of segments instead:

1. **Plan** (:func:`plan`). Each node belongs to the layer its ``nn_module_stack`` names first
   with an index into a container (``model.layers.3``, ``encoder.layer.0``, ``layer1.2``).
   The graph becomes a head (what runs before the first layer), one segment per layer, and a
   tail (and the glue between layers, if any). A graph is split only if it holds at least
   :data:`MIN_LAYERS` layers of one container, each a single contiguous run of nodes.
2. **Inputs recomputed in each layer** (:func:`recompute_cheap_inputs`). A value the head
   computes from no parameter and nothing that needs a gradient -- Hugging Face's attention mask,
   built once per forward from ``attention_mask`` and ``arange``s -- is computed again at the top
   of each layer that reads it. The attention pass then sees where the mask comes from in every
   layer, as it does in the whole graph, and fuses the same kernels (a causal flag, not a
   T x T bias). Nodes inside an autocast region stay in the head: copied out of it they
   would compute at another precision.
3. **Compile** (:func:`compile_split`). torch.fx's ``split_module`` cuts the graph; Dynamo's own
   driver for split graphs (``SubmodCompiler``, what DDPOptimizer uses: fake inputs for each
   segment, with the strides the previous segment's compiled code really returns, and AOT
   Autograd's metadata kept per segment for the lazy backward compiles) hands each segment to
   enn as a unit of its own: its passes, its guard, its report lines, exactly as a Dynamo graph.
   The segments' inputs that are the graph's own (parameters, buffers, the user's tensors) get
   their real example values, so a pass that reads a buffer's content still can.
4. **Reuse** (:class:`ReuseTable`). AOT Autograd still traces each layer (its cost grows with
   depth, as Dynamo's does), but Inductor compiles each distinct graph once: a layer whose
   forward (or backward) graph -- ATen code after enn's passes, input layouts, constants,
   pins -- equals an earlier layer's takes that layer's compiled artifact. Layers that differ
   (a sliding-window layer among full-attention ones, a first layer with extra work) compile
   as many times as there are distinct graphs.

What the guard does with shared code: each layer keeps its own guard (schedule, checks,
ladder) and its own eager copy; only the artifact is shared. A fault found in one layer is
localized in that layer, and the artifact rebuilt with the pin is that layer's alone: the
other layers keep the shared artifact, and their own guards decide for them.

What is given up: fusion across a layer boundary (the residual add that ends one layer and the
norm that starts the next run as two kernels, one extra read and write of the hidden state per
layer), and host work per segment and call. Measured on an H200 (HF LLaMA d=1024, T=1024,
training, ``bench/results/gpu-h200/blocks_depth_2026-11-28.md``): the first step of 8 layers took
31 s against 50 s compiled whole (Inductor: 28 s), of 32 layers 70 s (Inductor: 73 s), and a step
about 9% longer than compiled whole. So it is off by default: ``blocks="on"`` is for deep models
whose compile time matters more than a few percent of step time.
Not split: graphs under CUDA graphs (``mode="reduce-overhead"``), under torch.distributed
(DDPOptimizer splits those its own way), with symbolic shapes, with option ``nvtx`` (a shared
artifact would name one layer's ranges for all), with ``fault_inject`` (faults are planted by
unit). Each such case is logged.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.fx as fx

from . import compat
from .blame import module_path
from .fx_utils import content_digest
from .report import Count, GraphRecord, report

log = logging.getLogger(__name__)

MIN_LAYERS = 2  # layers of one container a graph must hold to be split
MAX_RECOMPUTED = 256  # nodes a layer may recompute of the head's work (the mask's is ~30)

_INDEXED = re.compile(r"^(?P<container>.+)\.(?P<index>\d+)$")
_REGION_ENTER = ("_enter_autocast",)
_REGION_EXIT = ("_exit_autocast",)


# --------------------------------------------------------------------------- the plan
@dataclass
class Plan:
    """How a graph is cut: each node's segment, and what each segment is."""

    segment_of: dict[fx.Node, int]
    names: list[str]  # per segment: "head", "model.layers.0", ..., "tail", "glue"
    layers: int  # segments that are layers

    def describe(self) -> str:
        containers = sorted({_INDEXED.match(n)["container"] for n in self.names if _INDEXED.match(n)})
        return (f"{len(self.names)} segments: {self.layers} layers of {', '.join(containers)}"
                f"{' + head' if self.names[0] == 'head' else ''}{' + tail' if self.names[-1] == 'tail' else ''}")


def layer_of(n: fx.Node) -> Optional[str]:
    """The layer ``n`` belongs to: the outermost module of its ``nn_module_stack`` whose path
    ends with an index into a container (``model.layers.3``), else None."""
    stack = n.meta.get("nn_module_stack")
    if not stack:
        return None
    for path, _ in stack.values():
        p = module_path(str(path))
        if _INDEXED.match(p):
            return p
    return None


def plan(gm: fx.GraphModule) -> tuple[Optional[Plan], str]:
    """How to cut ``gm`` into head, layers and tail, or None and why not."""
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    labels = [layer_of(n) for n in body]
    # a node of no layer between two nodes of one layer (a getitem, a size) is that layer's
    for i, lab in enumerate(labels):
        if lab is None:
            before = next((labels[j] for j in range(i - 1, -1, -1) if labels[j] is not None), None)
            after = next((labels[j] for j in range(i + 1, len(labels)) if labels[j] is not None), None)
            if before is not None and before == after:
                labels[i] = before
    runs: list[tuple[Optional[str], list[fx.Node]]] = []
    for n, lab in zip(body, labels):
        if runs and runs[-1][0] == lab:
            runs[-1][1].append(n)
        else:
            runs.append((lab, [n]))
    layer_runs = [lab for lab, _ in runs if lab is not None]
    if len(layer_runs) != len(set(layer_runs)):
        again = sorted({lab for lab in layer_runs if layer_runs.count(lab) > 1})
        return None, f"layer {again[0]} is not one contiguous run of nodes"
    by_container: dict[str, int] = {}
    for lab in layer_runs:
        c = _INDEXED.match(lab)["container"]  # type: ignore[index]
        by_container[c] = by_container.get(c, 0) + 1
    if not by_container or max(by_container.values()) < MIN_LAYERS:
        return None, f"no container holds {MIN_LAYERS} or more layers in this graph"
    segment_of: dict[fx.Node, int] = {}
    names: list[str] = []
    first_layer = next(i for i, (lab, _) in enumerate(runs) if lab is not None)
    last_layer = max(i for i, (lab, _) in enumerate(runs) if lab is not None)
    for i, (lab, nodes) in enumerate(runs):
        name = lab if lab is not None else ("head" if i < first_layer else "tail" if i > last_layer else "glue")
        names.append(name)
        for n in nodes:
            segment_of[n] = len(names) - 1
    return Plan(segment_of, names, len(layer_runs)), ""


def wanted(gm: fx.GraphModule, example_inputs: list, opts: Any) -> tuple[bool, str]:
    """Whether option ``blocks`` splits this graph, and why not."""
    if opts.blocks == "off":
        return False, "option blocks is off"
    if opts.nvtx:
        return False, "option nvtx names each layer's ranges, which a shared artifact cannot"
    if opts.fault_inject:
        return False, "option fault_inject plants faults by unit"
    if compat.inductor_config_patches(opts.mode, opts.inductor).get("triton.cudagraphs",
                                                                     compat.inductor_config.triton.cudagraphs):
        return False, "CUDA graphs (reduce-overhead) record each graph whole"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return False, "under torch.distributed (DDPOptimizer splits graphs its own way)"
    if any(isinstance(x, torch.SymInt) for x in example_inputs) or any(
            isinstance(t, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in t.shape) for t in example_inputs):
        return False, "symbolic shapes"
    return True, ""


# --------------------------------------------------------------------------- recompute
def _in_regions(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes inside an autocast region (between Dynamo's enter and exit nodes)."""
    inside, depth = set(), 0
    for n in gm.graph.nodes:
        name = getattr(n.target, "__name__", str(n.target))
        if n.op == "call_function" and name in _REGION_EXIT:
            depth = max(depth - 1, 0)
        if depth:
            inside.add(n)
        if n.op == "call_function" and name in _REGION_ENTER:
            depth += 1
    return inside


def _needs_grad(n: fx.Node) -> bool:
    v = n.meta.get("example_value")
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in (v if isinstance(v, (list, tuple)) else [v]))


def _cheap_slice(v: fx.Node, head: set[fx.Node], regions: set[fx.Node],
                 order: dict[fx.Node, int]) -> Optional[list[fx.Node]]:
    """The head nodes ``v`` is computed from (``v`` included), in graph order, if they may be
    recomputed elsewhere: no gradient anywhere, no autocast region, no module call, no in-place
    op, at most MAX_RECOMPUTED nodes; else None."""
    seen: set[fx.Node] = set()
    stack = [v]
    while stack:
        n = stack.pop()
        if n in seen or n.op == "placeholder" or n not in head:
            continue
        if (n.op not in ("call_function", "call_method", "get_attr") or n in regions or _needs_grad(n)
                or n.is_impure() or len(seen) >= MAX_RECOMPUTED):
            return None
        seen.add(n)
        for a in n.all_input_nodes:
            if a.op == "placeholder" and _needs_grad(a):
                return None
            stack.append(a)
    return sorted(seen, key=order.__getitem__)


def recompute_cheap_inputs(gm: fx.GraphModule, p: Plan) -> int:
    """Give each layer its own copy of the cheap head values it reads (see the module doc);
    the number of values copied into layers."""
    head = {n for n, s in p.segment_of.items() if p.names[s] == "head"}
    if not head:
        return 0
    regions = _in_regions(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}  # the head's nodes keep their order below
    copied = 0
    by_segment: dict[int, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        by_segment.setdefault(p.segment_of.get(n, -1), []).append(n)
    for s, name in enumerate(p.names):
        if not _INDEXED.match(name):
            continue
        nodes = by_segment.get(s, [])
        reads = {a for n in nodes for a in n.all_input_nodes if a in head}
        for v in sorted(reads, key=order.__getitem__):
            part = _cheap_slice(v, head, regions, order)
            if part is None:
                continue
            env: dict[fx.Node, fx.Node] = {}
            with gm.graph.inserting_before(nodes[0]):
                for n in part:
                    env[n] = gm.graph.node_copy(n, lambda a: env.get(a, a))
                    p.segment_of[env[n]] = s
            for n in nodes:
                n.replace_input_with(v, env[v])
            copied += 1
    gm.graph.lint()
    gm.recompile()
    return copied


# --------------------------------------------------------------------------- reuse
@dataclass
class _Built:
    compiled: Any
    record: GraphRecord
    built_with_cpp_wrapper: bool
    pinned_in: int


@dataclass
class ReuseTable:
    """The artifacts compiled so far in one split compile, by :func:`artifact_key`."""

    built: dict[str, _Built] = field(default_factory=dict)
    compiled: int = 0
    reused: int = 0


_TABLE: contextvars.ContextVar[Optional[ReuseTable]] = contextvars.ContextVar("enn_blocks_reuse", default=None)


@contextlib.contextmanager
def reusing(table: ReuseTable) -> Iterator[ReuseTable]:
    """Make ``table`` the one the units compiled inside take (:func:`active_table`)."""
    token = _TABLE.set(table)
    try:
        yield table
    finally:
        _TABLE.reset(token)


def active_table() -> Optional[ReuseTable]:
    """The reuse table of the split compile in progress, else None. A unit's compile takes it
    once (backend.make_inner_compile) and keeps it for its backward, which AOT Autograd compiles
    later, on the first backward call."""
    return _TABLE.get()


def _layout(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"T{tuple(x.shape)}{tuple(x.stride())}{x.dtype}{x.device}{x.requires_grad}{x.storage_offset()}"
    return f"{type(x).__name__}:{x!r}"


def _constants(gm: fx.GraphModule) -> str:
    """The graph's constant tensors, by content (two layers may name different constants alike)."""
    h = hashlib.sha256()
    for n in gm.graph.find_nodes(op="get_attr"):
        t = getattr(gm, str(n.target), None)
        if isinstance(t, torch.Tensor):
            if t.numel() > 1 << 16 or t.is_meta or compat.is_fake(t):
                return ""  # unknown content: no key
            h.update(f"{n.target}|{_layout(t)}|{content_digest(t)}".encode())
    return h.hexdigest()


_KWARGS = ("is_backward", "is_inference", "static_input_idxs", "cpp_wrapper", "aot_mode", "layout_opt")


def artifact_key(compiler: Any) -> Optional[str]:
    """What decides a graph's compiled artifact: its ATen code after enn's passes, its input
    layouts, its constants, its pins and precision, and the compile's own arguments; None
    where it cannot be told (a constant of unknown content)."""
    consts = _constants(compiler.eager_gm)
    if consts == "" and compiler.eager_gm.graph.find_nodes(op="get_attr"):
        return None
    h = hashlib.sha256()
    for part in (compiler.phase, compiler.eager_gm.code, consts, ",".join(sorted(compiler.pinned_names)),
                 str(bool(compiler.fp32)), repr([(k, compiler.kwargs.get(k)) for k in _KWARGS])):
        h.update(part.encode())
        h.update(b"\0")
    for x in compiler.example_inputs:
        h.update(_layout(x).encode())
    return h.hexdigest()


def shared_build(table: Optional[ReuseTable], compiler: Any) -> Optional[Any]:
    """An artifact an earlier layer of ``table``'s split compile built for a graph equal to
    ``compiler``'s (its record updated to say so), else None."""
    if table is None:
        return None
    key = artifact_key(compiler)
    hit = table.built.get(key) if key else None
    if hit is None:
        return None
    rec = compiler.record
    rec.path, rec.compiled_nodes = hit.record.path, hit.record.compiled_nodes
    rec.build_choices = dict(hit.record.build_choices)
    rec.reused_from = hit.record.id
    compiler.built_with_cpp_wrapper = hit.built_with_cpp_wrapper
    compiler.first_build = False
    compiler.note_artifact(hit.compiled, hit.pinned_in)
    table.reused += 1
    report().count(Count.BLOCKS_REUSED)
    log.debug("enn: %s reuses the artifact compiled for %s", rec.id, hit.record.id)
    return hit.compiled


def offer(table: Optional[ReuseTable], compiler: Any, compiled: Any, pinned_in: int) -> None:
    """Make ``compiled``, the first build of ``compiler``'s graph, available to later layers."""
    if table is None:
        return
    key = artifact_key(compiler)
    table.compiled += 1
    report().count(Count.BLOCKS_COMPILED)
    if key and key not in table.built:
        table.built[key] = _Built(compiled, compiler.record, compiler.built_with_cpp_wrapper, pinned_in)


# --------------------------------------------------------------------------- compile
class Segment:
    """One compiled segment as the split graph calls it. While Dynamo's driver runs the split
    graph on fake tensors at compile time (to learn each segment's real output strides), the
    call goes to AOT Autograd's function under enn's wrappers, which return the fake outputs;
    enn's per-unit wrappers (the Dynamo-graph reference, the buffer-content check) see only real
    calls."""

    def __init__(self, compiled: Callable[..., Any]) -> None:
        self.compiled = compiled
        self.inner = compiled
        while getattr(self.inner, "wraps_unit", False):  # enn's per-unit wrappers (backend.py, guard/)
            self.inner = self.inner.compiled
        self.at_compile = True

    def __call__(self, *args: Any) -> Any:
        return (self.inner if self.at_compile else self.compiled)(*args)


def compile_split(gm: fx.GraphModule, example_inputs: list, opts: Any, p: Plan,
                  compile_unit: Callable[[fx.GraphModule, list, Any], Callable[..., Any]]) -> Callable[..., Any]:
    """``gm`` compiled as the chain of segments ``p`` describes, each distinct graph once."""
    copied = recompute_cheap_inputs(gm, p)
    real = {n.name: x for n, x in zip(gm.graph.find_nodes(op="placeholder"), example_inputs)}
    segments: list[Segment] = []

    def compile_segment(sub: fx.GraphModule, args: list) -> Segment:
        # the graph's own inputs keep their real values (passes may read a buffer's content)
        args = [real.get(ph.name, a) for ph, a in zip(sub.graph.find_nodes(op="placeholder"), args)]
        seg = Segment(compile_unit(sub, args, opts))
        segments.append(seg)
        return seg

    table = ReuseTable()
    with reusing(table):
        split = compat.compile_split(gm, lambda n: p.segment_of[n], example_inputs, compile_segment)
    for seg in segments:
        seg.at_compile = False
    log.info("enn: graph of %d ops compiled as %s: %d distinct graphs compiled, %d reused%s",
             len(p.segment_of), p.describe(), table.compiled, table.reused,
             f"; {copied} mask/position value(s) recomputed per layer" if copied else "")
    return split
