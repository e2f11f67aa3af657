"""GuardedGraph: the callable that wraps each graph Inductor compiled for enn.

AOT Autograd calls it with a boxed list of inputs (forward: primals; backward: saved tensors +
tangents), and it returns the graph's outputs. On the fast path it adds one NaN/Inf screen of
the outputs and of what it wrote into its inputs (one host sync) and, for graphs that write into
their inputs, a copy of those inputs so that no re-run writes into the caller's tensors
(:class:`.calls.Call`).

Three parts, each with its own state:

- **the schedule** (:class:`.schedule.Schedule`, pure): what a call does -- bare, screened,
  screened late, value-checked -- from its call counts;
- **the fast path** (here): the artifact that runs, the call counts, the late screen in flight;
- **the fallback ladder** (:class:`.ladder.FaultLadder`): what a faulty or checked call
  returns, and the :class:`.ladder.Decision` that changes the fast path. A decision takes effect
  in one place, :meth:`GuardedGraph.apply`, whether this graph's ladder made it or, under
  torch.distributed, another rank's (:mod:`.ranks`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable

import torch

from .. import compat, nvtx
from ..report import FallbackKind, GraphCounter, GraphRecord, report
from . import ranks
from .calls import LADDER, Call, distributed
from .ladder import Decision, FaultLadder, Outcome
from .schedule import Action, Schedule
from .seams import GraphFacts
from .screen import LateScreen, nonfinite_outputs, outputs, single_cuda_device

log = logging.getLogger(__name__)

_OK, _NONFINITE, _EXCEPTION = 0, 1, 2


class GuardedGraph:
    """One compiled graph behind the guard: the fast path, its schedule, and its ladder."""

    def __init__(self, compiler: GraphFacts, compiled: Callable[[list], Any], record: GraphRecord) -> None:
        self.facts = compiler  # what the fast path reads of the graph (guard.seams.GraphFacts)
        self.ladder = FaultLadder(compiler, record, compiler.opts)
        self.compiled = compiled  # the fast path: the artifact a call runs
        self.record = record
        self.counters = record.counters  # the report's counters for this graph, updated per call
        opts, mode = compiler.opts, compiler.opts.guard
        # value checks: every checked call in "values" mode, else the first call of each
        # artifact and every `guard_values`-th call; never where random draws differ by design;
        # never under torch.distributed: a rank's value check would not be agreed on (see .ranks)
        values = mode.checks_outputs and not compiler.random and not distributed()
        self.schedule = Schedule(warmup=opts.guard_warmup, every=opts.guard_every,
                                 value_every=opts.guard_values if values else 0,
                                 values_always=mode.checks_every_value and values,
                                 checks_outputs=mode.checks_outputs, keep_inputs=mode.keeps_inputs)
        # a graph loaded from AOTAutograd's cache was checked when it was compiled; checking its
        # first call again would trace it again, which a warm start exists to avoid
        self.first_call_values = not compiler.from_cache
        self.allowed = self.ladder.allowed  # infinities the ladder found to be the model's own (the screen skips them)
        self.calls = 0
        self.built_at = 0  # the call count when the current artifact was built (see since_build)
        # The first call number that is not a bare call of the compiled code -- a check, the
        # warm-up, a late screen to read -- decided by the slow path (_scheduled) for the calls
        # up to it, so that every call before it costs one comparison. 0: the next call decides.
        self.due = 0
        self.generation = 0  # bumped whenever the fast path changes (see LADDER)
        self.decision: Decision | None = None  # the last decision applied
        # steady-state samples of a graph whose outputs live on one GPU are screened there and
        # read back later (a host sync would stall the launch queue: +3-7% on a short step)
        self.screen_later: bool | None = None  # decided by the first synchronously checked call
        self._late: LateScreen | None = None
        self._late_host: torch.Tensor | None = None
        # times the first call by phase, then unset (enn_backend.compile_time.FirstCallClock)
        self.first_call_clock: Any = None
        self._boxed_call = True  # an instance attribute: torch._dynamo.disable copies __dict__

    @property
    def compiler(self) -> Any:
        """The graph's compiler as the ladder has it (a cache-loaded graph's stand-in until the
        ladder first needs the graph)."""
        return self.ladder.compiler

    # --------------------------------------------------------------- decisions
    def apply(self, decision: Decision, new: Callable[[list], Any] | None) -> None:
        """The one place a decision takes effect: reported once; the graph's pins, fp32, path and
        schedule updated; ``new`` (None: the current artifact) made the fast path."""
        rec = self.record
        report().add_fallback(decision.kind, node=decision.nodes, phase=rec.phase, graph=rec,
                              reason=decision.reason, action=decision.action, sites=list(decision.sites))
        if decision.eager:
            rec.path = "eager"
        if decision.value_checks_off:
            self.schedule = replace(self.schedule, value_every=0, values_always=False)
        new = self.compiled if new is None else new
        self.compiler.adopt(new, pins=decision.pins, fp32=decision.fp32)
        if decision.fp32:  # with option nvtx, a graph recomputed in fp32 shows as an enn/fp32 range
            new = nvtx.wrap(new, self.facts.opts.nvtx, "fp32", "graph", rec.id)
        # The artifact first compiled is no longer the graph's: it must not reach AOTAutograd's
        # cache (enn_backend.aot_cache) if that saves it later.
        self.__dict__.pop("_fx_graph_cache_key", None)
        self.compiled, self.since_build = new, 0
        self.generation += 1
        self.first_call_values = True
        self.decision = decision

    def settle(self, outcome: Outcome, call: Call) -> Any:
        """What a call that went down the ladder returns: the decision applied first, then the
        result (a re-run's writes committed into the caller's inputs), then any repro written."""
        if outcome.decision is not None:
            self.apply(outcome.decision, outcome.fast_path)
        result = outcome.outputs if outcome.run is None else self.ladder.returning(outcome.run, call)
        if outcome.repro is not None:
            self.compiler.write_repro(**outcome.repro)
        return result

    # --------------------------------------------------------------- fast path
    @property
    def since_build(self) -> int:
        """Calls since the current artifact was built (or the warm-up was restarted)."""
        return self.calls - self.built_at

    @since_build.setter
    def since_build(self, n: int) -> None:
        self.built_at = self.calls - n
        self.due = 0  # the schedule changed: the next call decides again

    def __call__(self, args: list) -> Any:
        # Runs on every call of every compiled graph. A call before `due` is a bare call of the
        # compiled code: on a small CPU graph (tens of microseconds) each Python operation here
        # is a visible share of the call, so what the schedule decides is decided in _scheduled.
        self.calls += 1
        self.counters["calls"] = self.calls  # GraphCounter.CALLS (every call: the plain key)
        if self.calls >= self.due:
            return self._scheduled(args)
        # An unchecked call holds no reference to the inputs: the compiled code's `args.clear()`
        # frees each one when it is dead (holding them kept a backward graph's saved activations
        # alive to its end).
        generation = self.generation
        try:
            return self.compiled(args)
        except torch.OutOfMemoryError:
            raise  # not a kernel fault: eager would need the same memory
        except Exception as e:  # noqa: BLE001 - any kernel failure enters the ladder
            exc = e
        self.due = 0
        # outside the `except`: an error the ladder raises is not chained to the kernel's
        return self._after(None, exc, Call(None, None, None, generation), False)

    def _scheduled(self, args: list) -> Any:
        """A call at or past ``due`` (the first call timed by phase where a clock is armed)."""
        if self.first_call_clock is not None:
            clock, self.first_call_clock = self.first_call_clock, None
            return clock.time(self, self._act, args)
        return self._act(args)

    def _act(self, args: list) -> Any:
        """What a call at or past ``due`` does (guard.schedule), and the next ``due``."""
        if self._late is not None:
            self._read_late()
        action = self.schedule.action(self.calls, self.since_build, self.first_call_values,
                                      bool(self.screen_later) and not distributed())
        # (a ladder below, or a late screen, sets it again)
        self.due = self.schedule.next_due(self.calls, self.since_build, self._late is not None)
        check, values, later = action.checks, action is Action.VALUES, action is Action.SCREEN_LATER
        generation = self.generation
        if not action.holds_inputs:
            out, exc = None, None
            written = [args[i] for i in self.facts.mutated] if later else []  # screened with the outputs
            try:
                out = self.compiled(args)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001
                exc = e
            if exc is None:
                if later:
                    self._screen_later(list(outputs(out)) + written if written else out)
                return out
            self.due = 0
            return self._after(out, exc, Call(None, None, None, generation), False)
        if check:
            self.record.bump(GraphCounter.CHECKS)
        # Keep our own references to the inputs on the calls the ladder may need them
        # (checked calls; every call in "exceptions" mode, which schedules no checks), and a
        # copy of those the compiled code may write into, so a re-run starts from what this
        # call was given (calls.Call: re-runs never write into the caller's tensors).
        call = Call.held(args, self.facts.written, self.facts.random, generation)  # the compiled code may clear `args`
        out, exc = None, None
        try:
            out = self.compiled(args)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001
            exc = e
        if exc is None and not check and not distributed():
            return out
        return self._after(out, exc, call, check, values)

    def _after(self, out: Any, exc: BaseException | None, call: Call, check: bool, values: bool = False) -> Any:
        """The rest of a call that raised, is checked, or (holding its inputs) runs under torch.distributed."""
        # the screen covers the inputs the graph writes (parameters, buffers, optimizer state) too
        bad = nonfinite_outputs(self.ladder.results(out, call), self.allowed) if (exc is None and check) else []
        if values and exc is None and not bad and not distributed():
            return self.settle(self.ladder.check_values(out, call), call)
        if exc is None and check and self.screen_later is None:  # decided once: a graph's outputs stay where they are
            self.screen_later = compat.is_cuda_available() and single_cuda_device(out)
        level = _EXCEPTION if exc is not None else (_NONFINITE if bad else _OK)
        if call.inputs is not None and distributed():  # an agreed call: every rank meets it (see .ranks)
            levels = ranks.gather_levels(level)
            return ranks.across_ranks(self, levels, call, exc, bad, out) if any(levels) else out
        if level == _OK:
            return out
        if call.inputs is None:
            # An unchecked call raised. Its inputs are gone -- the compiled code frees each one
            # when it is dead, and holding them on every call would keep a backward graph's
            # saved activations alive to its end (measured: +60% peak on an MLP) -- so the
            # ladder cannot re-run it. Recorded, re-raised; every call is checked from now on,
            # except under torch.distributed, where only a decision all ranks share changes the
            # check schedule (this call was this rank's alone: see .ranks).
            alone = distributed()
            if not alone:
                self.since_build = 0
            then = (" on this rank alone (the call was not agreed on by the ranks)" if alone
                    else "; the following calls are checked (warm-up restarts)")
            report().add_fallback(FallbackKind.EXCEPTION, node="<graph>", phase=self.record.phase, graph=self.record,
                                  reason=f"{type(exc).__name__}: {exc} on a call the guard did not check "
                                         "(inputs already freed)", action="raised to the caller" + then)
            raise exc
        kind = "exception" if level == _EXCEPTION else "nonfinite"
        with LADDER:
            if call.generation != self.generation:
                # another thread's ladder changed the fast path while this call ran on the old one
                retried = self._retry(call, check)
                if retried is not None:
                    return retried
            return self.settle(self.ladder.on_fault(kind, call, exc=exc, bad=bad, out=out), call)

    def _retry(self, call: Call, check: bool) -> Any:
        """This call again on the current fast path; None if it faults there too."""
        run = self.ladder.rerun(self.compiled, call, eager=False)
        if run.exc is not None or (check and nonfinite_outputs(run.results, self.allowed)):
            return None
        return self.ladder.returning(run, call)

    def _screen_later(self, out: Any) -> None:
        self.record.bump(GraphCounter.CHECKS)
        if self._late is not None:  # (a screen still in flight, with guard_every=1: wait for it)
            self._read_late(wait=True)
        if self._late_host is None:
            self._late_host = torch.empty((), dtype=torch.bool, pin_memory=True)
        self._late = LateScreen(out, self.allowed, self._late_host, self.calls)
        self.due = self.calls + 1  # the next call reads it

    def _read_late(self, wait: bool = False) -> None:
        late = self._late
        found = late.result(wait) if late is not None else None
        if found is None:
            return
        self._late = None
        if not found:
            return
        # That call's outputs are with the caller already: say so, and check every call again,
        # so that the next call meets the fault (a kernel fault repeats) on the synchronous path
        # with its inputs held: the ladder re-runs it eagerly and pins the culprit there.
        self.since_build = 0
        report().add_fallback(
            FallbackKind.NONFINITE_LATE, node="<graph>", phase=self.record.phase, graph=self.record,
            reason=f"NaN/Inf in the outputs of call {late.call}, found by the "
                   "steady-state screen, which is read back without a device sync, after that call returned",
            action="that call's outputs were returned as computed; every call is checked again (warm-up restarts)")
