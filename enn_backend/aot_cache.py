"""Warm starts from AOT Autograd's cache, with enn's guard and report intact.

On a warm start (a second process, or after ``torch.compiler.reset()``) AOT Autograd can
load a Dynamo graph's compiled forward and backward from its cache instead of tracing,
partitioning and running the joint passes again -- most of a warm compile. Such a hit
skips ``inner_compile``, where enn wraps each graph in its guard, so enn keeps, per
compiled graph, a small JSON *sidecar* next to Inductor's cache (keyed by the graph's FX
graph cache key; its format, and how it travels in ``torch.compiler.save_cache_artifacts()``:
:mod:`.aot_sidecar`) with what the guard and the report need:

- the report record (fusions, kernel choices, fp32 promotions) and the compile-time
  fallbacks (declined fusions ...) with the sites of their ops (module path, source line:
  ``enn_backend.blame``), replayed into the report and the log on a hit, which names them
  as the cold compile did;
- for the fast path: the inputs the graph writes into, and whether it draws random numbers;
- the graph's kernel-state keys, so a kernel that faulted since the entry was written
  refuses the hit (the graph is traced and compiled with that node pinned);
- for a Dynamo graph compiled for a module buffer's content (nanoGPT's causal ``tril``),
  a digest of that content, checked before each call as on a cold compile.

The guard of a cache-loaded graph needs the graph itself only when something goes wrong:
then :class:`WarmStart` traces the Dynamo graph once more (AOT cache off), checks that
each traced graph is the one the cache held (hash of its code), and the ladder proceeds
as after a cold compile.

Only clean graphs are offered to the cache: compiled by Inductor with enn's passes, no
pinned node, no fp32 fallback, no injected fault. Anything else -- a missing, corrupt or
foreign sidecar included -- refuses the hit, and AOT Autograd compiles as on a miss.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

from . import compat, compile_time
from .aot_sidecar import (FALLBACK_FIELDS, FORMAT, PHASES, RECORD_FIELDS, REPLAYED, VERSION, read_sidecar,
                          sidecar_path, write_sidecar)
from .cudagraph_cap import capped
from .debug.log import log_compiled_graph
from .fx_utils import content_digest
from .graph_compiler import GraphCompiler
from .guard import graph_edit as E
from .guard.kernel_entry import graph_key, node_key
from .guard.calls import distributed
from .guard.kernel_state import state_for
from .guard.runtime import GuardedGraph
from .options import Options
from .passes import current_module_state, module_state
from .report import Count, FallbackKind, GraphRecord, detached_report, report

log = logging.getLogger(__name__)

# ------------------------------------------------------------------ cold compiles
def offer(compiler: Any, compiled: Any, returned: Any) -> Any:
    """After a cold compile of one graph: if it is clean, write its sidecar and let AOT
    Autograd cache it (it saves an entry only if every graph ``returned`` to it carries
    an FX graph cache key). Returns what AOT Autograd gets: ``returned``, or a bare artifact
    kept out of its cache."""
    fx_key = getattr(compiled, "_fx_graph_cache_key", None)
    entry = _entry(compiler, fx_key) if fx_key else None
    if entry is not None:
        try:
            write_sidecar(fx_key, entry)
        except OSError as exc:
            log.warning("enn: could not write %s (%s); this graph is not offered to AOTAutograd's cache",
                        sidecar_path(fx_key), exc)
            entry = None
    if returned is compiled:
        # a bare artifact (guard="off") would be cached by its own key
        return returned if entry is not None else compat.keep_out_of_aot_cache(compiled)
    if entry is not None:
        returned._fx_graph_cache_key = fx_key
        returned._fx_graph_cache_debug_lines = getattr(compiled, "_fx_graph_cache_debug_lines", [])
        returned._time_taken_ns = getattr(compiled, "_time_taken_ns", 0)
    return returned


def _entry(compiler: Any, fx_key: str) -> dict[str, Any] | None:
    rec: GraphRecord = compiler.record
    if (compiler.opts.fault_inject or rec.path != "inductor" or compiler.pinned_names or compiler.fp32
            or rec.phase not in PHASES):
        return None
    own = [f for f in report().fallbacks if f.graph == rec.id]
    unit: dict[str, Any] | None = None
    if rec.phase != "backward":  # the unit's compile-time decisions travel with its first graph
        state = current_module_state()
        unit = {
            "fallbacks": [_fallback_dict(f) for f in report().fallbacks if f.graph == compiler.unit],
            "assumed": {str(i): content_digest(t) for i, t in (state.assumed.items() if state else ())},
        }
    if any(f.kind not in REPLAYED for f in own) or (unit and any(f["kind"] not in REPLAYED for f in unit["fallbacks"])):
        return None
    gm = compiler.eager_gm
    return {
        "format": FORMAT, "version": VERSION, "key": fx_key, "phase": rec.phase,
        "graph_key": graph_key(gm),
        "node_keys": sorted({k for n in E.candidate_nodes(gm) if (k := node_key(n))}),
        "mutated": list(compiler.mutated), "random": bool(compiler.random),
        "kernel_state": sorted(compiler.kernel_state),
        "record": {f: getattr(rec, f) for f in RECORD_FIELDS},
        "fallbacks": [_fallback_dict(f) for f in own],
        "unit": unit,
    }


def _fallback_dict(f: Any) -> dict[str, Any]:
    return {k: getattr(f, k) for k in FALLBACK_FIELDS}


# ------------------------------------------------------------------ warm starts
class WarmStart:
    """One enn compile of a Dynamo graph, ready to take an AOTAutograd cache hit.

    ``on_load`` is the hit handler (:func:`enn_backend.compat.aot_cache_hits`). After the
    compile, ``hit`` says whether the graphs came from the cache and ``assumed`` holds the
    buffer digests the cold compile relied on.
    """

    def __init__(self, gm: fx.GraphModule, example_inputs: list, opts: Options, unit: str,
                 config_patches: dict, decompositions: dict) -> None:
        self.gm, self.opts, self.unit = gm, opts, unit
        self.config_patches, self.decompositions = config_patches, decompositions
        self.tracing_ctx = compat.current_tracing_context()
        self.ambient = _Ambient()
        # parameters and buffers are held (the module holds them anyway); other inputs weakly,
        # so a warm start does not keep the first batch alive
        self._inputs = [_InputRef(x) for x in example_inputs]
        # how Dynamo fakified each input (static or symbolic sizes); Dynamo forgets it after the
        # compile, and AOT Autograd makes every size symbolic for an input it does not know
        known = getattr(self.tracing_ctx, "tensor_to_context", None)
        self._symbolic = [known.get(x) if known is not None and isinstance(x, torch.Tensor) else None
                          for x in example_inputs]
        self.hit = False
        self.metadata: Any = None  # AOT Autograd's metadata of the entry a hit loaded
        self.assumed: dict[int, str] = {}
        self._traced: dict[str, Any] | None = None

    # ------------------------------------------------------------ the hit
    def on_load(self, entry: Any, load: Callable[[], Any]) -> Any:
        fw_key, bw_key = compat.aot_entry_graph_keys(entry)
        metas = [self._accept(fw_key)] + ([self._accept(bw_key)] if entry.compiled_bw is not None else [])
        records: list[GraphRecord] = []

        def wrapper(meta: dict[str, Any]) -> Callable[[Any], Any]:
            return lambda compiled: self._wrap(compiled, meta, records)

        t0 = time.perf_counter()
        try:
            fn = compat.aot_entry_load(entry, load, wrapper(metas[0]), wrapper(metas[-1]))
        except BaseException:
            for rec in records:  # AOT Autograd compiles instead: the graphs are reported then
                report().drop(rec)
            raise
        records[0].compile_time_s = time.perf_counter() - t0
        self.hit = True
        self.metadata = getattr(entry, "runtime_metadata", None)  # what the unit writes (guard/dynamo_reference.py)
        unit = metas[0]["unit"]
        self.assumed = {int(i): d for i, d in unit["assumed"].items()}
        for f in unit["fallbacks"]:
            self._replay(f, self.unit)
        for rec, meta in zip(records, metas):
            for f in meta["fallbacks"]:
                self._replay(f, rec)
            log_compiled_graph(rec)
        report().count(Count.AOT_CACHE_HITS)
        log.debug("enn: %s loaded from AOTAutograd's cache in %.2fs", self.unit, records[0].compile_time_s)
        return fn

    @staticmethod
    def _replay(f: dict[str, str], graph: GraphRecord | str) -> None:
        report().add_fallback(FallbackKind(f["kind"]), node=f["node"], phase=f["phase"], graph=graph,
                              reason=f["reason"], action=f["action"], sites=f["sites"])

    def _accept(self, fx_key: str | None) -> dict[str, Any]:
        meta = read_sidecar(fx_key) if fx_key else None
        why = None
        if meta is None:
            why = "no enn sidecar for the cached graph"
        elif self.opts.fault_inject:
            why = "fault injection is on (faults are planted at compile time)"
        elif distributed():  # a hit is per rank (its disk, its options): the ranks' guards must compile alike
            why = "torch.distributed runs (see enn_backend.guard.ranks)"
        else:
            state = state_for(self.opts)
            entries = [state.lookup(k) for k in meta["node_keys"]]
            if any(e is not None and e.action == "pinned" for e in entries) or state.lookup(meta["graph_key"]):
                why = f"kernel state in {state.path} records faults for kernels in this graph"
        if why is not None:
            log.info("enn: not using AOTAutograd's cache entry for %s: %s", self.unit, why)
            report().count(Count.AOT_CACHE_REFUSED)
            raise compat.FXGraphCacheMiss(f"enn: {why}")
        return meta

    def _wrap(self, compiled: Any, meta: dict[str, Any], records: list[GraphRecord]) -> Any:
        rec = report().new_graph(self.unit, meta["phase"])
        records.append(rec)
        for f in RECORD_FIELDS:
            setattr(rec, f, copy.deepcopy(meta["record"][f]))
        rec.from_cache = True
        compile_time.graph_loaded(rec)  # the unit's (warm) compile time is this graph's
        facts = CachedGraph(self, meta, rec)
        runs = capped(compiled, facts, rec, self.opts)  # under CUDA graphs: enn_backend.cudagraph_cap
        if not self.opts.guard.guarded:
            return runs
        return compile_time.FirstCallClock.arm(GuardedGraph(facts, runs, rec))

    # ------------------------------------------------------------ the graphs, when the guard needs them
    def traced(self, phase: str, expected_key: str, record: GraphRecord) -> Any:
        """The GraphCompiler of this unit's ``phase`` graph, from a fresh trace (once per unit)."""
        if self._traced is None:
            self._traced = self._trace()
        compiler = self._traced.get(phase)
        if compiler is None:
            raise RuntimeError(f"tracing {self.unit} again gave no {phase} graph")
        if graph_key(compiler.eager_gm) != expected_key:
            raise RuntimeError(f"tracing {self.unit} again gave a {phase} graph that differs from the cached one")
        compiler.record = record
        return compiler

    def _trace(self) -> dict[str, Any]:
        """Trace in a thread of its own: the guard runs deep inside AOT Autograd's runtime
        wrappers and autograd, whose thread-local dispatch state (functionalization and
        autograd keys switched off, grad mode, autocast) a trace must not inherit."""
        done: dict[str, Any] = {}
        device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

        def work() -> None:
            try:
                if device is not None:
                    torch.cuda.set_device(device)
                done["traced"] = self._trace_here()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
                done["error"] = exc

        thread = threading.Thread(target=work, name=f"enn-trace-{self.unit}")
        thread.start()
        thread.join()
        if "error" in done:
            raise done["error"]
        return done["traced"]

    def _trace_here(self) -> dict[str, Any]:
        traced: dict[str, Any] = {}

        def capture(gm: fx.GraphModule, example_inputs: list, **kwargs: Any) -> Any:
            compiler = GraphCompiler(gm, example_inputs, kwargs, opts=self.opts, unit=self.unit,
                                     config_patches=self.config_patches, fault_specs=())
            compiler.first_build = False  # its first build came from the cache: any other is a recompile
            traced[compiler.phase] = compiler
            return compiler.eager_callable()  # never called: only the graphs are wanted

        t0 = time.perf_counter()
        inputs = [ref.get() for ref in self._inputs]
        for x, symbolic in zip(inputs, self._symbolic):
            if symbolic is not None:
                self.tracing_ctx.tensor_to_context[x] = symbolic
        with (detached_report(), self.ambient.restored(), compat.eager_backward_compile(),
              compat.tracing_context(self.tracing_ctx), module_state(inputs)):
            compat.compile_fx(compat.copy_dynamo_graph(self.gm), inputs, inner_compile=capture,
                              config_patches=self.config_patches, decompositions=self.decompositions)
        log.info("enn: traced %s again in %.2fs (its graphs came from AOTAutograd's cache; the guard needs them)",
                 self.unit, time.perf_counter() - t0)
        return traced


