"""The cap on CUDA graphs recorded per compiled graph (``mode="reduce-overhead"``).

What Inductor does (2.11, 2.13, 2.14: ``torch/_inductor/cudagraph_trees.py``,
``cudagraphify_impl``): a compiled graph under CUDA graphs keys its recordings by the integers
among its inputs -- its symbolic sizes, and any integer a graph with dynamic shapes takes -- read
with ``operator.itemgetter`` at the positions the first call had integers. Each new key is warmed
up and then recorded as a CUDA graph of its own (with graph partitions, one per partition), and
nothing bounds how many keys a graph records: a training loop with dynamic padding records one
per sequence length. What Inductor offers against that does not bound the count on every
supported torch:

- ``triton.cudagraph_capture_sizes``: a fixed set of keys to capture, every other key runs
  without capture -- but it is read from the global config on each call (a compile's
  ``config_patches`` no longer hold then), it is one set for every graph of the process, and it
  must be known before the first call;
- ``triton.cudagraph_skip_dynamic_graphs``: no capture at all for a graph with symbolic inputs;
- ``triton.cudagraph_unexpected_rerecord_limit`` (128): re-records of one key whose static input
  addresses moved, not new keys; ``cudagraph_dynamic_shape_warn_limit`` (8) only warns;
- ``config.cudagraph_policy`` (a pluggable wrapper of each compiled graph, in 2.13 and 2.14) is
  not in 2.11: it landed in April 2026 (pytorch#180163).

enn's policy, on top of any of them: each compiled graph (forward, backward, inference) hands at
most ``cudagraph_max_shapes`` (default 8; 0: no cap) distinct keys -- the same integers Inductor
keys on -- to its CUDA-graph artifact, first come first served: a size met once early keeps its
slot (a recording is never evicted). A later key runs the same graph compiled once more without
CUDA graphs (the build the guard makes for a graph that faulted: ``GraphCompiler.build`` with
``cudagraphs_ok`` off), built on the first such call -- an Inductor compile of seconds, once per
graph (``triton.cudagraphs`` is part of the FX graph cache's key); the recorded keys keep
replaying. The first key past the cap is one ``cudagraph_limit`` fallback line; the graph's
counters say how many keys were handed to capture (``cudagraph_shapes``) and how many keys and
calls ran without capture (``uncaptured_shapes``, ``uncaptured_calls``).

What the cap counts is keys handed to capture: Inductor records each of them once per place it
runs in a step's tree (a graph run after two different parents is recorded under each), and
again where its static inputs moved (its own limit above). A graph without integer inputs has
one key and is not wrapped at all; a key already admitted costs one tuple read and one dict
lookup per call.
"""

from __future__ import annotations

import operator
import threading
import time
from typing import Any, Callable, Hashable, Sequence

import torch

from . import compat
from .guard.calls import LADDER
from .report import FallbackKind, GraphCounter, GraphRecord, report


def int_positions(inputs: Sequence[Any]) -> list[int]:
    """Where a graph's inputs are integers (concrete or symbolic): where Inductor reads its key."""
    # a bool too: Inductor's check is isinstance(v, int) on the call's values
    return [i for i, v in enumerate(inputs) if isinstance(v, (int, torch.SymInt, torch.SymBool))]


