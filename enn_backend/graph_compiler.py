"""Compiles one post-AOT graph (forward, backward or inference) for enn.

AOT Autograd hands every graph it splits off to ``inner_compile``; enn's
(enn_backend.backend.make_inner_compile) makes a :class:`GraphCompiler` for it, which keeps

- the pristine ATen graph: the *eager copy* the guard re-runs, and the source of
  every recompile (pins, fp32 promotion);
- what Inductor needs to compile it again later (fake inputs, kwargs, the tracing
  context, Inductor config), so the guard can recompile at run time;

and builds compiled artifacts with this ladder: enn's rewrites + lowerings + enn's Inductor
defaults -> the same without those defaults -> without enn's rewrites -> the eager graph.
Every step down is recorded.
"""

from __future__ import annotations

import functools
import logging
import operator
import time
from typing import Any, Callable

import torch
import torch.fx as fx

from . import blame, blocks, build_choice, compat, nvtx
from .custom_ops.pinned import EMITTED, REFERENCE_PATHS, op_name
from .debug.repro import write_repro
from .fx_utils import copy_gm, mutated_input_indices, output_nodes
from .guard import graph_edit as E
from .guard.calls import distributed
from .guard.kernel_entry import graph_key, node_key
from .guard.kernel_state import KernelState, announce_pins, state_command, state_for
from .lowerings import enn_lowerings
from .options import Options
from .report import FallbackKind, GraphCounter, GraphRecord, report

log = logging.getLogger(__name__)

# Inductor options enn compiles a graph with, by device type, where options= leaves them unset
# (and the running Inductor has them). Each is off in Inductor's defaults; enn turns it on where
# it makes steps faster and no step slower. The launch-saving ones (combo kernels, the C++
# wrapper) go only to graphs whose host work pays for their compile time (build_choice: host-bound
# by kernel count against predicted kernel time; the choice in the graph's record). A graph that
# does not compile with them is compiled without them (recorded), before any of enn's rewrites is
# given up.
#
# combo_kernels: independent kernels fused horizontally, so a step launches fewer kernels; each
# sub-kernel keeps its own block sizes (a shared tile slows the larger ones), and only pointwise
# kernels are combined (a combined persistent reduction can be slower than its parts). On the CPU
# there are no launches to save. Calibrated on the real-model suite, H100, torch 2.11
# (bench/results/gpu-h100/real_gaps_combo_*.log).
INDUCTOR_DEFAULTS: dict[str, dict[str, Any]] = {
    "cuda": {"combo_kernels": True, "combo_kernel_per_subkernel_blocks": True, "combo_kernels_pointwise_only": True},
}
# On top of those, options of compile_fx itself (backend.py sets them there: compile_fx_defaults),
# for every graph not under CUDA graphs (which already take the host out). cpp_wrapper: the
# kernels are launched from C++ instead of one Python call each, which shortens host-bound steps
# and costs GPU-bound ones nothing; it costs compile time (each wrapper is compiled as C++, and
# the first on a machine builds a precompiled header). A host-bound graph's first build gets it, the
# guard's recompiles do not (GraphCompiler.cpp_wrapper_ok). Where torch tunes the C++ wrapper's
# kernels on the graph's real inputs (2.11), a backward, whose compile lacks them, is built on its
# first call (GraphCompiler.waits_for_first_call), which keeps the unit out of AOT Autograd's
# cache. Calibrated on the real-model suite, H100, torch 2.11 (bench/results/gpu-h100/
# real_gaps_cpp_wrapper*.log, real_gaps_backward_cpp.log, warm_start_no_probe.log).
COMPILE_FX_DEFAULTS: dict[str, dict[str, Any]] = {
    "cuda": {"cpp_wrapper": True},
}


def compile_fx_defaults(example_inputs: list, opts: Options, config_patches: dict) -> dict[str, Any]:
    """enn's defaults among compile_fx's own options for a Dynamo graph on the device of
    ``example_inputs``, less what options= sets and what the running Inductor lacks."""
    if config_patches.get("triton.cudagraphs", compat.inductor_config.triton.cudagraphs):
        return {}
    defaults = _unset(COMPILE_FX_DEFAULTS.get(_device_type(example_inputs), {}), opts)
    if defaults.get("cpp_wrapper"):
        _announce_cpp_wrapper()
    return defaults


