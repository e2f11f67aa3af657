"""Where a graph's compile time goes: per graph, per phase (``GraphRecord.compile_phases``).

The times are torch's own: the compile events torch times (``dynamo_timed``: Dynamo, AOT
Autograd, Inductor, C++ and Triton builds, autotuning), read as they end
(:class:`enn_backend.compat.compile_events.EventTape`), plus the events enn emits for its own
work, which torch's traces show beside them (``enn_backend.compile_unit``,
``enn_backend.compile_graph``, ``enn_backend.passes``). enn measures itself only where torch
times nothing: a graph's first call, split into the guard's checks and the run of the compiled
code.

The rules:

- A compile is one outermost event of a thread (Dynamo's frame compile; a lazily compiled
  backward's ``entire_backward_compile``). Each event's own time -- its span less its
  children's -- counts once, toward the phase :func:`compat.compile_events.phase_of_event`
  names, so a compile's phases add up to its span.
- It counts toward the graph whose enn compile (``enn_backend.compile_graph``) holds the event;
  the rest of a unit's backend call (``enn_backend.compile_unit``: AOT Autograd's joint trace)
  toward that unit's first graph; the rest of the compile (Dynamo's trace) toward the first graph
  enn compiled in it: a unit's forward (or inference) graph, a lazy backward's own. (One compile
  holds several units where option ``blocks`` splits its graph: each layer's trace is its own.)
- A graph's first call: time spent in the compiled code is ``first_run``, the rest of the call
  ``guard`` (the guard's first-call checks), each less torch's events timed inside it (Triton
  autotuning at the first run), which count by their phase.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from . import compat
from .compat.compile_events import EVENT_TAPE, Event, phase_of_event
from .debug.log import log_compile_time
from .guard.runtime import GuardedGraph
from .report import CompilePhase, GraphRecord

EVENT_UNIT = "enn_backend.compile_unit"  # enn's backend call for one Dynamo graph
EVENT_GRAPH = "enn_backend.compile_graph"  # enn's compile of one AOT graph (inner_compile)
EVENT_PASSES = "enn_backend.passes"  # one stage of enn's passes (passes/manager.py emits it)


@dataclass
class _Window:
    """A span of enn's work in this thread: a unit's backend call (``record`` None) or one
    graph's compile."""

    start_ns: int
    unit: str
    record: GraphRecord | None = None
    cpp_wrapper: bool = False
    end_ns: int | None = None
    loaded: list[GraphRecord] = field(default_factory=list)  # a unit's graphs loaded from a cache

    def holds(self, e: Event) -> bool:
        return self.start_ns <= e.start_ns and (self.end_ns is None or e.end_ns <= self.end_ns)


@dataclass
class _FirstCall:
    record: GraphRecord
    in_run: bool = False
    events_in_run_s: float = 0.0
    events_outside_s: float = 0.0


@dataclass
class _Thread:
    events: list[Event] = field(default_factory=list)
    windows: list[_Window] = field(default_factory=list)
    first_calls: list[_FirstCall] = field(default_factory=list)
    stop: Callable[[], None] | None = None


_LOCAL = threading.local()


def _state() -> _Thread:
    st = getattr(_LOCAL, "state", None)
    if st is None:
        st = _LOCAL.state = _Thread()
    return st


def _listen(st: _Thread) -> None:
    if st.stop is None:
        st.stop = EVENT_TAPE.listen(_on_event)


def _maybe_stop(st: _Thread) -> None:
    if st.stop is not None and not st.windows and not st.first_calls:
        st.stop()
        st.stop = None
        st.events.clear()


# ------------------------------------------------------------------ enn's spans
@contextlib.contextmanager
def unit_compile(unit: str) -> Iterator[None]:
    """enn's backend call for ``unit``: a torch compile event, and the span whose compile (the
    Dynamo frame around it) the unit's first graph is charged with."""
    st = _state()
    _listen(st)
    window = _Window(time.time_ns(), unit)
    st.windows.append(window)
    try:
        with compat.compile_event(EVENT_UNIT):
            yield
    finally:
        window.end_ns = time.time_ns()


@contextlib.contextmanager
def graph_compile(unit: str, cpp_wrapper: Callable[[], bool]) -> Iterator[Callable[[GraphRecord], None]]:
    """enn's compile of one graph of ``unit``; call the yielded function with the graph's record
    once it exists. ``cpp_wrapper()``: whether the graph was built with the C++ wrapper."""
    st = _state()
    _listen(st)
    window = _Window(time.time_ns(), unit)
    st.windows.append(window)

    def bind(rec: GraphRecord) -> None:
        window.record = rec

    try:
        with compat.compile_event(EVENT_GRAPH):
            yield bind
    finally:
        window.end_ns = time.time_ns()
        window.cpp_wrapper = bool(cpp_wrapper())
        if window.record is None:
            st.windows.remove(window)


def graph_loaded(rec: GraphRecord) -> None:
    """A graph of the unit enn is compiling in this thread, loaded from AOT Autograd's cache
    (no compile of its own): the unit's compile is charged to it."""
    units = [w for w in _state().windows if w.record is None and w.end_ns is None]
    if units:
        units[-1].loaded.append(rec)


