"""Timing candidate kernels at compile time, within a budget.

A candidate is a zero-argument callable that runs the kernel once on inputs of the real shape,
dtype and device (the op's policy builds it). Rules:

- Each candidate gets an equal share of the budget; it runs once to warm up (its first call may
  compile or allocate), then at least ``MIN_RUNS`` timed samples and more while its share lasts.
  A sample runs the candidate back to back for about ``SAMPLE_MS`` (as many calls as fit, from
  one timed call) and counts its time per call, so that one call's launch latency and the
  timer's own resolution are not in it: a kernel of tens of microseconds is timed as the device
  runs it in a step, not as one call waited on. Its time is the median. On CUDA the samples are
  timed with events, on a synchronized stream.
- A candidate that raises is out of the race (its error is logged); so is one whose warm-up alone
  spends more than ``WARMUP_SHARES`` times the candidate's share (too slow to time within the
  budget; a first call's one-time set-up below that is allowed).
- Times are compared by :func:`winner`: the rule's choice keeps its place unless another is
  faster by more than ``MARGIN`` (ties and noise go to the rule).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from typing import Any, Callable

import torch

from .. import compat

log = logging.getLogger(__name__)

MIN_RUNS = 3
MAX_RUNS = 50
SAMPLE_MS = 1.0  # a sample's length: calls back to back (at most MAX_CALLS_PER_SAMPLE)
MAX_CALLS_PER_SAMPLE = 100
WARMUP_SHARES = 10
MARGIN = 0.03  # another kernel must be >3% faster than the rule's choice to replace it


def _sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


def run_ms(fn: Callable[[], Any], device_type: str) -> float:
    """One run of ``fn`` in milliseconds: CUDA events on a GPU, the wall clock elsewhere."""
    if device_type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)
    t = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t)


def time_ms(fn: Callable[[], Any], device_type: str, budget_ms: float) -> float | None:
    """The median time of ``fn`` in milliseconds, or None when it raised or its warm-up overran."""
    try:
        t0 = time.perf_counter()
        fn()
        _sync(device_type)
        warm_ms = 1e3 * (time.perf_counter() - t0)
        if warm_ms > WARMUP_SHARES * budget_ms:
            log.info("enn registry: warm-up took %.1f ms, over %d times its share of %.1f ms: not timed", warm_ms,
                     WARMUP_SHARES, budget_ms)
            return None
        calls = max(1, min(MAX_CALLS_PER_SAMPLE, math.ceil(SAMPLE_MS / max(run_ms(fn, device_type), 1e-3))))

        def sample() -> None:
            for _ in range(calls):
                fn()

        samples: list[float] = []
        start = time.perf_counter()
        while len(samples) < MIN_RUNS or (len(samples) < MAX_RUNS and 1e3 * (time.perf_counter() - start) < budget_ms):
            samples.append(run_ms(sample, device_type) / calls)
        return statistics.median(samples)
    except Exception as exc:  # noqa: BLE001 - a kernel that fails here is simply not chosen
        log.info("enn registry: candidate raised while timed (%s: %s)", type(exc).__name__, str(exc)[:200])
        return None


def measure(runs: dict[str, Callable[[], Any]], device_type: str, budget_ms: float) -> dict[str, float]:
    """Median ms of each candidate that could be timed (``runs``: kernel name -> call)."""
    share = budget_ms / max(len(runs), 1)
    with compat.real_tensor_mode(), torch.no_grad():  # a pass runs inside the compile's FakeTensorMode
        out = {name: time_ms(fn, device_type, share) for name, fn in runs.items()}
    return {k: v for k, v in out.items() if v is not None}


def winner(rule: str, timings: dict[str, float]) -> str:
    """The fastest candidate, unless the rule's choice is within ``MARGIN`` of it."""
    if rule not in timings or not timings:
        return rule
    best = min(timings, key=timings.__getitem__)
    return best if timings[best] < timings[rule] * (1 - MARGIN) else rule