@functools.cache
def _announce_cpp_wrapper() -> None:
    # once per process: the first compile with a C++ wrapper into a fresh Inductor cache is slow
    log.info("enn: CUDA graphs compile with Inductor's C++ wrapper (fewer host cycles per call; "
             "options={'cpp_wrapper': False} turns it off). A compile into an empty Inductor cache compiles "
             "each wrapper as C++ (seconds per graph), and the first on a machine builds its precompiled header.")


def _unset(defaults: dict[str, Any], opts: Options) -> dict[str, Any]:
    user_keys, known = dict(opts.inductor), compat.inductor_option_types()
    return {k: v for k, v in defaults.items() if k not in user_keys and k in known}


class GraphCompiler:
    from_cache = False  # (enn_backend.aot_cache.CachedGraph stands in for a cache-loaded graph)

    def __init__(self, gm: fx.GraphModule, example_inputs: list, kwargs: dict, *, opts: Options,
                 unit: str, config_patches: dict, fault_specs: tuple, state: KernelState | None = None,
                 reuse: blocks.ReuseTable | None = None) -> None:
        self.opts = opts
        self.reuse = reuse  # option blocks: artifacts of equal layers this graph may take (enn_backend.blocks)
        self.unit = unit
        self.kwargs = dict(kwargs)
        self.cudagraphs_ok = True  # False once the guard met a fault here: see build()
        self.phase = "backward" if kwargs.get("is_backward") else ("inference" if kwargs.get("is_inference") else "forward")
        self.eager_gm = copy_gm(gm)
        self.example_inputs = list(example_inputs)
        self.tracing_ctx = compat.current_tracing_context()
        self.config_patches = config_patches
        self.inductor_defaults = self._inductor_defaults(_device_type(example_inputs))
        self.fault_specs = fault_specs
        # `state`: replays and repros pass a fresh one, so faults recorded in this process
        # (which pin nodes at compile time) cannot hide the fault being reproduced.
        self.state: KernelState = state if state is not None else state_for(opts)
        self.record: GraphRecord = report().new_graph(unit, self.phase)
        # enn, not options=, decides this graph's cpp_wrapper (its default holds for the device)
        self.cpp_wrapper_decided = bool(self.inductor_defaults.get("cpp_wrapper"))
        if any(k in self.inductor_defaults for k in build_choice.LAUNCH_SAVING):
            # the launch-saving defaults only where the graph's host work pays for them (build_choice)
            self.inductor_defaults, self.record.build_choices = build_choice.for_graph(
                self.inductor_defaults, build_choice.estimate(self.eager_gm, inference=self.phase == "inference"),
                build_choice.cpp_wrapper_refusal(self.eager_gm))
        self.built_with_cpp_wrapper = False  # whether the last build has Inductor's C++ wrapper
        self.record.nodes = sum(1 for n in gm.graph.nodes if n.op == "call_function")
        self.compute_nodes = len(E.candidate_nodes(self.eager_gm))
        self.record.compute_nodes = self.compute_nodes
        # what the guard's fast path needs: inputs the graph writes into, random draws
        self.mutated = mutated_input_indices(self.eager_gm)
        # Inputs Inductor may reuse as scratch (a backward's donated saved tensors). enn compiles
        # guarded graphs without donation (compat.saved_tensors_kept); any that are donated
        # regardless are copied on checked calls like mutated inputs, so a re-run reads them intact.
        donated = compat.donated_inputs() if self.phase == "backward" else []
        self.donated = donated
        self.written = sorted(set(self.mutated) | set(donated))
        self.random = E.has_random_ops(self.eager_gm)
        # a training forward's outputs past its results are saved for the backward: their
        # integers are bookkeeping, which the value check compares by dtype and shape only
        results = compat.forward_results(self.tracing_ctx) if self.phase == "forward" else None
        outs = output_nodes(self.eager_gm)
        self.bookkeeping = frozenset(range(results, len(outs))) if results is not None else frozenset()
        # of those, an attention kernel's state (its log-sum-exp, RNG seeds) is laid out by the
        # kernel's own convention (a row with every key masked: 0, -inf or its bias, per kernel),
        # which the safe path it is judged against reproduces for the backward only: by layout
        self.kernel_state = frozenset(i for i in self.bookkeeping if _attention_state(outs[i]))
        self.pinned_names: frozenset[str] = self._pins_from_state() | self._known_miscompile_pins()
        self.fp32 = self.state.lookup(graph_key(self.eager_gm)) is not None
        self._fp32_gm: fx.GraphModule | None = None
        self._safe_gms: dict[frozenset[str], fx.GraphModule] = {}  # reference_pins -> safe_gm
        self._eager_runs: dict[int, tuple[fx.GraphModule, fx.GraphModule]] = {}
        self._pinned_in: dict[int, int] = {}  # id(artifact) -> enn::pinned nodes in it
        self.first_build = True  # False once built (or loaded from a cache): later builds are recompiles

    # ---------------------------------------------------------------- helpers
    def full(self) -> "GraphCompiler":
        """The compiler itself (a graph loaded from a cache has a stand-in whose ``full()``
        traces the graph: enn_backend.aot_cache.CachedGraph)."""
        return self

    def node(self, name: str) -> fx.Node:
        return next(n for n in self.eager_gm.graph.nodes if n.name == name)

    def pinned_now(self, extra: frozenset[str] = frozenset()) -> frozenset[str]:
        return self.pinned_names | extra

    def fp32_gm(self) -> fx.GraphModule:
        """The graph in fp32, the kernels enn chose on their safe paths (as pinning runs them): the
        fp32 retry's eager run and what ``build(fp32=True)`` compiles."""
        if self._fp32_gm is None:
            nodes = self._enn_nodes()
            self._fp32_gm = E.promote_to_fp32(E.pin_nodes(self.eager_gm, nodes) if nodes else self.eager_gm)
        return self._fp32_gm

    def fp64_gm(self, pins: frozenset[str] | None = None) -> fx.GraphModule:
        """The reference in fp64: the judge when compiled and eager values disagree (built on
        demand, not kept: a disagreement is rare and the copy is as large as the graph). It is
        :meth:`safe_gm` (of the graph built with ``pins``) computing in fp64: an enn op runs its
        reference path in fp64 (an FP8 GEMM: the same FP8 quantization, the products summed in
        fp64), and its attention kernels run enn's attention math in fp64 (their safe paths)."""
        return E.for_eager_runs(E.on_safe_paths(E.promote(self.safe_gm(pins), torch.float64)))

    def safe_gm(self, pins: frozenset[str] | None = None) -> fx.GraphModule:
        """The eager copy the guard re-runs, the reference of the graph built with ``pins``
        (default: as it is built now, :meth:`reference_pins`): the ATen graph as given, except
        the kernels enn chose -- its own ops (fused attention, GEMM epilogues, FP8 GEMMs) and the
        ATen attention kernels its passes emitted -- which run their registered reference path
        (``custom_ops.pinned.reference_path``: the safe path, unless the op registers a reference
        of its own), so a kernel enn chose is never the reference it is judged against.

        An op whose reference differs from its safe path (an FP8 GEMM: FP8 emulated, against
        the GEMM in its own dtype) runs its reference where the graph runs the op, and its safe
        path where the graph is built with it pinned: FP8's rounding is the op's result, not a
        fault, and a demoted FP8 GEMM is judged as the plain GEMM it now is. One copy is kept per
        set of such pinned ops. An op the user wrote (their own SDPA call) runs as ATen runs it:
        the reference is what eager would compute."""
        key = self.reference_pins(pins)
        if key not in self._safe_gms:
            nodes = self._enn_nodes()
            self._safe_gms[key] = (E.pin_nodes(self.eager_gm, nodes, reference=frozenset(nodes) - key)
                                   if nodes else self.eager_gm)
        return self._safe_gms[key]

    def reference_pins(self, pins: frozenset[str] | None = None) -> frozenset[str]:
        """Of the graph built with ``pins`` (default: the pins now; under fp32 every enn op, as
        ``fp32_gm`` runs them), the pinned ops whose reference path is not their safe path: what
        tells one reference (:meth:`safe_gm`) from another."""
        own = self._with_own_reference
        return own if self.fp32 else (self.pinned_names if pins is None else pins) & own

    @functools.cached_property
    def _with_own_reference(self) -> frozenset[str]:
        """The graph's enn ops whose reference path is not their safe path (the graph never changes)."""
        return frozenset(n.name for n in E.candidate_nodes(self.eager_gm)
                         if n.target.namespace == "enn" and op_name(n.target) in REFERENCE_PATHS)

    def _enn_nodes(self) -> list[str]:
        """The kernels enn chose: its own ops and the ATen kernels its passes emitted."""
        return [n.name for n in E.candidate_nodes(self.eager_gm) if n.target.namespace == "enn" or n.meta.get(EMITTED)]

    def runs_eagerly(self, gm: fx.GraphModule) -> fx.GraphModule:
        """``gm``, one of the graphs this compiler keeps (``safe_gm``, ``fp32_gm``), as the guard
        runs it eagerly (:func:`graph_edit.for_eager_runs`); made once, kept beside ``gm``."""
        if id(gm) not in self._eager_runs:
            self._eager_runs[id(gm)] = (gm, E.for_eager_runs(gm))  # holding gm keeps its id its own
        return self._eager_runs[id(gm)][1]

    def _state_pins(self, exclude: frozenset[str] = frozenset()) -> list[str]:
        """Nodes (not in ``exclude``) whose kernels kernel state records as faulty."""
        return [n.name for n in E.candidate_nodes(self.eager_gm) if n.name not in exclude
                and (e := self.state.lookup(node_key(n))) is not None and e.action == "pinned"]

    def _pins_from_state(self) -> frozenset[str]:
        pins = self._state_pins()
        if pins:
            reason = f"kernel state in {self.state.path or 'memory'} records faults for these kernels"
            action = f"compiled with {len(pins)} op(s) pinned to eager"
            strict = self.opts.guard.raises and self.state.path is not None
            if strict:  # strict would raise at their fault: say which pins hide it and how to lift them
                keys = sorted({node_key(self.node(n)) or n for n in pins})
                reason += f" in an earlier run, so guard='strict' does not check them (kernels {', '.join(keys)})"
                action += (f"; to check them again, clear the pin: {state_command(self.state, 'clear', keys[0])}"
                           if len(keys) == 1 else
                           f"; to check them again, clear the pins: {state_command(self.state, 'clear')} (or one of "
                           f"them: {state_command(self.state, 'clear', keys[0])})")
            report().add_fallback(FallbackKind.PINNED_FROM_STATE, node=",".join(pins), phase=self.phase,
                                  graph=self.record, reason=reason, action=action,
                                  level=logging.WARNING if strict else logging.INFO,
                                  sites=blame.sites(self.eager_gm, pins))
            announce_pins(self.state, len(pins))
        return frozenset(pins)

    def _known_miscompile_pins(self) -> frozenset[str]:
        """Nodes Inductor is known to compute wrong on this torch and device
        (compat.KNOWN_MISCOMPILES): each runs its eager kernel, one report line each."""
        found = compat.known_miscompiles(self.eager_gm)
        for name, reason in found:
            report().add_fallback(
                FallbackKind.KNOWN_MISCOMPILE, node=name, phase=self.phase, graph=self.record, reason=reason,
                action="pinned to its eager kernel (enn::pinned); the rest of the graph stays compiled",
                level=logging.INFO, sites=blame.sites(self.eager_gm, [name]))
        return frozenset(name for name, _ in found)

    def recorded_pins(self) -> frozenset[str]:
        """Nodes not pinned yet whose kernels kernel state now records as faulty (another
        graph, thread or process localized them since this graph was compiled)."""
        return frozenset(self._state_pins(exclude=self.pinned_names))

    def eager_callable(self) -> Callable[[list], Any]:
        """The graph run eagerly (ATen ops, no Inductor), inside an ``enn/eager`` range with option nvtx."""
        return nvtx.wrap(boxed_eager(E.for_eager_runs(self.eager_gm)), self.opts.nvtx, "eager", "graph", self.record.id)

    # ---------------------------------------------------------------- building
    def _inductor_defaults(self, device: str) -> dict[str, Any]:
        """enn's Inductor defaults for this graph: those by device, and the compile_fx defaults the
        backend set around compile_fx, less what options= sets and what the running Inductor lacks."""
        around = {k: v for k, v in COMPILE_FX_DEFAULTS.get(device, {}).items() if self.config_patches.get(k) == v}
        return _unset({**INDUCTOR_DEFAULTS.get(device, {}), **around}, self.opts)

    @property
    def cudagraphs(self) -> bool:
        """Whether Inductor wraps this graph's artifacts in CUDA graphs (``mode="reduce-overhead"``)."""
        box = self.kwargs.get("cudagraphs")
        return bool(box) if box is not None else bool(compat.inductor_config.triton.cudagraphs)

    @property
    def cpp_wrapper_ok(self) -> bool:
        """Whether enn's cpp_wrapper default may hold for a compile of this graph now: in its
        first build, not in the guard's recompiles after a fault (localization trials are thrown
        away, and a C++ wrapper adds a C++ compile to each). On a torch that tunes the C++
        wrapper's kernels on the graph's real inputs (compat.cpp_wrapper_tunes_on_real_inputs),
        only with them at hand: compile_fx holds a forward's, and a backward's come with its
        first call (:attr:`waits_for_first_call`)."""
        return self.first_build and (not compat.cpp_wrapper_tunes_on_real_inputs() or compat.real_inputs_at_hand())

    @property
    def waits_for_first_call(self) -> bool:
        """Whether the first build of this graph waits for its first call (:class:`CompileOnFirstCall`):
        a backward where enn's cpp_wrapper default holds, on a torch that tunes the C++ wrapper's
        kernels on the real inputs, which AOT Autograd's compile of a backward does not have. Its
        first call, in the same first backward pass, brings them. Inductor's tuning run on them
        must leave them as they are, so not where AOT Autograd donated some (guard="off"); nor
        where the tracing context lifts parameters (compat.real_inputs); nor under
        torch.distributed, where the ranks agree on a graph's build as it compiles (guard.ranks).

        The cost: AOT Autograd saves a unit to its cache as soon as its backward is compiled, and
        a build that waits has no FX graph cache key yet, so such a unit is not cached there (a
        warm start traces it again; Inductor's FX graph cache still holds both its graphs)."""
        return (self.first_build and self.phase == "backward" and bool(self.inductor_defaults.get("cpp_wrapper"))
                and compat.cpp_wrapper_tunes_on_real_inputs() and not compat.real_inputs_at_hand()
                and not compat.lifts_params(self.tracing_ctx) and not self.donated and not distributed())

    def build(self, extra_pins: frozenset[str] = frozenset(), fp32: bool | None = None, quiet: bool = False,
              deferred: bool = False) -> Callable[[list], Any]:
        """Compile the graph with the current pins (+ ``extra_pins``), down the ladder; a first
        build that :attr:`waits_for_first_call` compiles on its first call.

        ``quiet``: a localization trial, not recorded.

        Once the guard has met a fault in this graph (``cudagraphs_ok`` False), what it builds --
        trials and the artifact it adopts -- is not wrapped in CUDA graphs: Inductor's CUDA-graph
        trees tie each graph's memory to the step's forward / backward order, which trials run
        outside of (their replays would recycle outputs autograd still holds), and an artifact
        swapped in mid-step would not find its inputs in the tree's pool. A kernel computes the
        same values with or without the graph around it."""
        # a first build under option blocks may take an equal layer's artifact (enn_backend.blocks)
        # (``deferred``: the build a first call runs for :class:`CompileOnFirstCall`, already offered)
        shareable = (self.reuse is not None and self.first_build and not quiet and not extra_pins and fp32 is None
                     and not deferred)
        if shareable and (shared := blocks.shared_build(self.reuse, self)) is not None:
            return shared
        if self.waits_for_first_call:
            later = CompileOnFirstCall(lambda: self.build(extra_pins, fp32, quiet, deferred=True))
            if shareable:
                blocks.offer(self.reuse, self, later, 0)
            return later
        fp32 = self.fp32 if fp32 is None else fp32
        pins = self.pinned_now(extra_pins)
        base = self.fp32_gm() if fp32 else self.eager_gm
        gm = E.pin_nodes(base, pins, ranges=self.opts.nvtx)
        gm, planted = E.plant_faults(gm, self.fault_specs, self.phase, skip=pins)
        if self.fault_specs and not quiet:  # a spec that planted nothing in the unit is reported
            self.fault_specs.graph_built(self, planted, pins)
        t0 = time.perf_counter()
        compiled, path = self._compile_down(gm, lambda: E.pin_nodes(base, pins, ranges=self.opts.nvtx), planted)
        self.first_build = False
        # what the artifact really holds: nodes routed through enn::pinned (checked by tests)
        self._pinned_in[id(compiled)] = 0 if path == "eager" else sum(
            1 for n in gm.graph.nodes if n.target is torch.ops.enn.pinned.default)
        if not quiet:
            self.record.set(GraphCounter.PINNED_IN_GRAPH, self._pinned_in[id(compiled)])
            self.record.compile_time_s += time.perf_counter() - t0
            self.record.path = path
            self.record.compiled_nodes = 0 if path == "eager" else self.compute_nodes - len(pins)
            self._record_pins(pins)
        if shareable:
            blocks.offer(self.reuse, self, compiled, self._pinned_in[id(compiled)])
        return compiled

    def note_artifact(self, compiled: Any, pinned_in: int) -> None:
        """``compiled``, built for an equal graph, is this graph's first artifact (enn_backend.blocks)."""
        self._pinned_in[id(compiled)] = pinned_in
        self.record.set(GraphCounter.PINNED_IN_GRAPH, pinned_in)
        self._record_pins(self.pinned_names)

    def _compile_down(self, gm: fx.GraphModule, plain: Callable[[], fx.GraphModule],
                      planted: list[str]) -> tuple[Any, str]:
        """``gm`` compiled on the highest rung of the ladder that compiles, and that rung's path.
        ``plain()`` makes the graph of the rung without enn's rewrites (the pins, no planted faults)."""
        rungs: list[tuple[str, str, Callable[[], Any]]] = [("inductor", "", lambda: self._compile(gm, enn=True))]
        if self.inductor_defaults:
            rungs.append(("inductor", f"recompiled this graph without enn's Inductor defaults "
                                      f"({', '.join(f'{k}={v}' for k, v in self.inductor_defaults.items())})",
                          lambda: self._compile(gm, enn=True, defaults=False)))
        rungs += [("inductor-without-enn", "recompiled this graph without enn's rewrites and lowerings",
                   lambda: self._compile(plain(), enn=False)),
                  ("eager", "this graph runs eagerly (ATen ops, no Inductor)", self.eager_callable)]
        i = 0
        while True:
            path, _, build = rungs[i]
            try:
                return build(), path
            except Exception as exc:  # noqa: BLE001 - the ladder catches every compile failure
                if i == 0 and (self.opts.guard.raises or compat.is_dynamo_control_flow(exc)):
                    raise
                if i == len(rungs) - 1:
                    raise
                blamed = _blame_from_exception(exc, planted) if path == "inductor" else "<graph>"
                # a planted fault fails every rung that holds it: the next rung is the one without
                nxt = i + 1 if blamed == "<graph>" else [r[0] for r in rungs].index("inductor-without-enn")
                report().add_fallback(
                    FallbackKind.COMPILE_ERROR, node=blamed, phase="compile", graph=self.record,
                    reason=f"{type(exc).__name__}: {_first_line(exc)}", action=rungs[nxt][1],
                    sites=blame.sites(self.eager_gm, blamed.split(",")) if blamed != "<graph>" else [])
                i = nxt

    def _compile(self, gm: fx.GraphModule, *, enn: bool, defaults: bool = True) -> Any:
        """Inductor's compile of ``gm``: with enn's rewrites and lowerings (``enn``), and with
        enn's Inductor defaults for the device (``enn and defaults``); options= wins over both."""
        patches, kwargs = dict(self.config_patches), dict(self.kwargs)
        if enn and defaults:
            patches = {**self.inductor_defaults, **patches}
        cpp_wrapper = bool(kwargs.get("cpp_wrapper", patches.get("cpp_wrapper", False)))
        if self.cpp_wrapper_decided:
            # compile_fx hands its cpp_wrapper to the graph as an argument (a backward's: none): a
            # rung without enn's defaults goes without, and so does any graph cpp_wrapper_ok or
            # build_choice turns away
            cpp_wrapper = bool(enn and defaults and self.inductor_defaults.get("cpp_wrapper") and self.cpp_wrapper_ok)
            patches["cpp_wrapper"] = kwargs["cpp_wrapper"] = cpp_wrapper
        self.built_with_cpp_wrapper = cpp_wrapper
        if not enn:  # None, not absent: compile_fx's own patch around a first compile still holds enn's passes
            patches.update(post_grad_custom_post_pass=None, post_grad_custom_pre_pass=None)
        if self.cudagraphs and not self.cudagraphs_ok:
            kwargs = compat.without_cudagraphs(kwargs)
            patches["triton.cudagraphs"] = False
        # compile_lock: the guard recompiles at run time, possibly while another thread compiles
        with compat.compile_lock(), compat.tracing_context(self.tracing_ctx), compat.inductor_config.patch(patches), \
                compat.cpp_wrapper_config(cpp_wrapper), compat.device_builds_skip_vec_isa_probe(), \
                enn_lowerings(enabled=enn):
            return compat.compile_fx_inner(gm, self.example_inputs, **kwargs)

    def adopt(self, compiled: Any, pins: frozenset[str] = frozenset(), fp32: bool = False) -> None:
        """Make a recompiled artifact (with ``pins`` / fp32) the graph's fast path."""
        self.pinned_names = self.pinned_names | pins
        self.fp32 = self.fp32 or fp32
        self._record_pins(self.pinned_names)
        self.record.compiled_nodes = self.compute_nodes - len(self.pinned_names)
        self.record.bump(GraphCounter.RECOMPILES)
        self.record.set(GraphCounter.PINNED_IN_GRAPH, self._pinned_in.get(id(compiled), 0))

    def _record_pins(self, pins: frozenset[str]) -> None:
        self.record.pinned = sorted(pins)
        self.record.sites.update((s["node"], s) for s in blame.sites(self.eager_gm, pins))

    def write_repro(self, **info: Any) -> None:
        if not self.opts.repro:
            return
        try:
            path = write_repro(self, **info)
            if path:
                self.record.events.append({"repro": path})
                log.warning("enn: wrote repro script %s", path)
        except Exception as exc:  # noqa: BLE001 - a failed repro must not break the run
            log.warning("enn: could not write a repro script: %s: %s", type(exc).__name__, exc)


