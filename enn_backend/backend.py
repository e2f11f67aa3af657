"""The ``enn`` backend: what ``torch.compile(model, backend="enn")`` calls.

Dynamo hands over one captured FX graph and its example inputs; enn compiles it with
Inductor's ``compile_fx`` plus enn's passes, decompositions, lowerings and guard:

    options -> compile_fx(decompositions = Inductor's + enn's,
                          config_patches = mode + Inductor's options + enn's joint / post-grad passes,
                          inner_compile  = enn's: compile each fwd/bwd graph, wrap in the guard)

Compile failures walk a ladder, each step recorded in the report: without the
failing enn pass -> plain Inductor -> the graph runs eagerly.

On a warm start AOT Autograd may load the compiled graphs from its cache instead
(enn_backend.aot_cache): they are guarded and reported as if just compiled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from . import blocks, compat, compile_time, size_recompiles
from .aot_cache import WarmStart, offer
from .cudagraph_cap import capped
from .debug.log import log_compiled_graph
from .decompositions import decomposition_table
from .fx_utils import content_digest
from .graph_compiler import GraphCompiler, compile_fx_defaults
from .guard import ranks
from .guard.calls import flat_args
from .guard.faults import parse_fault_spec
from .guard.dynamo_reference import DynamoReference
from .guard.runtime import GuardedGraph
from .options import Options
from .passes import PassFailed, PassManager, module_state
from .report import Count, FallbackKind, report

log = logging.getLogger(__name__)


def enn(gm: fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
        options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """Compile ``gm`` for ``torch.compile(..., backend="enn", mode=..., options=...)``."""
    opts = Options.from_sources(options, mode, inductor_config=compat.inductor_option_types())
    if torch.compiler.is_exporting():
        return _exported(gm)
    if opts.disable:
        # ENN_DISABLE is an override: when set, it decided (a false value would have enabled enn)
        by = f"ENN_DISABLE={os.environ['ENN_DISABLE']}" if "ENN_DISABLE" in os.environ else "options={'disable': True}"
        log.info("enn disabled by %s: compiling with plain Inductor", by)
        report().add_disabled(by)
        return compat.inductor_compile_fx(gm, example_inputs,
                                          config_patches=compat.inductor_config_patches(opts.mode, opts.inductor))
    example_inputs = list(example_inputs)
    size_recompiles.note_compile(gm, example_inputs)
    split = _split_into_blocks(gm, example_inputs, opts)
    return split if split is not None else compile_unit(gm, example_inputs, opts)


def _split_into_blocks(gm: fx.GraphModule, example_inputs: list, opts: Options) -> Callable[..., Any] | None:
    """``gm`` compiled as head, layers and tail, each distinct layer once (option blocks,
    enn_backend.blocks), or None where the option or the graph says no (logged)."""
    ok, why = blocks.wanted(gm, example_inputs, opts)
    plan, copy = None, None
    if ok:
        copy = _fresh(gm)  # the split edits its graph
        plan, why = blocks.plan(copy)
    if plan is None or copy is None:
        if opts.blocks != "off":  # asked for and not done: counted and logged
            report().count(Count.BLOCKS_NOT_SPLIT)
            log.info("enn: option blocks=%r: the graph is compiled whole: %s", opts.blocks, why)
        return None
    return blocks.compile_split(copy, example_inputs, opts, plan, compile_unit)


def _exported(gm: fx.GraphModule) -> Callable[..., Any]:
    """A Dynamo graph handed to enn while torch.export traces (a compile that export asked for:
    ``torch._dynamo.config.force_compile_during_fx_trace``, a higher-order op's body): export
    traces through what enn returns, so enn compiles nothing and returns the captured graph. The
    exported program then holds the model's own ATen ops -- no ``enn::`` op, no guard, no kernel
    that cannot take export's fake tensors -- and computes what eager computes."""
    unit = report().new_unit()
    report().add_fallback(FallbackKind.EXPORTING, node="<graph>", phase="compile", graph=unit,
                          reason="torch.export is tracing (torch.compiler.is_exporting())",
                          action=f"{unit} runs as captured, for export to trace: no enn pass, no guard")
    return gm.forward


def compile_unit(gm: fx.GraphModule, example_inputs: list, opts: Options) -> Callable[..., Any]:
    """Compile one Dynamo graph (a *unit*: its forward and backward graphs)."""
    unit = report().new_unit()
    with compile_time.unit_compile(unit):  # a compile event of torch's; see compile_time
        return _compile_unit(gm, example_inputs, opts, unit)


def _compile_unit(gm: fx.GraphModule, example_inputs: list, opts: Options, unit: str) -> Callable[..., Any]:
    t0 = time.perf_counter()
    pristine = _fresh(gm)  # compile_fx may mutate the graph
    while True:
        try:
            compiled = _compile_with_enn(_fresh(pristine), example_inputs, opts, unit, pristine)
            log.debug("enn compiled %s in %.2fs", unit, time.perf_counter() - t0)
            return compiled
        except PassFailed as exc:
            if opts.guard.raises or compat.is_dynamo_control_flow(exc.cause):
                if compat.is_dynamo_control_flow(exc.cause):
                    raise exc.cause from None
                ranks.unit_failed(unit, exc)
                raise
            report().add_fallback(FallbackKind.COMPILE_ERROR, node="<pass>", phase="compile", graph=unit,
                                  reason=str(exc), action=f"recompiling {unit} without enn pass {exc.pass_name!r}")
            opts = opts.replace(**{exc.option: False})
        except Exception as exc:  # noqa: BLE001 - the ladder catches every compile failure
            if opts.guard.raises or compat.is_dynamo_control_flow(exc) or isinstance(exc, ranks.RanksError):
                if not compat.is_dynamo_control_flow(exc):
                    ranks.unit_failed(unit, exc)
                raise
            report().add_fallback(FallbackKind.COMPILE_ERROR, node="<graph>", phase="compile", graph=unit,
                                  reason=f"{type(exc).__name__}: {str(exc).strip()[:300]}",
                                  action=f"compiling {unit} with plain Inductor")
            ranks.unit_fell_back(unit, exc)
            return _plain_inductor_or_eager(pristine, example_inputs, opts, unit)


def _fresh(gm: fx.GraphModule) -> fx.GraphModule:
    # a copy that keeps Dynamo's metadata (parameters and buffers stay static inputs for AOT
    # Autograd, as under backend="inductor"), see compat.copy_dynamo_graph
    return compat.copy_dynamo_graph(gm)


def _compile_with_enn(gm: fx.GraphModule, example_inputs: list, opts: Options, unit: str,
                      pristine: fx.GraphModule) -> Callable[..., Any]:
    patches: dict[str, Any] = compat.inductor_config_patches(opts.mode, opts.inductor)
    patches.update(compile_fx_defaults(example_inputs, opts, patches))  # options compile_fx itself reads
    # joint_pre runs before Inductor's joint-graph passes (its fuse_attention would take
    # attention patterns first, with other masked-row semantics); joint runs after them.
    said: set[str] = set()  # what the unit's passes said, at whichever stage: each says it once
    patches["joint_custom_pre_pass"] = PassManager(opts, unit, "joint_pre", said=said)
    patches["joint_custom_post_pass"] = PassManager(opts, unit, "joint", said=said)
    patches["post_grad_custom_post_pass"] = PassManager(opts, unit, "post_grad", said=said)
    if opts.emulate_precision_casts:
        patches["emulate_precision_casts"] = True
    inner = make_inner_compile(opts, unit, patches, parse_fault_spec(opts.fault_inject))
    decompositions = decomposition_table(opts.precision)
    # an AOTAutograd cache hit skips `inner`: WarmStart guards and reports the loaded graphs
    warm = WarmStart(pristine, example_inputs, opts, unit, patches, decompositions)
    # the guard re-runs a faulty graph on its inputs: a guarded backward must not write into them
    kept = compat.saved_tensors_kept() if opts.guard.guarded else contextlib.nullcontext()
    # the C++ wrapper's builds (and its loads from the caches) without 2.11's CPU-ISA probe: see compat
    with compat.aot_cache_hits(warm.on_load), module_state(example_inputs) as state, kept, \
            compat.inductor_attention_rewrites_off(), compat.device_builds_skip_vec_isa_probe():  # enn owns attention
        compiled = compat.compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches,
                                     decompositions=decompositions)
    assumed = warm.assumed if warm.hit else {i: content_digest(t) for i, t in state.assumed.items()}
    if assumed:
        compiled = BufferContentGuard(compiled, _fresh(pristine), assumed, unit)
    # the value check's second reference: the graph Dynamo handed over (guard/dynamo_reference.py),
    # told what the unit writes by AOT Autograd's metadata (of the compile, or of the cache entry)
    metadata = warm.metadata if warm.hit else compat.aot_metadata(compat.current_tracing_context())
    return DynamoReference.wrap(compiled, _fresh(pristine), opts, unit, metadata)


