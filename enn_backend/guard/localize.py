"""Find the smallest set of nodes whose safe path removes a fault.

``still_faulty(pinned)`` recompiles the graph with ``pinned`` nodes on their safe
path and re-runs it; each call is one *trial* (a recompile). Suspects are grouped by
op (a broken kernel usually breaks every node of that op): groups first, then nodes
inside the guilty groups, each by binary splitting that also finds several culprits.
Past ``budget`` trials the smallest set seen to remove the fault is pinned: a larger pin
set, never a wrong one.
"""

from __future__ import annotations

import linecache
import re
import traceback
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch.fx as fx


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
    prime: frozenset[str] = frozenset(),
) -> Localization | None:
    """Minimal pin set over ``groups`` (ordered, most suspect first), or None if
    pinning everything does not remove the fault (not a node-level fault).

    ``prime`` are the prime suspects (named by the failing kernel's traceback, or the
    nodes only bad outputs depend on): if pinning them removes the fault, the search
    stays inside them.
    """
    trials = 0
    everything = frozenset(n for g in groups for n in g)
    best = everything  # smallest pin set seen to remove the fault

    def faulty(pins: frozenset[str], free: bool = False) -> bool:
        nonlocal trials, best
        if trials >= budget and not free:
            raise BudgetExhausted
        trials += 1
        bad = still_faulty(pins)
        if not bad and len(pins) <= len(best):
            best = pins
        return bad

    if not everything:
        return None
    prime = prime & everything
    notes: list[str] = []
    if prime and prime != everything and not faulty(prime, free=True):
        groups = [[n for n in g if n in prime] for g in groups]
        notes.append(f"prime suspects ({len(prime)} nodes) confirmed")
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
            f"localization budget of {budget} recompiles exhausted; pinned the smallest fault-free set found ({len(best)} nodes)"
        )
    result.trials = trials
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
