"""What enn did, per process: one record per compiled graph, every decision in it.

``enn_backend.report()`` returns the :class:`Report` of everything compiled since
``enn_backend.reset()``. Forward and backward graphs of one Dynamo graph are
separate records that share a ``unit`` id (``g0``, ``g1``, ...).

Fallbacks are typed (:class:`FallbackKind`), recorded here and logged once each:
nothing enn falls back on is silent.

An *op* is a node of a graph that runs a kernel: an ATen (or enn) op call, not a view, an
in-place op or a tuple item (``guard.graph_edit.candidate_nodes``); ops are what the guard
pins to eager and what every count the report and the logs show counts. A node the report
names is shown as its site (``enn_backend.blame``): module path and source line first, the
FX node name second; the JSON keeps the FX names and carries the sites beside them.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import secrets
import stat
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Sequence

from .blame import Site, describe, grouped, where

log = logging.getLogger(__name__)


class FallbackKind(str, enum.Enum):
    """Why enn left the fast path."""

    EXCEPTION = "exception"  # a compiled kernel raised at run time
    NONFINITE = "nonfinite"  # compiled output had NaN/Inf, eager did not
    VALUE = "value"  # compiled values differ from eager's beyond tolerance, and eager is closer to fp64
    NONFINITE_LATE = "nonfinite_late"  # a GPU steady-state screen found NaN/Inf after the call returned
    PRECISION = "precision"  # eager (low precision) non-finite too, fp32 retry finite
    MODEL_NONFINITE = "model_nonfinite"  # NaN/Inf where eager has them too, but other values differ: eager's result
    NONFINITE_INPUTS = "nonfinite_inputs"  # a graph's inputs already held NaN/Inf (an earlier call made them)
    COMPILE_ERROR = "compile_error"  # a pass, lowering or Inductor raised while compiling
    PASS_SKIPPED = "pass_skipped"  # an enn rewrite declined a match (e.g. unsupported dtype)
    KERNEL_CHOICE = "kernel_choice"  # a requested kernel is impossible here; another was used
    PRECISION_SKIPPED = "precision_skipped"  # a precision feature did not apply (e.g. bf16 params)
    PINNED_FROM_STATE = "pinned_from_state"  # nodes pinned at compile time from persisted state
    KNOWN_MISCOMPILE = "known_miscompile"  # a node Inductor is known to compute wrong (compat.KNOWN_MISCOMPILES), pinned
    DYNAMO_GRAPH = "dynamo_graph"  # compiled and eager copy agree, the graph Dynamo handed over (closer to fp64) differs: it runs
    BUFFER_CHANGED = "buffer_changed"  # a module buffer lost the content its graph was compiled for
    FAULT_NOT_PLANTED = "fault_not_planted"  # a fault_inject spec reached no graph of a compiled unit
    CUDAGRAPH_LIMIT = "cudagraph_limit"  # a graph's new input sizes past its cap of recorded CUDA graphs run uncaptured
    EXPORTING = "exporting"  # handed a graph while torch.export traced: it runs as captured, for export
    RECOMPILE_LIMIT = "recompile_limit"  # Dynamo compiled a frame for new sizes up to its recompile_limit: later sizes run eagerly


class GraphCounter(str, enum.Enum):
    """What a graph's record counts (``GraphRecord.counters``, keyed by the value)."""

    CALLS = "calls"  # calls of the graph
    CHECKS = "checks"  # calls whose results were screened
    VALUE_CHECKS = "value_checks"  # calls compared with the eager reference
    VALUE_REFERENCE_OUTLIER = "value_reference_outlier"  # a disagreement where eager was the outlier
    VALUE_CHECKS_UNJUDGED = "value_checks_unjudged"  # value checks whose eager reference raised (logged)
    EAGER_RERUNS = "eager_reruns"  # eager re-runs after a fault
    FAULTS = "faults"  # faults of the compiled code
    MODEL_NONFINITE = "model_nonfinite"  # NaN/Inf that eager makes too
    RECOMPILES = "recompiles"  # artifacts adopted after a fault
    PINNED_IN_GRAPH = "pinned_in_graph"  # enn::pinned nodes in the current artifact
    CUDAGRAPH_SHAPES = "cudagraph_shapes"  # distinct input sizes handed to CUDA-graph capture (enn_backend.cudagraph_cap)
    UNCAPTURED_SHAPES = "uncaptured_shapes"  # distinct input sizes past that cap, run without CUDA graphs
    UNCAPTURED_CALLS = "uncaptured_calls"  # calls run without CUDA graphs for being past that cap