def make_inner_compile(opts: Options, unit: str, config_patches: dict, fault_specs: tuple) -> Callable[..., Any]:
    """The ``inner_compile`` enn gives compile_fx: compile, then wrap in the guard."""

    reuse = blocks.active_table()  # a layer of a split compile (option blocks): the layers' artifacts

    def inner_compile(gm: fx.GraphModule, example_inputs: list, **kwargs: Any) -> Any:
        what = f"{unit} ({'backward' if kwargs.get('is_backward') else 'forward'})"
        built: list[GraphCompiler] = []
        with compile_time.graph_compile(unit, lambda: bool(built) and built[0].built_with_cpp_wrapper) as bind:
            compiler, compiled = ranks.compile_agreed(  # under torch.distributed, by every rank (guard.ranks)
                lambda: GraphCompiler(gm, example_inputs, kwargs, opts=opts, unit=unit, config_patches=config_patches,
                                      fault_specs=fault_specs, reuse=reuse), what)
            built.append(compiler)
            bind(compiler.record)
            log_compiled_graph(compiler.record)  # the one info line per graph (+ TORCH_TRACE artifact)
            # under CUDA graphs, at most opts.cudagraph_max_shapes input sizes recorded (cudagraph_cap)
            runs = capped(compiled, compiler, compiler.record, opts, example_inputs)
            # the guard's first call is timed (compile_time.FirstCallClock)
            returned = (compile_time.FirstCallClock.arm(GuardedGraph(compiler, runs, compiler.record))
                        if opts.guard.guarded else runs)
            return offer(compiler, compiled, returned)

    return inner_compile


