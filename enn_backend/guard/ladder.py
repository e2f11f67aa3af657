"""The guard's fallback ladder: what :class:`~enn_backend.guard.runtime.GuardedGraph` asks
when a call raised, gave NaN/Inf, or (on a value check) gave values off eager's.

Re-run the eager reference on the call's inputs (every re-run on copies of what the call may
write: the caller's tensors are written once, by the result returned; calls.Call), then:
eager fails too -> the model's own error, raised; NaN/Inf at eager's places -> the model's
own values (or, in low precision, an fp32 retry that pins the graph to fp32); otherwise a
kernel fault -> localize the culprit node(s) with trial recompiles (:class:`Trials`), pin
them to eager, and hand back the new fast path.

The ladder decides; it does not change the fast path. Each entry point returns an
:class:`Outcome`: the call's result and, where the graph must change, a frozen
:class:`Decision` that the guarded graph applies in one place (``GuardedGraph.apply``) and,
under torch.distributed, sends as it is to the other ranks (:mod:`.ranks`). The ladder issues
no collective.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .. import blame
from ..fx_utils import ancestors, has_low_precision, result_nodes
from ..options import Options
from ..report import Count, FallbackKind, GraphCounter, GraphRecord, report
from . import graph_edit as E
from .calls import LADDER, Call, EnnGuardError, Run, no_autocast
from .kernel_entry import graph_key, node_key
from .localize import CONFIRM_RUNS, Localization, localize, suspects_from_traceback
from .screen import UNSCREENED, allowance, compiled_is_worse, divergent, diverging, nonfinite_inputs, nonfinite_outputs, outputs
from .seams import GraphFacts, GuardedCompiler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    """What the ladder decided about a faulty graph: the kind of fault, the ops it blames
    (``<graph>``: none in particular), the pins it adds, whether the graph now computes in fp32
    or runs eagerly, whether its value checks stop, the reason and action the report gives, and
    the user's source sites of the pinned ops. Applied in one place (``GuardedGraph.apply``),
    reported there once, and sent as it is to the other ranks of a distributed run."""

    kind: FallbackKind
    nodes: str
    pins: frozenset[str]
    fp32: bool
    eager: bool
    reason: str
    action: str
    value_checks_off: bool = False
    sites: tuple[dict, ...] = ()


@dataclass(frozen=True)
class Outcome:
    """What a call that went down the ladder returns, and what changes first.

    ``run``: the re-run whose result the call returns (its writes are committed into the
    caller's inputs); None: the compiled call's own ``outputs`` stand. ``decision`` and
    ``fast_path`` (None: the current one stays): applied before the result is returned.
    ``repro``: what to write a repro script of, after the decision took effect."""

    outputs: Any = None
    run: Run | None = None
    decision: Decision | None = None
    fast_path: Callable[[list], Any] | None = None
    repro: dict[str, Any] | None = field(default=None, hash=False)


class FaultLadder:
    """The slow path of one guarded graph. Its state is what it has learned about the graph:
    the graph itself (``compiler``: a cache-loaded graph's stand-in until the ladder first needs
    the graph, then the full :class:`~.seams.GuardedCompiler`), which infinities are the model's
    own (``allowed``, read by the fast path's screen too), whether the graph computes in low
    precision, and which kinds it has reported once."""

    def __init__(self, compiler: GraphFacts, record: GraphRecord, opts: Options) -> None:
        self.compiler: Any = compiler  # GraphFacts, then GuardedCompiler (full_compiler)
        self.record, self.opts, self.mode = record, opts, opts.guard
        self.random = compiler.random  # draws random numbers: values differ from eager's by design
        self.inputs_are_primals = compiler.phase != "backward"  # parameters, buffers, user inputs
        # output -> the infinities the reference makes there too (an attention kernel's saved
        # state: not screened, judged by its layout: screen.UNSCREENED)
        self.allowed: dict[int, str] = dict.fromkeys(compiler.kernel_state, UNSCREENED)
        self.low_precision: bool | None = None  # does the graph compute in fp16/bf16? (on the first comparison)
        self.reported: set[FallbackKind] = set()  # kinds reported once per graph, repeats counted

    # ------------------------------------------------------------------ re-runs
    def rerun(self, run: Callable[..., Any], call: Call, eager: bool) -> Run:
        """``run`` on the call's :meth:`~.calls.Call.rerun_inputs`, replaying its random draws:
        an eager graph (``eager``: no autocast, no autograd; any error it raises is returned) or a
        compiled artifact (boxed; an out-of-memory error is raised, not returned)."""
        inputs = call.rerun_inputs()
        try:
            with call.replaying():
                if eager:
                    with no_autocast(), torch.no_grad():
                        out = run(*inputs)
                else:
                    out = run(list(inputs))
        except Exception as exc:  # noqa: BLE001
            if not eager and isinstance(exc, torch.OutOfMemoryError):
                raise
            return Run(None, inputs, self.compiler.mutated, exc)
        return Run(list(outputs(out)), inputs, self.compiler.mutated, None)

    def reference(self, call: Call, pins: frozenset[str] | None = None) -> Run:
        """The eager reference (enn's eager copy of the graph) re-run on this call: that of the
        graph as built now, or built with ``pins`` (``GraphCompiler.safe_gm``)."""
        return self.rerun(self.compiler.runs_eagerly(self.compiler.safe_gm(pins)), call, eager=True)

    def results(self, out: Any, call: Call) -> list:
        """What the compiled call produced: its outputs, then the inputs it wrote, as it left them."""
        return list(outputs(out)) + [call.inputs[i] for i in self.compiler.mutated]

    def returning(self, run: Run, call: Call) -> list:
        """The call returns ``run``'s result: its writes go into the caller's inputs (once)."""
        call.commit(run.inputs, self.compiler.mutated)
        return run.outputs

    def full_compiler(self, what: str) -> GuardedCompiler:
        """Make sure the ladder has the graph: a graph loaded from AOTAutograd's cache has a
        stand-in compiler until now (enn_backend.aot_cache); this traces the graph."""
        try:
            self.compiler = self.compiler.full()
        except Exception as exc:  # noqa: BLE001
            report().add_fallback(FallbackKind.EXCEPTION, node="<graph>", phase=self.record.phase, graph=self.record,
                                  reason=f"{what}; this graph came from AOTAutograd's cache and tracing it again "
                                         f"failed ({type(exc).__name__}: {exc})",
                                  action="raised: the guard has no eager copy to re-run")
            raise EnnGuardError(f"enn: {what} in cache-loaded graph {self.record.id}, and its eager copy could not be "
                                f"rebuilt: {type(exc).__name__}: {exc}") from exc
        return self.compiler

    # ------------------------------------------------------------------ judging values
    def values_off(self, got: list, ref: list) -> list[int]:
        """Indices of the results off the reference's at their dtype's tolerance (a kernel's saved
        state compared by layout, bookkeeping integers by dtype and shape)."""
        if self.low_precision is None:
            self.low_precision = has_low_precision(self.compiler.eager_gm)
        return diverging(got, ref, self.low_precision, self.compiler.bookkeeping, self.compiler.kernel_state)

    def compiled_is_wrong(self, call: Call, got: list, ref: list, off: list[int], ref64: list | None = None) -> bool:
        """Judge a disagreement with an fp64 run of the reference (``ref64``, or run now).
        Without one (an op with no fp64 kernel) nobody is blamed: a tolerance alone cannot tell
        a wrong kernel from a reference that rounds differently."""
        if any(not (isinstance(got[i], torch.Tensor) and isinstance(ref[i], torch.Tensor))
               or got[i].dtype != ref[i].dtype or got[i].shape != ref[i].shape for i in off):
            return True  # a dtype or shape eager does not give is wrong whatever the values
        if ref64 is None:
            ref64 = self.fp64_reference(call)
        if ref64 is None:
            return False
        return any(compiled_is_worse(got[i], ref[i], ref64[i], bool(self.low_precision))
                   for i in off if i < len(ref64))

    def fp64_reference(self, call: Call, pins: frozenset[str] | None = None) -> list | None:
        """The fp64 run of the graph (as built now, or built with ``pins``) on this call: its
        results (outputs, then what it wrote into inputs, in their dtype); None where the graph
        has no fp64 run."""
        try:
            gm = self.compiler.fp64_gm(pins)
        except Exception as exc:  # noqa: BLE001 - building the fp64 graph failed
            run = Run(None, [], [], exc)
        else:
            run = self.rerun(gm, call, eager=True)
        if run.exc is not None:
            log.info("enn: graph %s: no fp64 run to judge a value difference (%s: %s); nobody blamed",
                     self.record.id, type(run.exc).__name__, run.exc)
            return None
        return run.results

    def _where(self, idx: list[int], ref: Run) -> str:
        """Results by name: an output, or an input the graph writes."""
        mutated = self.compiler.mutated
        return ", ".join(f"output {i}" if i < ref.n_out else f"input {mutated[i - ref.n_out]} (written in place)"
                         for i in idx[:6])

    # ------------------------------------------------------------------ entry points
    def check_values(self, out: Any, call: Call) -> Outcome:
        """A value check: this call's results -- outputs and writes into inputs -- against the reference's."""
        rec = self.record
        rec.bump(GraphCounter.VALUE_CHECKS)
        self.full_compiler("a value check")
        ref = self.reference(call)
        if ref.exc is not None:
            rec.bump(GraphCounter.VALUE_CHECKS_UNJUDGED)
            log.warning("enn: graph %s: the value check's eager run raised (%s: %s); compiled result kept",
                        rec.id, type(ref.exc).__name__, ref.exc)
            return Outcome(out)
        got = self.results(out, call)
        off = self.values_off(got, ref.results)
        if not off:
            return Outcome(out)
        with LADDER:
            if not self.compiled_is_wrong(call, got, ref.results, off):
                # the reference is the outlier (compiled is as close to fp64): nobody is blamed
                rec.bump(GraphCounter.VALUE_REFERENCE_OUTLIER)
                log.info("enn: graph %s: compiled results %s differ from eager's, but no further from fp64: kept",
                         rec.id, off)
                return Outcome(out)
            self._count_fault()
            what = f"values differ from eager's beyond their dtype's tolerance, none for integers ({self._where(off, ref)})"
            return self._kernel_fault("value", what, call, None, ref, off)

    def on_fault(self, kind: str, call: Call, exc: BaseException | None = None, bad: list | None = None,
                 out: Any = None) -> Outcome:
        """A checked call raised (``kind`` "exception") or gave NaN/Inf at ``bad`` ("nonfinite")."""
        rec, phase = self.record, self.record.phase
        bad = bad or []
        if exc is not None:
            what = f"{type(exc).__name__}: {exc}"
        else:
            n_out = len(outputs(out))
            writes = [f"input {self.compiler.mutated[i - n_out]}" for i in bad if i >= n_out]
            what = ("NaN/Inf in compiled output" if not writes
                    else f"NaN/Inf in compiled results: written in place into {', '.join(writes[:6])}")
        self.full_compiler(what)
        ref = self.reference(call)
        rec.bump(GraphCounter.EAGER_RERUNS)
        if ref.exc is not None:
            self._count_fault()
            report().add_fallback(FallbackKind.EXCEPTION, node="<graph>", phase=phase, graph=rec,
                                  reason=f"{what}; the eager graph raises too ({type(ref.exc).__name__}: {ref.exc})",
                                  action="raised the model's own error")
            raise ref.exc
        # Results whose NaN/Inf the reference makes at the same places, with the same finite
        # values elsewhere, are the model's own values; any other is the compiled code's fault.
        pattern, values = divergent(self.results(out, call), ref.results, bad) if exc is None else ([], [])
        if kind == "exception" or pattern:
            self._count_fault()
            return self._kernel_fault(kind, what, call, exc, ref, pattern or bad)
        return self._reference_nonfinite(what, call, out, ref, bad, values)

    def _count_fault(self) -> None:
        self.record.bump(GraphCounter.FAULTS)
        report().count(Count.GUARD_FAULTS)

    # ------------------------------------------------------------------ a kernel's fault
    def _kernel_fault(self, kind: str, what: str, call: Call, exc: BaseException | None, ref: Run,
                      bad: list) -> Outcome:
        """The compiled code is at fault: find the ops to pin (the known ones, none, a localized
        set, or the whole graph) and decide; the call returns the reference's result."""
        t0 = time.perf_counter()
        no_cudagraphs = self._leave_cudagraphs()
        trials = Trials(self, kind, call, ref)
        c = self.compiler
        known = c.recorded_pins()
        loc: Localization | None = None
        eager = values_off = localized = False
        if known and not trials.reproduces(known):
            # kernel state learned these kernels' fault since this graph was compiled; the graph
            # that localized them wrote the repro
            loc, new = Localization(pinned=sorted(known), trials=1), trials.adoptable(known)
            action = (f"pinned {len(known)} op(s) whose kernels kernel state records as faulty, after 1 trial "
                      f"recompile in {time.perf_counter() - t0:.1f}s")
        elif not trials.reproduces(frozenset()):
            # A fresh compile of the same graph, with the same pins, runs this call cleanly: the
            # fault was in the artifact or transient, and no node can be blamed on this evidence.
            new = trials.adoptable(frozenset())
            action = (f"recompiled the graph with no new pins in {time.perf_counter() - t0:.1f}s: the fault did not "
                      "reproduce on a fresh compile of the same graph, so no op is blamed")
        else:
            groups, first, why = self._suspects(kind, bad, exc)
            localized = True  # (a repro is written whatever the search found)
            loc = localize(groups, trials.still_faulty, self.opts.localize_budget, first, why)
            elapsed = time.perf_counter() - t0
            if loc is None and kind == "value":
                # no pin set brings the values to eager's: the difference is not a node's, so it
                # is not a kernel fault this check can prove; the compiled graph stays
                new, values_off = None, True
                action = ("kept the compiled graph: pinning every op did not bring its values to eager's, so no "
                          "kernel is at fault on this evidence; value checks of this graph are off from now on")
            elif loc is None:
                new, eager = c.eager_callable(), True
                action = "graph runs eagerly from now on (pinning every op did not remove the fault)"
            else:
                pins = frozenset(loc.pinned)
                new = trials.adoptable(pins)
                action = (f"pinned {len(loc.pinned)} op(s) to eager after {loc.trials + 1} trial recompile(s) "
                          f"in {elapsed:.1f}s; {c.compute_nodes - len(c.pinned_now(pins))} of {c.compute_nodes} ops "
                          "stay compiled")
                if loc.notes:
                    action += "; " + "; ".join(loc.notes)
                for name in loc.pinned:
                    key = node_key(c.node(name))
                    if key:
                        c.state.record(key, "pinned", exc, reason=what)
        nodes = ",".join(loc.pinned) if loc else "<graph>"
        sites = blame.sites(c.eager_gm, loc.pinned) if loc else []
        if self.mode.raises:
            raise EnnGuardError(
                f"enn (guard=strict): {kind} in compiled graph {self.record.id} (phase {self.record.phase}) at "
                f"{blame.where(nodes, sites)}: {what}. "
                f"Eager's result is right where the compiled one is not, so the compiled kernel is at fault. "
                f"Set guard='nonfinite' to fall back automatically."
            ) from exc
        decision = Decision(FallbackKind(kind), nodes, frozenset(loc.pinned) if loc else frozenset(), fp32=False,
                            eager=eager, reason=what, action=action + no_cudagraphs, value_checks_off=values_off,
                            sites=tuple(sites))
        repro = ({"kind": kind, "what": what, "inputs": call.inputs_before(), "snapshot": None, "nodes": nodes}
                 if localized else None)
        return Outcome(run=ref, decision=decision, fast_path=new, repro=repro)

    def _leave_cudagraphs(self) -> str:
        """What the guard builds for this graph from now on runs without CUDA graphs (see
        GraphCompiler.build); the note for the report ("" when the graph had none)."""
        if not (self.compiler.cudagraphs and self.compiler.cudagraphs_ok):
            return ""
        self.compiler.cudagraphs_ok = False
        return "; this graph runs without CUDA graphs from now on (mode reduce-overhead)"

    def _suspects(self, kind: str, bad: list | None,
                  exc: BaseException | None) -> tuple[list[list[str]], frozenset[str], str]:
        """Suspects grouped by op (enn's own ops first), the ones to try first, and why those.

        Tried first: for an exception, the ops of the kernel that raised (from the traceback);
        for NaN/Inf, the ops that only the bad outputs depend on.
        """
        gm = self.compiler.eager_gm
        cands = [n for n in E.candidate_nodes(gm) if n.name not in self.compiler.pinned_names]
        first: frozenset[str] = frozenset()
        why = ""
        if exc is not None:
            first, why = suspects_from_traceback(exc, gm), "that the raising kernel computes"
        elif bad:
            outs = result_nodes(gm)
            bad_cone = {n.name for n in ancestors(outs[i] for i in bad if i < len(outs))}
            good_cone = {n.name for n in ancestors(o for i, o in enumerate(outs) if i not in bad)}
            cands = [n for n in cands if n.name in bad_cone] or cands
            first = frozenset(n.name for n in cands if n.name not in good_cone)
            why = "that feed the bad outputs alone"
        groups: dict[str, list[str]] = {}
        for n in cands:
            groups.setdefault(E.node_op_name(n), []).append(n.name)
        ordered = sorted(groups.items(), key=lambda kv: not kv[0].startswith("enn."))
        return [g for _, g in ordered], first, why

    # ------------------------------------------------------------------ the model's own NaN/Inf
    def _reference_nonfinite(self, what: str, call: Call, out: Any, ref: Run, bad: list,
                             values: list[int]) -> Outcome:
        """The reference makes the compiled call's NaN/Inf too, at the same places."""
        rec, phase = self.record, self.record.phase
        if has_low_precision(self.compiler.eager_gm) and self.opts.precision:
            fp32 = self._fp32_retry(what, call, bad)
            if fp32 is not None:
                return fp32
        if self.mode.raises:
            raise EnnGuardError(
                f"enn (guard=strict): graph {rec.id} (phase {phase}) produces NaN/Inf in eager too: the model's own numerics, not a kernel fault."
            )
        rec.bump(GraphCounter.MODEL_NONFINITE)
        report().count(Count.GUARD_MODEL_NONFINITE)
        if values:
            # Same NaN/Inf places, other finite values: the reference is the result eager gives.
            self._report_once(FallbackKind.MODEL_NONFINITE, reason=(
                f"NaN/Inf in results {values} at the same places in compiled and eager code, but the other values "
                "differ beyond the tolerance of their dtype"), action="returned eager's result (repeats counted, not re-logged)")
            return Outcome(run=ref)
        stale = nonfinite_inputs(call.inputs_before()) if self.inputs_are_primals else []
        if stale:
            # Not this graph's numerics: what it was given already held NaN/Inf.
            self._report_once(FallbackKind.NONFINITE_INPUTS, reason=(
                f"graph inputs {stale[:8]} already hold NaN/Inf (parameters, buffers or activations), so eager's "
                "result is non-finite too; an earlier step made them: a kernel fault on a call the guard did not "
                "check (see any nonfinite_late entry) or the model's own divergence"),
                action="returned the compiled result, which equals eager's; nothing blamed (repeats counted, not re-logged)")
            return Outcome(out)
        # The model's own values: keep the compiled outputs (the backward reads what this forward
        # saved) and learn which infinities each output may hold on later calls. A NaN is never
        # learned: every check meets it again.
        for i in bad:
            learned = allowance(ref.results[i])
            if learned is not None:
                self.allowed[i] = learned
        log.debug("enn: graph %s: outputs %s hold NaN/Inf that eager makes too (the model's own values); compiled "
                  "outputs kept", rec.id, bad)
        return Outcome(out)

    def _fp32_retry(self, what: str, call: Call, bad: list) -> Outcome | None:
        """Low precision overflowed in eager too: the fp32 graph's result if it is finite there
        (and the graph is pinned to fp32 from now on), else None."""
        rec, phase = self.record, self.record.phase
        run = self.rerun(self.compiler.runs_eagerly(self.compiler.fp32_gm()), call, eager=True)
        if run.exc is not None or set(nonfinite_outputs(run.results)) & set(bad):
            return None
        if self.mode.raises:
            raise EnnGuardError(
                f"enn (guard=strict): graph {rec.id} (phase {phase}) overflows in low precision ({what}); fp32 is finite."
            )
        self._count_fault()
        no_cudagraphs = self._leave_cudagraphs()
        new = self.compiler.build(fp32=True)
        self.compiler.state.record(graph_key(self.compiler.eager_gm), "fp32", reason=what)
        rec.promotions.append({"node": "<graph>", "reason": "master-dtype retry: low precision overflowed"})
        decision = Decision(FallbackKind.PRECISION, "<graph>", frozenset(), fp32=True, eager=False,
                            reason=f"{what}; eager in low precision is non-finite too, fp32 is finite",
                            action="graph pinned to fp32 compute (outputs cast back); result taken from the fp32 run"
                                   + no_cudagraphs)
        return Outcome(run=run, decision=decision, fast_path=new)

    def _report_once(self, kind: FallbackKind, reason: str, action: str) -> None:
        if kind in self.reported:
            return
        self.reported.add(kind)
        report().add_fallback(kind, node="<none>", phase=self.record.phase, graph=self.record, reason=reason,
                              action=action)


class Trials:
    """The localization trials of one faulty call: recompiles of the graph with a pin set,
    each re-run on the call and judged against the reference ``ref``.

    A trial is judged by value against the reference, NaN/Inf included: a NaN can come out
    finite downstream (an attention kernel reads a row of NaN scores as fully masked and
    returns zeros), so "no NaN left" would adopt a pin set that leaves a faulty kernel in
    place. Values off eager's are arbitrated by fp64, as a value check's are: the compiled rest
    of a graph may round differently from eager, and that is no fault. A graph that draws
    random numbers differs from eager by design: there only NaN/Inf that eager does not make
    counts. A trial that raises is faulty. A pin set found fault-free keeps its artifact, which
    later confirming runs and the adopted fast path reuse.
    """

    def __init__(self, ladder: FaultLadder, kind: str, call: Call, ref: Run) -> None:
        self.ladder, self.kind, self.call, self.ref = ladder, kind, call, ref
        self.kept: dict[frozenset[str], Any] = {}  # pin set -> a clean trial's artifact
        # reference_pins -> the reference of a trial whose pins change it (an op whose reference
        # is not its safe path pinned: GraphCompiler.safe_gm); ``ref`` is that of the graph now
        self._refs: dict[frozenset[str], Run] = {ladder.compiler.reference_pins(): ref}
        self._fp64: dict[frozenset[str], list | None] = {}  # reference_pins -> its fp64 run, made when needed
        self._raised = False  # a trial's exception was logged (once)

    def is_wrong(self, got: list, pins: frozenset[str] = frozenset()) -> bool:
        """Are a trial's results (the graph built with ``pins`` more) wrong? Judged against the
        reference of the graph with those pins."""
        ladder, c = self.ladder, self.ladder.compiler
        key = c.reference_pins(c.pinned_now(pins))
        if key not in self._refs:
            self._refs[key] = ladder.reference(self.call, c.pinned_now(pins))
        if self._refs[key].exc is not None:
            return True  # that reference raised: only the graph's own reference is known right
        ref = self._refs[key].results
        if ladder.random:
            return self.kind != "exception" and bool(divergent(got, ref, nonfinite_outputs(got))[0])
        off = ladder.values_off(got, ref)
        if not off:
            return False
        if key not in self._fp64:
            self._fp64[key] = ladder.fp64_reference(self.call, c.pinned_now(pins))
        if self._fp64[key] is None:
            return True  # no fp64 run to say the difference is rounding: only eager's values are known right
        return ladder.compiled_is_wrong(self.call, got, ref, off, self._fp64[key])

    def still_faulty(self, pins: frozenset[str]) -> bool:
        """One trial: the graph with ``pins`` (a pin set found fault-free before re-runs its kept artifact)."""
        compiled = self.kept.pop(pins, None) or self.ladder.compiler.build(extra_pins=pins, quiet=True)
        run = self.ladder.rerun(compiled, self.call, eager=False)
        if run.exc is not None:
            if not self._raised:
                self._raised = True
                log.info("enn: graph %s: a localization trial with %d pin(s) raised (%s: %s); counted as faulty",
                         self.ladder.record.id, len(pins), type(run.exc).__name__, run.exc)
            return True
        faulty = self.is_wrong(run.outputs[:self.ref.n_out] + run.results[run.n_out:], pins)
        if not faulty:
            self.kept[pins] = compiled
        return faulty

    def reproduces(self, pins: frozenset[str]) -> bool:
        """Does the fault survive ``pins``? A flaky kernel passes some runs: a clean verdict needs
        every confirming run clean."""
        return any(self.still_faulty(pins) for _ in range(CONFIRM_RUNS))

    def adoptable(self, pins: frozenset[str]) -> Callable[[list], Any]:
        """The artifact to adopt for ``pins``: a clean trial's, else a fresh build."""
        kept = self.kept.get(pins)
        return kept if kept is not None else self.ladder.compiler.build(extra_pins=pins)