class Count(str, enum.Enum):
    """What the report counts across graphs (``Report.counters``, keyed by the value; each
    fallback also counts as ``fallback.<kind>``)."""

    GUARD_FAULTS = "guard.faults"
    GUARD_MODEL_NONFINITE = "guard.model_nonfinite"
    DYNAMO_REFERENCE_OFF = "guard.dynamo_reference_off"  # a unit whose Dynamo-graph reference cannot run
    DYNAMO_REFERENCE_OUTLIER = "guard.dynamo_reference_outlier"  # the Dynamo graph was the outlier
    DYNAMO_REFERENCE_COPIES_ALL = "guard.dynamo_reference_copies_all"  # a check that copied every input and attribute
    DYNAMO_BACKWARD_CHECKS = "guard.dynamo_backward_checks"  # backwards compared with the Dynamo graph's
    DYNAMO_BACKWARD_UNJUDGED = "guard.dynamo_backward_unjudged"  # ... whose reference gradients could not be computed
    DYNAMO_BACKWARD_NO_ROOM = "guard.dynamo_backward_no_room"  # ... not compared: the reference's autograd run would not fit in device memory
    BLOCKS_COMPILED = "blocks.compiled"  # graphs of split units (option blocks) compiled by Inductor
    BLOCKS_REUSED = "blocks.reused"  # ... that took the artifact of an equal graph compiled before
    BLOCKS_NOT_SPLIT = "blocks.not_split"  # graphs compiled whole under option blocks (the log says why)
    SIZE_RECOMPILES = "dynamo.size_recompiles"  # Dynamo compiles of a frame for new sizes of static inputs (size_recompiles.py)
    FP8_NOT_LOWERED = "fp8.not_lowered"  # FP8 GEMMs compiled as an extern call of their eager kernel (lowerings/fp8.py)
    FP8_QUANTIZATIONS_SHARED = "fp8.quantizations_shared"  # an FP8 GEMM operand another GEMM of its graph had quantized
    FP8_SCALES_SHARED = "fp8.scales_shared"  # a tensorwise scale taken over elements another GEMM had scaled (lowerings/fp8.py)
    AOT_CACHE_HITS = "aot_cache.hits"
    AOT_CACHE_REFUSED = "aot_cache.refused"
    AOT_CACHE_CORRUPT_SIDECAR = "aot_cache.corrupt_sidecar"
    CACHE_ARTIFACTS_IGNORED = "cache_artifacts.ignored"


class CompilePhase(str, enum.Enum):
    """Where a graph's compile time went (``GraphRecord.compile_phases``, keyed by the value;
    enn_backend.compile_time says how each is measured)."""

    DYNAMO = "dynamo"  # Dynamo's trace of the frame, its guards and bytecode
    AOT_AUTOGRAD = "aot_autograd"  # AOT Autograd: metadata, joint trace, partition, lazy backward
    ENN_PASSES = "enn_passes"  # enn's graph passes (attention, epilogue, precision)
    ENN = "enn"  # enn's other compile work: copies and facts for the guard, kernel state, sidecars
    INDUCTOR = "inductor"  # Inductor's own passes, lowering, scheduling, code generation
    KERNEL_COMPILE = "kernel_compile"  # Triton / C++ kernel builds and loading the generated module
    CPP_WRAPPER = "cpp_wrapper"  # the C++ wrapper: its code, precompiled header and C++ build
    AUTOTUNE = "autotune"  # autotuning and benchmarking (templates, fusions, combo kernels, configs)
    GUARD = "guard"  # the guard's checks on the graph's first call (measured by enn)
    FIRST_RUN = "first_run"  # the compiled code's run in the first call (measured by enn)
    OTHER = "other"  # a compile event of torch's that no rule names


@dataclass
class Fallback:
    kind: str
    node: str
    phase: str
    reason: str
    action: str
    graph: str = ""
    time: float = field(default_factory=time.time)
    sites: list[Site] = field(default_factory=list)  # where the ops in `node` are in the model