class BufferContentGuard:
    """Runs a graph compiled for the content of some module buffers only while they keep it.

    A pass may compile a buffer's content into the graph (nanoGPT's ``tril`` mask buffer
    becomes a causal flag). Dynamo guards neither the values nor the identity of module
    buffers, so before each call this checks each such buffer: same storage and version
    counter as last checked is free; otherwise the digest of its content is compared with
    the compiled-for one (one copy to the host). A buffer whose content changed makes the
    call run the captured graph eagerly -- correct for any content -- recorded as a
    fallback and logged.
    """

    wraps_unit = True  # a wrapper around a unit's compiled callable (``.compiled``): see blocks.Segment

    def __init__(self, compiled: Callable[..., Any], eager: fx.GraphModule, assumed: dict[int, str],
                 unit: str) -> None:
        self.compiled, self.eager, self.unit = compiled, eager, unit
        self.assumed = assumed
        self.seen: dict[int, tuple[int, int]] = {}  # index -> (data_ptr, _version) last found equal
        self.changed: set[int] = set()

    def _unchanged(self, args: Sequence[Any]) -> bool:
        ok = True
        for i, want in self.assumed.items():
            x = args[i]
            key = (x.data_ptr(), x._version)
            if self.seen.get(i) == key:
                continue
            if content_digest(x) == want:
                self.seen[i] = key
                continue
            ok = False
            if i not in self.changed:
                self.changed.add(i)
                report().add_fallback(FallbackKind.BUFFER_CHANGED, node=f"input {i}", phase="forward", graph=self.unit,
                                      reason=f"module buffer (graph input {i}) no longer holds the content {self.unit} "
                                             "was compiled for (e.g. its mask is no longer causal)",
                                      action="this graph runs eagerly while the buffer differs")
        return ok

    def __call__(self, *args: Any) -> Any:
        flat, boxed = flat_args(args)
        if self._unchanged(flat):
            return self.compiled(*args)
        out = self.eager(*flat)
        if boxed:
            flat.clear()  # the boxed convention: the callee owns (and frees) the argument list
        return out


def _plain_inductor_or_eager(gm: fx.GraphModule, example_inputs: list, opts: Options, unit: str) -> Callable[..., Any]:
    try:
        with compat.inductor_attention_rewrites_off():
            return compat.inductor_compile_fx(_fresh(gm), example_inputs,
                                              config_patches=compat.inductor_config_patches(opts.mode, opts.inductor))
    except Exception as exc:  # noqa: BLE001
        report().add_fallback(FallbackKind.COMPILE_ERROR, node="<graph>", phase="compile", graph=unit,
                              reason=f"plain Inductor failed too: {type(exc).__name__}: {str(exc).strip()[:300]}",
                              action=f"{unit} runs eagerly")
        return gm.forward
