"""Find the smallest set of nodes whose safe path removes a fault.

``still_faulty(pinned)`` runs the graph compiled with ``pinned`` nodes on their safe
path: the first time for a pin set it recompiles (one *trial*), later calls for a pin set
it found fault-free re-run the artifact it kept. Suspects are grouped by op (a broken
kernel usually breaks every node of that op): groups first, then nodes inside the guilty
groups, each by binary splitting that also finds several culprits. Past ``budget``
trials the smallest set seen to remove the fault is pinned: a larger pin set, never a
wrong one.

A faulty run proves the fault survives a pin set; one fault-free run does not prove the
opposite, since a flaky kernel passes some runs. So a pin set counts as fault-free only
after ``runs`` fault-free runs of its artifact (re-runs cost no recompile), and the
final pin set must pass ``runs`` more; if it does not, the first pin set found fault-free
(the suspects tried first, or every suspect) is pinned instead.
"""

from __future__ import annotations

import linecache
import re
import traceback
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch.fx as fx


CONFIRM_RUNS = 3  # fault-free runs of a trial's artifact before its pin set counts as fault-free


class BudgetExhausted(Exception):
    pass


@dataclass
class Localization:
    pinned: list[str]
    trials: int  # recompiles
    reruns: int = 0  # runs of an artifact already built, to confirm a fault-free verdict
    exhausted: bool = False
    notes: list[str] = field(default_factory=list)


def localize(
    groups: Sequence[Sequence[str]],
    still_faulty: Callable[[frozenset[str]], bool],
    budget: int,
    first: frozenset[str] = frozenset(),
    why: str = "",
    runs: int = CONFIRM_RUNS,
) -> Localization | None:
    """Minimal pin set over ``groups`` (ordered, most suspect first), or None if
    pinning everything does not remove the fault (not a node-level fault).

    ``first`` are the suspects tried first (the ops the failing kernel's traceback names, or
    the ops only bad outputs depend on; ``why`` says which, for the notes): if pinning them
    removes the fault, the search stays inside them. ``runs``: fault-free runs that make a
    pin set fault-free.
    """
    trials = reruns = 0
    verdicts: dict[frozenset[str], bool] = {}  # each pin set is tried once
    everything = frozenset(n for g in groups for n in g)
    best = everything  # smallest pin set seen to remove the fault

    def passes_reruns(pins: frozenset[str], n: int) -> bool:
        nonlocal reruns
        for _ in range(n):
            reruns += 1
            if still_faulty(pins):
                return False
        return True

    def faulty(pins: frozenset[str], free: bool = False) -> bool:
        nonlocal trials, best
        if pins in verdicts:
            return verdicts[pins]
        if trials >= budget and not free:
            raise BudgetExhausted
        trials += 1
        bad = verdicts[pins] = still_faulty(pins) or not passes_reruns(pins, runs - 1)
        if not bad and len(pins) <= len(best):
            best = pins
        return bad

    if not everything:
        return None
    first = first & everything
    notes: list[str] = []
    start = everything  # the first pin set found fault-free: the fallback if the final one fails
    if first and first != everything and not faulty(first, free=True):
        groups = [[n for n in g if n in first] for g in groups]
        start = first
        notes.append(f"searched only the {len(first)} op(s) {why or 'tried first'}: pinning them removed the fault")
    elif faulty(everything, free=True):  # always tried, even with budget 0
        return None

    def minimize(items: list[list[str]], base: frozenset[str]) -> list[list[str]]:
        """Subset M of items with pin(base + M) fault-free, given pin(base + items) is."""
        if len(items) <= 1:
            return items
        half = len(items) // 2
        a, b = items[:half], items[half:]
        if not faulty(base | _flat(a)):
            return minimize(a, base)
        if not faulty(base | _flat(b)):
            return minimize(b, base)
        a2 = minimize(a, base | _flat(b))
        b2 = minimize(b, base | _flat(a2))
        return a2 + b2

    result = Localization(pinned=sorted(best), trials=0, notes=notes)
    try:
        guilty_groups = minimize([list(g) for g in groups if g], frozenset())
        chosen: list[str] = []
        for i, g in enumerate(guilty_groups):
            rest = frozenset(chosen) | _flat(guilty_groups[i + 1 :])
            chosen += [n for [n] in minimize([[n] for n in g], rest)]
        result.pinned = chosen
    except BudgetExhausted:
        result.exhausted = True
        result.pinned = sorted(best)
        result.notes.append(
            f"localization budget of {budget} recompiles exhausted; pinned the smallest set found that removes the fault ({len(best)} ops)"
        )
    final = frozenset(result.pinned)
    if faulty(final, free=True) or not passes_reruns(final, runs):
        if final == start:
            return None
        result.notes.append(f"the ops found ({len(result.pinned)}) faulted again on a confirming re-run; "
                            f"pinned the first set found to remove the fault instead ({len(start)} ops)")
        result.pinned = sorted(start)
    result.trials, result.reruns = trials, reruns
    result.notes.append(f"{reruns} confirming re-run(s): pinning a set of ops counts as removing the fault after "
                        f"{runs} clean runs, the final set after {runs} more")
    return result


def _flat(items: list[list[str]]) -> frozenset[str]:
    return frozenset(n for g in items for n in g)


_SOURCE_NODES = re.compile(r"#\s*Topologically Sorted Source Nodes:\s*\[([^\]]*)\]")


def suspects_from_traceback(exc: BaseException, gm: fx.GraphModule) -> frozenset[str]:
    """Nodes of ``gm`` named by the Inductor kernel that raised.

    Inductor's generated ``call()`` puts ``# Topologically Sorted Source Nodes: [...]``
    above each kernel call; those are the model-level names (``gelu``, ``linear_2``)
    that ATen nodes carry in ``meta['source_fn_stack']``.
    """
    frames = [(f, line) for f, line in traceback.walk_tb(exc.__traceback__) if f.f_code.co_name == "call"]
    for frame, lineno in reversed(frames):
        lines = linecache.getlines(frame.f_code.co_filename)
        for text in reversed(lines[max(0, lineno - 6) : lineno]):
            m = _SOURCE_NODES.search(text)
            if m:
                names = {s.strip() for s in m.group(1).split(",") if s.strip()}
                return frozenset(
                    n.name for n in gm.graph.nodes if n.meta.get("source_fn_stack") and n.meta["source_fn_stack"][-1][0] in names
                )
    return frozenset()
