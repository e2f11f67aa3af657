"""What the guard does on each call of a compiled graph: its schedule, as a pure function.

Call ``n`` of a graph, ``k`` calls since its artifact was built (or its warm-up restarted)::

    a late screen pending ──► read it first (a NaN found there restarts the warm-up: k = 0)

    checked?   k <= guard_warmup
               or values due: (k == 1, the artifact's first call, unless loaded from a cache)
                              or n % guard_values == 0
               or n % guard_every == 0
      │
      ├─ no  ─────────────────────────────────────────────► BARE   the compiled call alone
      │                                                      HOLD   ("exceptions" mode: its inputs
      │                                                             kept, so that a fault can be re-run)
      └─ yes ─► values due, or mode "values" ──────────────► VALUES  screened, then compared with eager
                past the warm-up, outputs on one GPU,
                guard_every > 1 ───────────────────────────► SCREEN_LATER  screened on the GPU, read on
                                                                           the next call (no host sync)
                otherwise ─────────────────────────────────► SCREEN  outputs and writes screened for NaN/Inf

    next due: the next call while calls are held, a late screen waits or k < max(guard_warmup, 1);
              else the next multiple of guard_every or guard_values, whichever comes first.
              The calls before it are bare and cost one comparison.

``guard_every=1`` asks for every call to be screened: none is sampled, and none is read late, so
a NaN/Inf never leaves the call that made it (a host sync per call: the price of that promise).

A fault found on any of them goes down the fallback ladder (guard/ladder.py); adopting a new
artifact restarts the warm-up. Mode "exceptions" checks no output: every call is HOLD. Graphs that
draw random numbers, and every graph under torch.distributed, get no value checks
(``value_every`` 0); a value check that cannot prove a fault turns them off for that graph.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Action(enum.Enum):
    """What one call does besides running the compiled code."""

    BARE = "bare"
    HOLD = "hold"
    SCREEN = "screen"
    SCREEN_LATER = "screen_later"
    VALUES = "values"

    @property
    def holds_inputs(self) -> bool:
        """The call keeps its inputs (and copies of those it may write): the ladder can re-run it."""
        return self in (Action.HOLD, Action.SCREEN, Action.VALUES)

    @property
    def checks(self) -> bool:
        """The call's results are screened before it returns."""
        return self in (Action.SCREEN, Action.VALUES)


@dataclass(frozen=True)
class Schedule:
    """The guard's schedule for one graph (see the module's docstring)."""

    warmup: int
    every: int
    value_every: int  # 0: no value checks
    values_always: bool  # mode "values": every checked call is a value check
    checks_outputs: bool  # False in mode "exceptions"
    keep_inputs: bool  # mode "exceptions": every call holds its inputs

    def action(self, n: int, k: int, first_call_values: bool, screen_later: bool) -> Action:
        """What call ``n`` does, ``k`` calls into its artifact; ``first_call_values``: an
        artifact's first call is value-checked; ``screen_later``: its outputs can be screened
        on the GPU without a host sync."""
        warm = k <= self.warmup
        values = self.value_every > 0 and ((k == 1 and first_call_values) or n % self.value_every == 0)
        if not (self.checks_outputs and (warm or values or n % self.every == 0)):
            return Action.HOLD if self.keep_inputs else Action.BARE
        if values or self.values_always:
            return Action.VALUES
        return Action.SCREEN_LATER if not warm and screen_later and self.every > 1 else Action.SCREEN

    def next_due(self, n: int, k: int, late_pending: bool) -> int:
        """The first call after call ``n`` that is not BARE (or that must read a late screen)."""
        if self.keep_inputs or late_pending or k < max(self.warmup, 1):
            return n + 1
        due = n + self.every - n % self.every
        if self.value_every:
            due = min(due, n + self.value_every - n % self.value_every)
        return due
