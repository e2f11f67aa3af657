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
4. **Equal segments run one unit** (:func:`segment_key`). Dynamo passes parameters as graph
   inputs, so a compiled segment is a function of its inputs alone. A segment whose Dynamo graph
   equals an earlier one's -- its code with nodes named by position, constants by content, input
   layouts, which inputs share storage, the module buffers it reads (by identity) -- is neither
   traced nor compiled: it runs the earlier segment's compiled unit on its own inputs, forward
   and backward (AOT Autograd compiles the unit's backward once, at the first backward call to
   reach it), and the next segments are compiled for fake outputs laid out like that unit's. A
   unit whose outputs alias its inputs or each other is not shared (what a new output aliases
   depends on the inputs). A 32-layer decoder is then traced as head, one layer and tail.
5. **Equal graphs build one artifact** (:class:`ReuseTable`). Segments that differ as Dynamo
   graphs are traced apart, but Inductor compiles each distinct ATen graph once: a graph
   (forward or backward) -- ATen code after enn's passes, input layouts, constants, pins --
   equal to an earlier segment's takes that segment's compiled artifact. Layers that differ (a
   sliding-window layer among full-attention ones, a first layer with extra work) compile as
   many times as there are distinct graphs.

What the guard does: each unit has one guard (schedule, checks, ladder, eager copy), so the
layers that run one unit share its guard. Its checks sample calls of all those layers (a value
check on the unit's first call checks the first layer that runs it; the warm-up counts calls,
so it ends after fewer steps). A fault found in any of those calls is localized in the unit's
graph -- the ops of one layer, named by the first such layer's modules and source lines -- and
the artifact rebuilt with the pin is what every layer running the unit runs from then on: they
run the same code, so a kernel wrong for one is that kernel in all of them. Units that differ
(another kind of layer, the head, the tail) keep their own guards and artifacts. Where two units
share only an artifact (step 5), a pin rebuilds that unit's artifact alone.

What is given up: fusion across a layer boundary (the residual add that ends one layer and the
norm that starts the next run as two kernels, one extra read and write of the hidden state per
layer), and host work per segment and call: on an H200 (HF LLaMA d=1024, T=1024, training,
``bench/results/gpu-h200/blocks_depth_2026-11-28.md``) a step took about 9% longer than compiled
whole. So it is off by default: ``blocks="on"`` is for deep models whose compile time matters
more than a few percent of step time. What it buys, on CPU (``bench/gpu_blocks_depth.py --device
cpu``: LLaMA d=256, T=128, training, two shared cores, noisy): the first step of 2, 8 and 32
layers took 23-40, 33-48 and 50-54 s, against 38-48, 51-79 and 160 s compiled whole; a layer past
the first costs its share of Dynamo's trace and of the first step's run, and about 0.04 s of
enn's own (its key, the split). A graph of :data:`MIN_LAYERS` layers is split too: on CPU two layers compile
faster split than whole (the whole graph builds each layer's C++ kernels; split, one layer's).
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


# --------------------------------------------------------------------------- equal segments
_META = ("recompute", "ac_graph_id", "custom", "partitioner_tag")  # node metadata compiles read


def _is_buffer(x: Any) -> bool:
    """Whether ``x`` is a module buffer as Dynamo passes it (the inputs a pass may read the
    content of: passes.manager.ModuleState)."""
    return (isinstance(x, torch.Tensor) and not compat.is_fake(x) and not isinstance(x, torch.nn.Parameter)
            and not x.requires_grad and getattr(x, "_dynamo_static_input_type", None) is not None)


def _target(n: fx.Node, gm: fx.GraphModule) -> Optional[str]:
    t = n.target
    if n.op == "call_function":
        # torch's ops by name; any other function by identity (two closures may share a name)
        named = isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator))
        return repr(t) if named else f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', t)}@{id(t)}"
    if n.op == "get_attr":
        value = getattr(gm, str(t), None)
        if isinstance(value, fx.GraphModule):  # a higher-order op's body
            return _structure(value)
        if isinstance(value, torch.Tensor):
            if value.numel() > 1 << 16 or value.is_meta or compat.is_fake(value):
                return None
            return f"{_layout(value)}|{content_digest(value)}"
        return None
    if n.op == "call_module":
        return None
    return "" if n.op == "placeholder" else str(t)  # an input is named by its position


def _structure(gm: fx.GraphModule) -> Optional[str]:
    """``gm``'s code with its nodes named by position, its constants by content, and the node
    metadata compiles read; None where a node's meaning cannot be told (a submodule call, a
    constant of unknown content)."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    lines = []
    for n in gm.graph.nodes:
        target = _target(n, gm)
        if target is None:
            return None
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: f"%{index[a]}")  # type: ignore[arg-type]
        lines.append(f"{n.op} {target} {args!r} {[n.meta.get(k) for k in _META]!r}")
    return "\n".join(lines)


def segment_key(sub: fx.GraphModule, args: list) -> Optional[str]:
    """What decides a segment's compiled unit, as Dynamo hands the segment over: its code (nodes
    by position, constants by content), its inputs' layouts and kinds, which of them share
    storage, and which module buffers it reads -- the buffers themselves, not their content:
    a pass may compile a buffer's content in, and the check that it still holds it
    (backend.BufferContentGuard) is cheap for one buffer, not for several taking turns. None
    where a node's meaning cannot be told."""
    code = _structure(sub)
    if code is None:
        return None
    storages: dict[int, int] = {}
    inputs = []
    for i, x in enumerate(args):
        if isinstance(x, torch.Tensor):
            same = storages.setdefault(x.untyped_storage()._cdata, i)
            kind = f"buffer at {x.data_ptr()}" if _is_buffer(x) else getattr(x, "_dynamo_static_input_type", None)
            inputs.append(f"{_layout(x)}|{type(x).__name__}|{kind}|@{same}")
        else:
            inputs.append(_layout(x))
    return hashlib.sha256("\0".join([code, *inputs]).encode()).hexdigest()


