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
    """What the ladder needs of one call: its inputs (None when not held), copies of the inputs
    it may write into, the RNG state before it, the fast path's generation it ran on, and what
    the reference run left in the inputs and the RNG."""

    __slots__ = ("inputs", "snapshot", "rng", "generation", "after")

    def __init__(self, inputs: list | None, snapshot: list | None, rng: RngSnapshot | None, generation: int) -> None:
        self.inputs, self.snapshot, self.rng, self.generation = inputs, snapshot, rng, generation
        self.after: tuple[list, RngSnapshot | None] | None = None  # what the reference run left
