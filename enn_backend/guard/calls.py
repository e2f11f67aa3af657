"""What the guard holds of one call.

:class:`Call` (a call's inputs, the copies of those it may write into, its RNG state),
:data:`LADDER` (one fallback ladder at a time in a process), whether torch.distributed runs
(the ranks' agreement itself: :mod:`.ranks`), and :class:`EnnGuardError` (what ``guard="strict"`` raises).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from .. import compat


def flat_args(args: tuple) -> tuple[list, bool]:
    """A compiled unit's inputs as one list, and whether they came boxed (Dynamo may call with
    one list, which the callee owns and clears, or with the inputs as arguments)."""
    boxed = len(args) == 1 and isinstance(args[0], list)
    return (args[0] if boxed else list(args)), boxed


class EnnGuardError(RuntimeError):
    """Raised in ``guard="strict"`` mode instead of falling back."""


def distributed() -> bool:
    # asked on every guarded call, so the cheap probe first (see compat.dist_initialized)
    return compat.dist_initialized() and torch.distributed.get_world_size() > 1


@contextlib.contextmanager
def no_autocast() -> Any:
    """The graphs are post-AOT: autocast's casts are already explicit in them."""
    with torch.autocast("cpu", enabled=False):
        if torch.cuda.is_available():
            with torch.autocast("cuda", enabled=False):
                yield
        else:
            yield


class RngSnapshot:
    """The CPU and CUDA RNG states before a call: a re-run of a graph that draws random
    numbers draws the same ones."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def moved(self) -> bool:
        """Has a random number been drawn since?"""
        if not torch.equal(self.cpu, torch.get_rng_state()):
            return True
        return self.cuda is not None and any(not torch.equal(a, b) for a, b in zip(self.cuda, torch.cuda.get_rng_state_all()))

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


# One ladder at a time in a process: a thread whose call faults while another thread's ladder
# runs waits for it, then runs its call again on whatever fast path that ladder left (or, for
# another graph with the same faulty kernel, finds the culprit in kernel state). Ladders are rare
# and spend their time compiling, which Inductor does one graph at a time anyway.
LADDER = threading.RLock()


class Call:
    """What the ladder needs of one call, and the rule every re-run follows.

    ``inputs``: the call's inputs (None when not held); ``before``: private copies of the inputs
    the graph may write (in place, or as scratch: a donated saved tensor), taken before the
    compiled call; ``rng``: the RNG state before it; ``generation``: the fast path it ran on.

    The rule: **a re-run never touches the caller's tensors.** Every re-run the guard makes (the
    eager reference, the fp64 judge, localization trials, the fp32 retry, a retry on a newer fast
    path) runs on :meth:`rerun_inputs` -- the inputs with each one the graph may write replaced by
    a fresh copy of what it held before the call -- and replays the call's random draws, leaving
    the RNG as the compiled call left it. So a BatchNorm's running statistics, an optimizer's
    state or an input written in place are written once: by the compiled call, or, where the
    guard returns another run's result instead, by :meth:`commit` of that run's writes. A
    compiled output that shares memory with a donated input is not disturbed either.
    """

    __slots__ = ("inputs", "before", "rng", "generation")

    def __init__(self, inputs: list | None, before: dict[int, torch.Tensor] | None, rng: RngSnapshot | None,
                 generation: int) -> None:
        self.inputs, self.before, self.rng, self.generation = inputs, before, rng, generation

    @classmethod
    def held(cls, args: list, written: list[int], random: bool, generation: int) -> "Call":
        """A call about to run whose inputs the guard keeps: copies of ``written`` taken now."""
        with torch.no_grad():
            before = {i: args[i].clone() for i in written} if written else None
        return cls(list(args), before, RngSnapshot() if random else None, generation)

    def inputs_before(self) -> list:
        """The inputs as they were before the call (the copies for those it may have written)."""
        before = self.before or {}
        return [before.get(i, x) for i, x in enumerate(self.inputs)]

    def rerun_inputs(self) -> list:
        """Inputs for one re-run: those the graph may write are fresh copies of what they held
        before the call, the others the caller's own (a re-run reads them only)."""
        if not self.before:
            return list(self.inputs)
        with torch.no_grad():
            return [self.before[i].clone() if i in self.before else x for i, x in enumerate(self.inputs)]

    @contextlib.contextmanager
    def replaying(self) -> Any:
        """Around a re-run: it draws the call's random numbers again; afterwards the RNG is as
        the compiled call left it."""
        if self.rng is None:
            yield
            return
        after = RngSnapshot()
        self.rng.restore()
        try:
            yield
        finally:
            after.restore()

    def commit(self, ran: list, mutated: list[int]) -> None:
        """Write into the caller's inputs what a re-run (on ``ran``, its :meth:`rerun_inputs`)
        wrote into them: its result is the one the guard returns."""
        with torch.no_grad():
            for i in mutated:
                if ran[i] is not self.inputs[i]:
                    self.inputs[i].copy_(ran[i])


class Run:
    """One re-run's outcome: its results -- the graph's outputs, then the values it wrote into
    the inputs the graph mutates -- the inputs it ran on (to :meth:`Call.commit` its writes),
    and the exception it raised (results empty then)."""

    __slots__ = ("results", "inputs", "exc", "n_out")

    def __init__(self, outs: list | None, inputs: list, mutated: list[int], exc: BaseException | None) -> None:
        self.inputs, self.exc = inputs, exc
        self.n_out = len(outs) if outs is not None else 0
        self.results = (list(outs) + [inputs[i] for i in mutated]) if outs is not None else []

    @property
    def outputs(self) -> list:
        return self.results[:self.n_out]