# --------------------------------------------------------------------------- compile
class Segment:
    """One compiled segment as the split graph calls it. While Dynamo's driver runs the split
    graph on fake tensors at compile time (to learn each segment's real output strides), the
    call goes to AOT Autograd's function under enn's wrappers, which return the fake outputs;
    enn's per-unit wrappers (the Dynamo-graph reference, the buffer-content check) see only real
    calls. That call's inputs and outputs are kept (``traced``): a later equal segment gets fake
    outputs like them (:meth:`outputs_for`)."""

    def __init__(self, compiled: Callable[..., Any], graphs: int) -> None:
        self.compiled = compiled
        self.inner = compiled
        while getattr(self.inner, "wraps_unit", False):  # enn's per-unit wrappers (backend.py, guard/)
            self.inner = self.inner.compiled
        self.graphs = graphs  # the unit's graphs: forward and backward, or one for inference
        self.at_compile = True
        self.traced: Optional[tuple[list, Any]] = None  # (fake inputs, fake outputs) of the call at compile time

    def __call__(self, *args: Any) -> Any:
        if not self.at_compile:
            return self.compiled(*args)
        out = self.inner(*args)
        self.traced = (list(args), out)
        return out

    def outputs_for(self, fake_mode: Any) -> Optional[Any]:
        """Fake outputs for another call of this segment's unit (an equal segment's), in
        ``fake_mode``: new tensors with the traced call's layouts. None where an output shares
        storage with an input or another output, or starts past its storage's start (a view of
        an input or of an intermediate, a written input): what such outputs alias depends on the
        inputs, which the new tensors would not say. (The traced outputs themselves are views:
        AOT Autograd lays its fake outputs out with ``as_strided``.)"""
        if self.traced is None or not isinstance(self.traced[1], (tuple, list)):
            return None
        args, outs = self.traced
        tensors = [t for t in outs if isinstance(t, torch.Tensor)]
        seen = {x.untyped_storage()._cdata for x in args if isinstance(x, torch.Tensor)}
        for t in tensors:
            cdata = t.untyped_storage()._cdata
            if t.storage_offset() != 0 or cdata in seen:
                return None
            seen.add(cdata)
        with fake_mode, torch.enable_grad():
            new = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) if isinstance(t, torch.Tensor)
                   else t for t in outs]
            # an output that needs a gradient comes out of an autograd function, not as a leaf
            new = [x.requires_grad_().clone() if isinstance(t, torch.Tensor) and t.requires_grad else x
                   for x, t in zip(new, outs)]
        return type(outs)(new)


def _graphs_of(args: list) -> int:
    """The ATen graphs AOT Autograd builds for a segment called with ``args``: a forward and a
    backward where the call records a backward (grad mode on, an input that requires grad), else
    one."""
    grad = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    return 2 if grad else 1


def compile_split(gm: fx.GraphModule, example_inputs: list, opts: Any, p: Plan,
                  compile_unit: Callable[[fx.GraphModule, list, Any], Callable[..., Any]]) -> Callable[..., Any]:
    """``gm`` compiled as the chain of segments ``p`` describes: each distinct segment traced
    and compiled once, each distinct ATen graph built once."""
    copied = recompute_cheap_inputs(gm, p)
    real = {n.name: x for n, x in zip(gm.graph.find_nodes(op="placeholder"), example_inputs)}
    segments: list[Segment] = []
    units: dict[str, Segment] = {}  # segment key -> the segment compiled for it
    keys: dict[int, Optional[str]] = {}  # id of a segment's submodule -> its key, for its compile
    reused = [0]

    def real_inputs(sub: fx.GraphModule, args: list) -> list:
        # the graph's own inputs keep their real values (passes may read a buffer's content)
        return [real.get(ph.name, a) for ph, a in zip(sub.graph.find_nodes(op="placeholder"), args)]

    def reuse_segment(sub: fx.GraphModule, args: list) -> Optional[tuple[Segment, Any]]:
        key = segment_key(sub, real_inputs(sub, args))
        owner = units.get(key) if key is not None else None
        outputs = owner.outputs_for(compat.fake_mode_of(args)) if owner is not None else None
        keys[id(sub)] = key
        if owner is None or outputs is None:
            return None
        reused[0] += 1
        report().count(Count.BLOCKS_REUSED, owner.graphs)  # its forward and backward graphs: the owner's
        return owner, outputs

    def compile_segment(sub: fx.GraphModule, args: list) -> Segment:
        compiled = compile_unit(sub, real_inputs(sub, args), opts)
        seg = Segment(compiled, _graphs_of(args))
        segments.append(seg)
        key = keys.pop(id(sub), None)
        if key is not None:
            units.setdefault(key, seg)
        return seg

    table = ReuseTable()
    with reusing(table):
        split = compat.compile_split(gm, lambda n: p.segment_of[n], example_inputs, compile_segment, reuse_segment)
    for seg in segments:
        seg.at_compile = False
        seg.traced = None
    log.info("enn: graph of %d ops compiled as %s: %d segment(s) traced, %d run an equal segment's compiled code; "
             "%d distinct graphs compiled, %d reused%s",
             len(p.segment_of), p.describe(), len(segments), reused[0], table.compiled, table.reused,
             f"; {copied} mask/position value(s) recomputed per layer" if copied else "")
    return split