@dataclass
class GraphRecord:
    """One compiled graph (a forward, backward or inference graph of a Dynamo graph)."""

    id: str
    unit: str
    phase: str  # forward | backward | inference
    nodes: int = 0  # FX call nodes of the graph (views and tuple items included)
    compute_nodes: int = 0  # ops (see the module's docstring)
    compiled_nodes: int = 0  # ops that run compiled (the rest are pinned to eager)
    compile_time_s: float = 0.0
    path: str = "inductor"  # inductor | inductor-without-enn | eager
    from_cache: bool = False  # loaded from AOTAutograd's cache (enn_backend.aot_cache), not traced
    fusions: dict[str, int] = field(default_factory=dict)
    kernel_choices: list[dict[str, Any]] = field(default_factory=list)
    promotions: list[dict[str, Any]] = field(default_factory=list)
    pinned: list[str] = field(default_factory=list)
    sites: dict[str, Site] = field(default_factory=dict)  # node name -> site, for the nodes named here
    events: list[dict[str, Any]] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    # seconds by CompilePhase value: the graph's compile and first call (enn_backend.compile_time)
    compile_phases: dict[str, float] = field(default_factory=dict)
    # enn's Inductor options for this graph as decided at compile time (option -> value), and why
    build_choices: dict[str, Any] = field(default_factory=dict)
    # the graph whose compiled artifact this one runs (option blocks: an equal layer's), else ""
    reused_from: str = ""

    def add_compile_time(self, phase: CompilePhase, seconds: float) -> None:
        self.compile_phases[phase.value] = self.compile_phases.get(phase.value, 0.0) + seconds

    def bump(self, counter: GraphCounter, n: int = 1) -> int:
        """Add ``n`` to ``counter``; its new value."""
        self.counters[counter.value] = value = self.counters.get(counter.value, 0) + n
        return value

    def set(self, counter: GraphCounter, value: int) -> None:
        self.counters[counter.value] = value


class Report:
    """Everything enn compiled and decided since the last :func:`reset`."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.graphs: list[GraphRecord] = []
        self.fallbacks: list[Fallback] = []
        self.counters: Counter[str] = Counter()
        # Dynamo graphs compiled by plain Inductor because enn was disabled, by what disabled it
        self.disabled: Counter[str] = Counter()
        self._units = 0
        # fusions found on a joint graph before AOT splits it into fwd/bwd
        self._pending_unit_fusions: dict[str, Counter[str]] = {}
        self._pending_unit_choices: dict[str, list[dict[str, Any]]] = {}
        self._pending_unit_promotions: dict[str, list[dict[str, Any]]] = {}

    # ----------------------------------------------------------- recording
    def new_unit(self) -> str:
        with self._lock:
            uid = f"g{self._units}"
            self._units += 1
            return uid

    def new_graph(self, unit: str, phase: str) -> GraphRecord:
        with self._lock:
            n = sum(1 for g in self.graphs if g.unit == unit and g.phase == phase)
            gid = f"{unit}/{phase}" + (f"#{n}" if n else "")
            rec = GraphRecord(id=gid, unit=unit, phase=phase)
            if phase in ("forward", "inference"):
                rec.fusions.update(self._pending_unit_fusions.pop(unit, {}))
                rec.kernel_choices.extend(self._pending_unit_choices.pop(unit, []))
                rec.promotions.extend(self._pending_unit_promotions.pop(unit, []))
            self.graphs.append(rec)
            return rec

    def drop(self, rec: GraphRecord) -> None:
        """Forget a record made for a graph that was not built after all."""
        with self._lock:
            self.graphs = [g for g in self.graphs if g is not rec]

    def adopt(self, rec: GraphRecord) -> None:
        """List a graph compiled before the last reset() again, once it does something new."""
        with self._lock:
            if all(g is not rec for g in self.graphs):
                self.graphs.append(rec)

    def unit_fusions(self, unit: str, kind: str) -> int:
        """How many fusions of ``kind`` the passes made in ``unit`` (its graphs' and those not
        yet given to a graph)."""
        with self._lock:
            return (sum(g.fusions.get(kind, 0) for g in self.graphs if g.unit == unit)
                    + self._pending_unit_fusions.get(unit, Counter()).get(kind, 0))

    def add_unit_fusion(self, unit: str, kind: str, count: int = 1) -> None:
        with self._lock:
            self._pending_unit_fusions.setdefault(unit, Counter())[kind] += count

    def add_unit_kernel_choice(self, unit: str, choice: dict[str, Any]) -> None:
        with self._lock:
            pending = self._pending_unit_choices.setdefault(unit, [])
            if choice not in pending:  # a site left unfused is met again by a later pass stage
                pending.append(choice)

    def add_unit_promotion(self, unit: str, promotion: dict[str, Any]) -> None:
        with self._lock:
            self._pending_unit_promotions.setdefault(unit, []).append(promotion)

    def add_fallback(
        self,
        kind: FallbackKind,
        *,
        node: str,
        phase: str,
        reason: str,
        action: str,
        graph: GraphRecord | str | None = None,
        level: int = logging.WARNING,
        sites: Sequence[Site] = (),
    ) -> Fallback:
        """Record a fallback. ``node``: the FX names of the ops it concerns, comma-separated
        (``<graph>``: the whole graph, ``<none>``: no op); ``sites``: where they are in the model."""
        gid = graph.id if isinstance(graph, GraphRecord) else (graph or "")
        fb = Fallback(kind=kind.value, node=node, phase=phase, reason=reason, action=action, graph=gid,
                      sites=list(sites))
        with self._lock:
            self.fallbacks.append(fb)
            self.counters[f"fallback.{kind.value}"] += 1
            if isinstance(graph, GraphRecord):
                self.adopt(graph)
                graph.events.append(asdict(fb))
                graph.sites.update((s["node"], s) for s in sites)
        log.log(level, "enn fallback %s", fallback_line(asdict(fb)))
        return fb

    def add_disabled(self, by: str) -> None:
        """Record a Dynamo graph compiled by plain Inductor because ``by`` disabled enn."""
        with self._lock:
            self.disabled[by] += 1

    def count(self, name: Count | str, n: int = 1) -> None:
        """Add ``n`` to a counter of the report (a :class:`Count`; a plain name for a test's own)."""
        with self._lock:
            self.counters[name.value if isinstance(name, Count) else name] += n

    # ----------------------------------------------------------- reading
    def fusions(self) -> dict[str, int]:
        total: Counter[str] = Counter()
        for g in self.graphs:
            total.update(g.fusions)
        for pending in self._pending_unit_fusions.values():
            total.update(pending)
        return dict(total)

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "format": "enn-report",
                "version": 1,
                "graphs": [asdict(g) for g in self.graphs],
                "fusions": self.fusions(),
                "fallbacks": [asdict(f) for f in self.fallbacks],
                "counters": dict(self.counters),
                "disabled": dict(self.disabled),
            }

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def save(self, path: str) -> None:
        """Write the report as JSON (atomically)."""
        atomic_write_text(path, self.to_json())

    def __str__(self) -> str:
        return format_report(self.to_dict())

    __repr__ = __str__