# ------------------------------------------------------------------ torch's events
def _on_event(e: Event) -> None:
    st = _state()
    st.events.append(e)
    if not e.outermost:
        return
    events, st.events = st.events, []
    if st.first_calls:
        _charge_first_call(st.first_calls[-1], events)
        return
    windows = [w for w in st.windows if w.end_ns is not None and e.start_ns <= w.start_ns and w.end_ns <= e.end_ns]
    if windows:
        charge(events, e, windows)
        st.windows = [w for w in st.windows if w not in windows]
    _maybe_stop(st)


def _charge_first_call(call: _FirstCall, events: list[Event]) -> None:
    for owner, phase, seconds in attribute(events, [], lambda e: call.record):
        call.record.add_compile_time(phase, seconds)
        if call.in_run:
            call.events_in_run_s += seconds
        else:
            call.events_outside_s += seconds


def charge(events: list[Event], root: Event, windows: list[_Window]) -> None:
    """Charge one compile (``root`` and the events in it) to the graphs of ``windows``."""
    graphs = sorted((w for w in windows if w.record is not None), key=lambda w: w.start_ns)
    loaded = [rec for w in windows if w.record is None for rec in w.loaded]
    first = graphs[0].record if graphs else (loaded[0] if loaded else None)
    if first is None:
        return  # enn compiled no graph in it (disabled, an eager fallback)

    units = [w for w in windows if w.record is None]

    def owner(e: Event) -> GraphRecord:
        inner = [w for w in graphs if w.holds(e)]
        if inner:
            return max(inner, key=lambda w: w.start_ns).record
        # a unit's own work outside its graphs' compiles (its AOT Autograd trace), where one
        # compile holds several units (option blocks: a unit per layer): that unit's first graph
        held = [w for w in units if w.holds(e)]
        if held:
            unit = max(held, key=lambda w: w.start_ns)
            mine = [w.record for w in graphs if w.unit == unit.unit] or unit.loaded
            if mine:
                return mine[0]
        return first

    cpp = {id(w.record): w.cpp_wrapper for w in graphs}
    for rec, phase, seconds in attribute(events, [root], owner, lambda r: cpp.get(id(r), False)):
        rec.add_compile_time(phase, seconds)


def attribute(events: list[Event], roots: list[Event], owner: Callable[[Event], GraphRecord],
              cpp_wrapper: Callable[[GraphRecord], bool] = lambda r: False) -> list[tuple[GraphRecord, CompilePhase, float]]:
    """Each event's own time (its span less its children's) with its owner and phase: the
    pure part of the rules above. Events nest by their spans (one thread's events do)."""
    ordered = sorted(set(events) | set(roots), key=lambda e: (e.start_ns, -e.end_ns))
    out: list[tuple[GraphRecord, CompilePhase, float]] = []
    stack: list[tuple[Event, str, float]] = []  # (event, phase, children's time in ns)
    done: list[tuple[Event, str, float]] = []

    def close(item: tuple[Event, str, float]) -> None:
        ev, phase, children = item
        done.append((ev, phase, max(0.0, (ev.end_ns - ev.start_ns) - children)))
        if stack:
            parent = stack[-1]
            stack[-1] = (parent[0], parent[1], parent[2] + (ev.end_ns - ev.start_ns))

    for ev in ordered:
        while stack and stack[-1][0].end_ns <= ev.start_ns:
            close(stack.pop())
        parent_phase = stack[-1][1] if stack else CompilePhase.OTHER.value
        parent_name = stack[-1][0].name if stack else ""
        phase = phase_of_event(ev.name, parent_phase, parent_name, cpp_wrapper(owner(ev)))
        stack.append((ev, phase, 0.0))
    while stack:
        close(stack.pop())
    for ev, phase, own_ns in done:
        if own_ns > 0:
            out.append((owner(ev), CompilePhase(phase), own_ns / 1e9))
    return out


# ------------------------------------------------------------------ the first call
class FirstCallClock:
    """Times a guarded graph's first call by phase: ``first_run`` (the compiled code) and
    ``guard`` (the rest: screens, value checks, the ladder), less the compile events inside.
    Armed on a graph (:meth:`arm`), it is called once, by the graph, for its first call
    (``GuardedGraph.first_call_clock``); later calls pay nothing."""

    @classmethod
    def arm(cls, guarded: GuardedGraph) -> GuardedGraph:
        guarded.first_call_clock = cls()
        return guarded

    def time(self, graph: GuardedGraph, rest: Callable[[list], Any], args: list) -> Any:
        """``rest(args)`` (the graph's call), timed; the graph's artifact is timed inside it."""
        st = _state()
        _listen(st)
        call = _FirstCall(graph.record)
        st.first_calls.append(call)
        compiled = graph.compiled
        run_s = 0.0

        def timed(inner_args: list) -> Any:
            nonlocal run_s
            call.in_run = True
            t = time.perf_counter()
            try:
                return compiled(inner_args)
            finally:
                run_s += time.perf_counter() - t
                call.in_run = False

        timed._boxed_call = True  # type: ignore[attr-defined]
        graph.compiled = timed  # for this call only (a decision of the ladder may replace it)
        t0 = time.perf_counter()
        try:
            return rest(args)
        finally:
            wall = time.perf_counter() - t0
            if graph.compiled is timed:
                graph.compiled = compiled
            st.first_calls.remove(call)
            graph.record.add_compile_time(CompilePhase.FIRST_RUN, max(0.0, run_s - call.events_in_run_s))
            graph.record.add_compile_time(CompilePhase.GUARD, max(0.0, wall - run_s - call.events_outside_s))
            _maybe_stop(st)
            log_compile_time(graph.record)