class CompileOnFirstCall:
    """A graph's build put off to its first call, whose inputs are then the real inputs Inductor
    tunes the C++ wrapper's kernels on (:func:`compat.real_inputs`); every call after it goes
    straight to the artifact (one Python call more: under 0.1 us). Called as a compiled graph
    is: one boxed list of inputs."""

    def __init__(self, build: Callable[[], Callable[[list], Any]]) -> None:
        self._build = build
        self.compiled: Callable[[list], Any] | None = None
        self._boxed_call = True  # an instance attribute: torch._dynamo.disable copies __dict__

    def __call__(self, args: list) -> Any:
        if self.compiled is None:
            with compat.compile_lock():  # one build, whichever thread calls first
                if self.compiled is None:
                    with compat.real_inputs(args):
                        self.compiled = self._build()
        return self.compiled(args)


def _device_type(example_inputs: list) -> str:
    """Where a graph's kernels run: the device type of its tensor inputs that are not on the CPU
    ("cuda", ...; a CUDA graph may take a CPU scalar), else "cpu"."""
    types = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
    return next((t for t in sorted(types) if t != "cpu"), "cpu")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""


def _blame_from_exception(exc: BaseException, planted: list[str]) -> str:
    text = str(exc)
    for name in planted:
        if name in text:
            return name
    if "enn injected" in text and planted:
        return ",".join(planted)
    return "<graph>"


def boxed_eager(gm: fx.GraphModule) -> Callable[[list], Any]:
    """``gm`` run eagerly as a compiled graph is called: one list of inputs, cleared on entry so
    that AOT Autograd's runtime can free them early (the boxed calling convention)."""
    def run(args: list) -> Any:
        inputs = list(args)
        args.clear()
        return list(gm(*inputs))

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _attention_state(n: object) -> bool:
    """``n`` is a result past the first of an attention kernel enn chose (enn::attention, or an
    SDPA kernel its pass emitted): the output is the first, the rest are the kernel's state."""
    if not (isinstance(n, fx.Node) and n.target is operator.getitem and n.args[1] != 0):
        return False
    kernel = n.args[0]
    return isinstance(kernel, fx.Node) and (bool(kernel.meta.get(EMITTED))
                                            or str(kernel.target).startswith("enn.attention"))