def fallback_line(f: dict[str, Any]) -> str:
    """One fallback as a line: kind, graph, the ops' sites, what happened -> what enn did."""
    graph, phase = f.get("graph", ""), f.get("phase", "")
    head = f"[{f['kind']}] {graph}" + ("" if graph.endswith("/" + phase) else f" ({phase})")
    at = where(f.get("node", ""), f.get("sites") or [])
    return f"{head}{' at ' + at if at else ''}: {f['reason']} -> {f['action']}"


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def _sites(g: dict[str, Any], names: list[str]) -> list[Site]:
    """The sites of nodes a graph record names (a name alone where the record has no site)."""
    known = g.get("sites") or {}
    return [known.get(n) or {"node": n} for n in names]


def format_report(data: dict[str, Any]) -> str:
    """The report as text: a table of the compiled graphs, then what enn decided in each
    (also used by `python -m enn_backend report FILE`)."""
    graphs, fallbacks = data.get("graphs", []), data.get("fallbacks", [])
    lines = [f"enn report: {len(graphs)} graph(s) compiled, {len(fallbacks)} fallback(s)"]
    lines += [f"enn was disabled by {by}: {n} Dynamo graph(s) compiled by plain Inductor "
              "(no enn passes, no guard; not listed here)" for by, n in sorted((data.get("disabled") or {}).items())]
    rows = [["graph", "path", "ops", "compiled", "pinned", "compile s", "fusions"]]
    for g in graphs:
        rows.append([g["id"], g.get("path", "") + (" (cached)" if g.get("from_cache") else "")
                     + (f" (= {g['reused_from']})" if g.get("reused_from") else ""),
                     str(g.get("compute_nodes", 0)), str(g.get("compiled_nodes", 0)), str(len(g.get("pinned", []))),
                     f"{g.get('compile_time_s', 0.0):.2f}",
                     ", ".join(f"{k} {v}" for k, v in sorted(g.get("fusions", {}).items())) or "-"])
    if graphs:
        table = _table(rows, right={2, 3, 4, 5})
        lines += [table[0], "-" * max(len(t) for t in table), *table[1:]]
    lines += compile_time_lines(graphs)
    fusions = data.get("fusions") or {}
    lines.append("fusions: " + (", ".join(f"{k} {v}" for k, v in sorted(fusions.items())) or "none"))
    sections = (
        ("pinned to eager (these ops run eagerly inside the compiled graph)",
         [(g, describe(s)) for g in graphs for s in grouped(_sites(g, g.get("pinned", [])))]),
        ("kernel choices", [(g, f"{describe([c.get('site') or {'node': c.get('node', '?')}])}: "
                                f"{c.get('choice', '?')} ({c.get('reason', '')})")
                            for g in graphs for c in g.get("kernel_choices", [])]),
        ("kept in fp32", [(g, f"{describe([p.get('site') or {'node': p.get('node', '?')}])}: {p.get('reason', '')}")
                          for g in graphs for p in g.get("promotions", [])]),
    )
    for title, items in sections:
        if items:
            width = max(len(g["id"]) for g, _ in items)
            lines.append(f"{title}:")
            lines += [f"  {g['id']:<{width}}  {text}" for g, text in items]
    lines.append(f"fallbacks: {len(fallbacks) or 'none'}")
    lines += [f"  {fallback_line(f)}" for f in fallbacks]
    return "\n".join(lines)


