"""Find the smallest set of nodes whose safe path removes a fault.

``still_faulty(pinned)`` recompiles the graph with ``pinned`` nodes on their safe
path and re-runs it; each call is one *trial* (a recompile). Suspects are grouped by
op (a broken kernel usually breaks every node of that op): groups first, then nodes
inside the guilty groups, each by binary splitting that also finds several culprits.
Past ``budget`` trials the smallest set seen to remove the fault is pinned: a larger pin
set, never a wrong one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence


class BudgetExhausted(Exception):
    pass


@dataclass
class Localization:
    pinned: list[str]
    trials: int
    exhausted: bool = False
    notes: list[str] = field(default_factory=list)


def localize(
    groups: Sequence[Sequence[str]],
    still_faulty: Callable[[frozenset[str]], bool],
    budget: int,
) -> Localization | None:
    """Minimal pin set over ``groups`` (ordered, most suspect first), or None if
    pinning everything does not remove the fault (not a node-level fault)."""
    trials = 0
    best: frozenset[str] = frozenset()  # smallest pin set seen to remove the fault

    def faulty(pins: frozenset[str]) -> bool:
        nonlocal trials, best
        if trials >= budget:
            raise BudgetExhausted
        trials += 1
        bad = still_faulty(pins)
        if not bad and len(pins) < len(best):
            best = pins
        return bad

    everything = frozenset(n for g in groups for n in g)
    if not everything:
        return None
    trials += 1  # pinning everything is always tried, even with budget 0
    if still_faulty(everything):
        return None
    best = everything

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

    result = Localization(pinned=sorted(everything), trials=0)
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
            f"localization budget of {budget} recompiles exhausted; pinned the smallest fault-free set found ({len(best)} nodes)"
        )
    result.trials = trials
    return result


def _flat(items: list[list[str]]) -> frozenset[str]:
    return frozenset(n for g in items for n in g)