class CachedGraph:
    """Stands in for the GraphCompiler of a graph loaded from the cache.

    It carries what the guard's fast path reads; :meth:`full` gives the real GraphCompiler
    (from a fresh trace) when the guard's ladder needs the graph.
    """

    from_cache = True

    def __init__(self, warm: WarmStart, meta: dict[str, Any], record: GraphRecord) -> None:
        self.warm, self.record = warm, record
        self.opts = warm.opts
        self.phase = meta["phase"]
        self.graph_key = meta["graph_key"]
        self.mutated = list(meta["mutated"])
        self.written = self.mutated  # a guarded compile donates no buffers (compat.saved_tensors_kept)
        self.random = meta["random"]
        self.kernel_state = frozenset(meta.get("kernel_state", ()))

    def full(self) -> Any:
        return self.warm.traced(self.phase, self.graph_key, self.record)


class _InputRef:
    """An example input, held strongly (parameters, buffers, non-tensors) or weakly.

    A weakly held input that is gone is replaced by an uninitialized tensor of the same
    size, stride, dtype and device: tracing reads only those.
    """

    def __init__(self, x: Any) -> None:
        self.strong = None if _weak(x) else x
        self.ref = weakref.ref(x) if _weak(x) else None
        if self.ref is not None:
            self.spec = (tuple(x.shape), tuple(x.stride()), x.dtype, x.device, x.requires_grad)

    def get(self) -> Any:
        if self.ref is None:
            return self.strong
        x = self.ref()
        if x is not None:
            return x
        shape, stride, dtype, device, requires_grad = self.spec
        return torch.empty_strided(shape, stride, dtype=dtype, device=device).requires_grad_(requires_grad)


def _weak(x: Any) -> bool:
    return (isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter)
            and getattr(x, "_dynamo_static_input_type", None) is None)


class _Ambient:
    """The grad mode and autocast state a compile traced under (a re-trace restores them:
    it may run inside a backward call, where both differ)."""

    def __init__(self) -> None:
        self.grad = torch.is_grad_enabled()
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        self.autocast = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices}

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for device, (enabled, dtype) in self.autocast.items():
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            yield