def compile_time_lines(graphs: list[dict[str, Any]]) -> list[str]:
    """Where each graph's compile time went, a column per phase (seconds; the phases no graph
    spent time in left out), then enn's per-graph build choices."""
    timed = [g for g in graphs if g.get("compile_phases")]
    lines: list[str] = []
    if timed:
        phases = [p.value for p in CompilePhase if any(g["compile_phases"].get(p.value, 0.0) >= 0.005 for g in timed)]
        rows = [["graph", "total s", *phases]]
        rows += [[g["id"], f"{sum(g['compile_phases'].values()):.2f}",
                  *(f"{g['compile_phases'].get(p, 0.0):.2f}" for p in phases)] for g in timed]
        table = _table(rows, right=set(range(1, len(rows[0]))))
        lines += ["compile time by phase (s; the first call included):", *(f"  {t}" for t in table)]
    chosen = [g for g in graphs if g.get("build_choices")]
    if chosen:
        lines.append("build choices:")
        width = max(len(g["id"]) for g in chosen)
        lines += [f"  {g['id']:<{width}}  {build_choice_text(g['build_choices'])}" for g in chosen]
    return lines


def build_choice_text(choices: dict[str, Any]) -> str:
    """One graph's build choices as text: the options, then why."""
    opts = ", ".join(f"{k}={v}" for k, v in sorted(choices.get("options", {}).items()))
    applied = "" if choices.get("applied", True) else "; the rule is not applied"
    return f"{opts or 'none'} ({choices.get('reason', '')}{applied})"


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old or the new file, never half of one."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # created as open() creates a file (0666 less the umask; mkstemp would make it 0600),
    # then given the mode of the file it replaces
    tmp = os.path.join(directory, f".tmp-{secrets.token_hex(8)}{os.path.basename(path)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w") as f:
            with contextlib.suppress(FileNotFoundError):
                os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


_REPORT = Report()
# Per thread: the throwaway report a re-trace records into (detached_report). Only the thread that
# re-traces records there; every other thread keeps recording into the process's report.
_DETACHED = threading.local()


def report() -> Report:
    """The report of everything enn compiled since :func:`reset` (inside :func:`detached_report`,
    in that thread only, the throwaway one)."""
    detached = getattr(_DETACHED, "report", None)
    return _REPORT if detached is None else detached


def reset() -> None:
    """Forget the report (compiled code and kernel state are not touched)."""
    _REPORT.__init__()


@contextlib.contextmanager
def detached_report() -> Iterator[Report]:
    """Record into a throwaway report, in this thread, for the length of the block.

    For work that repeats a compile the report already describes (re-tracing a graph
    loaded from a cache): its passes must not count their fusions and fallbacks twice.
    Other threads meanwhile record into the process's report as always.
    """
    saved = getattr(_DETACHED, "report", None)
    _DETACHED.report = Report()
    try:
        yield _DETACHED.report
    finally:
        _DETACHED.report = saved