class CapturePolicy:
    """Which keys go to capture: the first ``limit`` distinct ones (0: every one). Pure; the
    caller holds a lock around :meth:`admit` for a key it has not seen admitted."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.limit = limit
        self.captured: dict[Hashable, None] = {}  # admitted keys, in admission order
        self.uncaptured: dict[Hashable, None] = {}  # keys turned away, in order

    def admit(self, key: Hashable) -> bool:
        """Whether a call with ``key`` runs the captured artifact (admitting a new key while
        fewer than ``limit`` are)."""
        if key in self.captured:
            return True
        if self.limit == 0 or len(self.captured) < self.limit:
            self.captured[key] = None
            return True
        self.uncaptured[key] = None
        return False


class CappedCudagraphs:
    """A graph's CUDA-graph artifact behind the cap: called as the artifact is (one boxed list
    of inputs), it runs the artifact for admitted keys and an uncaptured build for the rest."""

    def __init__(self, captured: Callable[[list], Any], facts: Any, record: GraphRecord, limit: int,
                 positions: list[int] | None = None) -> None:
        self.captured = captured
        self.facts = facts  # the graph's GraphFacts: full() gives the compiler that builds
        self.record = record
        self.policy = CapturePolicy(limit)
        self.uncaptured: Callable[[list], Any] | None = None
        self._lock = threading.Lock()
        self._key: Callable[[list], Hashable] | None = None
        self._passthrough = False
        if positions is not None:
            self._set_positions(positions)
        self._boxed_call = True  # an instance attribute: torch._dynamo.disable copies __dict__

    def _set_positions(self, positions: list[int]) -> None:
        # as Inductor reads its key: one integer alone, several as a tuple
        self._key = operator.itemgetter(*positions) if positions else None
        self._passthrough = not positions

    def __call__(self, args: list) -> Any:
        key_of = self._key
        if key_of is None:
            if self._passthrough:
                return self.captured(args)
            # a graph loaded from a cache: its first call tells (a graph on the CPU is never captured)
            self._set_positions(int_positions(args) if _on_cuda(args) else [])
            return self(args)
        key = key_of(args)
        if key in self.policy.captured:
            return self.captured(args)
        with self._lock:
            admitted = self.policy.admit(key)
            if admitted:
                self.record.set(GraphCounter.CUDAGRAPH_SHAPES, len(self.policy.captured))
        if admitted:
            return self.captured(args)
        return self._run_uncaptured(args, key)

    def _run_uncaptured(self, args: list, key: Hashable) -> Any:
        if self.uncaptured is None:
            with LADDER:  # no ladder of this graph changes its compiler while it builds
                if self.uncaptured is None:
                    self.uncaptured = self._build(key)
        rec = self.record
        rec.set(GraphCounter.UNCAPTURED_SHAPES, len(self.policy.uncaptured))
        rec.bump(GraphCounter.UNCAPTURED_CALLS)
        return self.uncaptured(args)

    def _build(self, key: Hashable) -> Callable[[list], Any]:
        """The graph as it is built now (its pins, fp32), without CUDA graphs; one report line."""
        t0 = time.perf_counter()
        compiler = self.facts.full()
        was = compiler.cudagraphs_ok
        compiler.cudagraphs_ok = False  # GraphCompiler.build: no CUDA graphs around what it builds
        try:
            built = compiler.build(quiet=True)
        finally:
            compiler.cudagraphs_ok = was
        took = time.perf_counter() - t0
        self.record.compile_time_s += took
        limit = self.policy.limit
        report().add_fallback(
            FallbackKind.CUDAGRAPH_LIMIT, node="<graph>", phase=self.record.phase, graph=self.record,
            reason=(f"new integer inputs (sizes) {key}: this graph has handed {limit} distinct ones to CUDA-graph "
                    "capture, the cap per compiled graph (option cudagraph_max_shapes)"),
            action=(f"these and every further new sizes run the graph compiled without CUDA graphs (built once, "
                    f"in {took:.1f}s); the {limit} recorded ones keep replaying"))
        return built


def capped(compiled: Callable[[list], Any], facts: Any, record: GraphRecord, opts: Any,
           example_inputs: Sequence[Any] | None = None) -> Callable[[list], Any]:
    """``compiled`` behind the cap where it applies: the graph is under CUDA graphs, the cap is
    on, and the graph takes integers (``example_inputs``: its compile's; None, from a cache: the
    first call tells). Else ``compiled`` itself."""
    limit = opts.cudagraph_max_shapes
    if limit == 0 or not _under_cudagraphs(facts):
        return compiled
    positions = None if example_inputs is None else int_positions(example_inputs)
    if positions == []:
        return compiled
    return CappedCudagraphs(compiled, facts, record, limit, positions)


def _on_cuda(args: Sequence[Any]) -> bool:
    """Whether a call's inputs hold a CUDA tensor (a graph Inductor may have captured)."""
    return any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)


def _under_cudagraphs(facts: Any) -> bool:
    """Whether Inductor wrapped this graph in CUDA graphs: its compile's ``cudagraphs`` box (which
    Inductor turns off for a graph it does not capture), else, for a graph loaded from a cache,
    the config the load runs under."""
    on = getattr(facts, "cudagraphs", None)
    return bool(compat.inductor_config.triton.cudagraphs) if on is None else bool(on)


__all__ = ["CapturePolicy", "CappedCudagraphs", "capped", "int_positions"]
