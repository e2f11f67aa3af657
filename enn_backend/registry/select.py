"""One way every kernel choice is made: :func:`select`.

An op's choice is a :class:`Policy`, a table of plain parts:

- ``checkers``: per kernel, a pure checker, problem in, ``(eligible, reason)`` out;
- ``order``: the rules, problem in, the kernels in the order they are preferred;
- ``fallback``: the kernel behind every choice (the un-fused or eager path), whose checker
  accepts every problem;
- ``runner`` (optional): kernel and problem in, a zero-argument call that runs the kernel on
  inputs of the problem's real shapes (None where the kernel cannot be run on its own);
- ``key`` (optional): problem in, the :class:`.key.ChoiceKey` its measured choice is cached
  under (None where the problem's sizes are not known: dynamic shapes).

:func:`select` asks the checkers in order; the first eligible kernel is the *rule's choice*.
With measurement on (a time budget), the eligible kernels that can run on their own are timed and
the fastest wins, unless the rule's choice is within the noise margin (``measure.winner``); the
result is cached by the problem's key, and a cached choice is taken without measuring again
while it is still eligible. Measurement never picks an ineligible kernel, and where the rule's
choice cannot be timed the rule stands. When no kernel in the order is eligible, the fallback is
the choice.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Mapping, Optional, Sequence, TypeVar

from . import measure as M
from .cache import ChoiceCache, cache_for, make_entry
from .key import ChoiceKey

log = logging.getLogger(__name__)

K = TypeVar("K", bound=enum.Enum)
P = TypeVar("P")

Checker = Callable[[Any], "tuple[bool, str]"]


@dataclass(frozen=True)
class Policy(Generic[K, P]):
    """One op's kernel choice as a table (see the module doc)."""

    op: str
    kernels: type[K]
    checkers: Mapping[K, Checker]
    order: Callable[[P], Sequence[K]]
    fallback: K
    runner: Optional[Callable[[K, P], Optional[Callable[[], Any]]]] = None
    key: Optional[Callable[[P], Optional[ChoiceKey]]] = None
    device_type: Callable[[P], str] = lambda p: "cpu"


@dataclass(frozen=True)
class Verdict:
    """One checker's answer."""

    kernel: str
    eligible: bool
    reason: str


@dataclass(frozen=True)
class Selection(Generic[K]):
    """The kernel chosen, why, and how: ``rule`` | ``measured`` | ``cached`` | ``fallback``."""

    kernel: K
    reason: str
    how: str
    verdicts: tuple[Verdict, ...] = ()
    timings_ms: Mapping[str, float] = field(default_factory=dict)

    @property
    def rule_choice(self) -> str:
        """The kernel the rules alone pick (the first eligible one)."""
        return next((v.kernel for v in self.verdicts if v.eligible), str(self.kernel.value))


@dataclass(frozen=True)
class Measurement:
    """Measurement on: each choice may spend ``budget_ms`` timing candidates; choices are kept in ``cache``."""

    budget_ms: float
    cache: Optional[ChoiceCache] = None

    @classmethod
    def of(cls, opts: Any) -> Optional["Measurement"]:
        """The measurement ``opts`` asks for (``measure_ms``, or max-autotune's budget), with its
        choice cache; None where it asks for rules only."""
        budget = opts.measure_budget_ms()
        return cls(budget, cache_for(opts)) if budget > 0 else None


def verdicts(policy: Policy, p: Any, order: Sequence[Any]) -> list[Verdict]:
    """Every kernel of ``order`` (once each) with its checker's answer, in order."""
    out: list[Verdict] = []
    seen: set[Any] = set()
    for k in order:
        if k in seen:
            continue
        seen.add(k)
        ok, why = policy.checkers[k](p)
        out.append(Verdict(k.value, bool(ok), why))
    return out


def select(policy: Policy[K, P], p: P, order: Optional[Sequence[K]] = None,
           measurement: Optional[Measurement] = None) -> Selection[K]:
    """The kernel for ``p`` (see the module doc); ``order`` replaces the policy's rules."""
    asked = verdicts(policy, p, list(policy.order(p) if order is None else order))
    eligible = [policy.kernels(v.kernel) for v in asked if v.eligible]
    if not eligible:
        ok, why = policy.checkers[policy.fallback](p)
        assert ok, f"{policy.op}: the fallback {policy.fallback.value} refused a problem: {why}"
        return Selection(policy.fallback, why, "fallback", tuple(asked))
    rule = eligible[0]
    rule_reason = next(v.reason for v in asked if v.kernel == rule.value)
    if measurement is None or measurement.budget_ms <= 0 or len(eligible) < 2 or policy.runner is None:
        return Selection(rule, rule_reason, "rule", tuple(asked))
    key = policy.key(p) if policy.key is not None else None
    if key is None:
        return Selection(rule, rule_reason + " (not measured: the problem's sizes are not fixed)", "rule", tuple(asked))
    cache = measurement.cache
    if cache is not None:
        hit = cache.get(key)
        if hit is not None:
            kernel = _member(policy, hit.kernel)
            if kernel in eligible:
                return Selection(kernel, f"measured before ({_times(dict(hit.timings_ms))})", "cached", tuple(asked),
                                 dict(hit.timings_ms))
            log.warning("enn registry: cached choice %r for %s is %s here: measuring again", hit.kernel, policy.op,
                        "not eligible" if kernel is not None else "not a kernel of this op")
    runs = {}
    for k in eligible:
        fn = policy.runner(k, p)
        if fn is not None:
            runs[k.value] = fn
    if rule.value not in runs or len(runs) < 2:
        return Selection(rule, rule_reason + " (not measured: fewer than two candidates run on their own)", "rule",
                         tuple(asked))
    timings = M.measure(runs, policy.device_type(p), measurement.budget_ms)
    best = M.winner(rule.value, timings)
    if cache is not None and timings:
        cache.put(make_entry(key, best, timings))
    how = "measured" if rule.value in timings else "rule"
    return Selection(policy.kernels(best), f"measured: {_times(timings)}", how, tuple(asked), timings)


def _member(policy: Policy, name: str) -> Any:
    try:
        return policy.kernels(name)
    except ValueError:
        return None


def _times(timings: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {v:.4g} ms" for k, v in sorted(timings.items(), key=lambda kv: kv[1]))
