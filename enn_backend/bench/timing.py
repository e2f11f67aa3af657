"""How the benchmark measures: interleaved timing rounds, paired ratios, peak memory, profiles.

Every backend first runs untimed steps past enn's guard warm-up (the guard checks each of a
graph's first ``guard_warmup`` calls with a host sync; that one-time cost is not the steady
state, and ``bench/guard_overhead.py`` measures the guard itself); then the callables are timed
in rounds, interleaved, the order rotated each round, so that drift (thermal, other
processes) does not favour one of them; Python's garbage collector is paused while they run.
GPU: ``triton.testing.do_bench`` (CUDA events, L2 flushed) per round; CPU, or a fixed number of
steps per sample: the wall clock of a batch of steps.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile as torch_profile

from ..options import Options


def sync(device: str | torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def steady_state_warmup() -> int:
    """Untimed steps before timing: past the calls of each graph enn's guard checks one by one
    (``guard_warmup``, from options + env), so timings are the steady state for every backend."""
    return Options.from_sources(None, None).guard_warmup + 2


class Timer:
    """Step times of several callables, measured interleaved in rounds (one sample per callable
    per round, in ms per step).

    ``steps_per_sample`` fixes how many steps one sample times, by the wall clock on every
    device; without it a CPU sample is as many steps as fill ``sample_s`` and a CUDA sample is
    one ``do_bench`` of ``rep_ms`` (its median).
    """

    def __init__(self, device: str | torch.device, *, rounds: int = 5, warmup: int = 3, sample_s: float = 0.05,
                 rep_ms: float = 40.0, steps_per_sample: int | None = None) -> None:
        self.device = device
        self.rounds, self.warmup, self.sample_s, self.rep_ms = rounds, warmup, sample_s, rep_ms
        self.steps_per_sample = steps_per_sample
        self.cuda = torch.device(device).type == "cuda"
        self._do_bench = None
        if self.cuda and steps_per_sample is None:
            try:
                from triton.testing import do_bench  # optional: Triton comes with CUDA builds of torch

                self._do_bench = do_bench
            except ImportError:
                self._do_bench = None
        if not self.cuda or steps_per_sample is not None:
            self.method = "wall clock"
        else:
            self.method = "triton.testing.do_bench" if self._do_bench else "CUDA events"

    def _wall_sample(self, fn: Callable[[], Any], n: int) -> float:
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync(self.device)
        return (time.perf_counter() - t0) * 1e3 / n

    def _cuda_sample(self, fn: Callable[[], Any]) -> float:
        if self._do_bench is not None:
            try:
                return float(self._do_bench(fn, warmup=5, rep=self.rep_ms, return_mode="median"))
            except TypeError:  # a Triton without return_mode: quantiles=[0.5] is the median
                return float(self._do_bench(fn, warmup=5, rep=self.rep_ms, quantiles=[0.5]))
        n = 10
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n

    def measure(self, fns: dict[str, Callable[[], Any]]) -> dict[str, list[float]]:
        names = list(fns)
        steps = max(self.warmup, steady_state_warmup())  # the same for every backend
        for name in names:  # warm up (autotuning, allocator, caches, enn's guard warm-up) before any timed round
            for _ in range(steps):
                fns[name]()
        sync(self.device)
        wall = self.steps_per_sample is not None or not self.cuda
        reps = dict.fromkeys(names, self.steps_per_sample)
        if self.steps_per_sample is None and not self.cuda:  # enough steps per sample for ~sample_s of wall time
            for name in names:
                t = max(self._wall_sample(fns[name], 1), 1e-3) / 1e3
                reps[name] = max(1, min(200, math.ceil(self.sample_s / t)))
        samples: dict[str, list[float]] = {n: [] for n in names}
        gc.collect()
        gc.disable()  # a collection pause lands on whichever callable runs then: keep it out of the rounds
        try:
            for r in range(self.rounds):
                order = names[r % len(names):] + names[: r % len(names)]
                for name in order:
                    samples[name].append(self._wall_sample(fns[name], reps[name]) if wall
                                         else self._cuda_sample(fns[name]))
        finally:
            gc.enable()
        return samples


def paired_ratio(slow: list[float], fast: list[float]) -> float:
    """Median over rounds of ``slow[r] / fast[r]``.

    The two samples of one round were taken back to back, so they share that
    moment's noise (another process, clocks); the median of the per-round ratios
    is steadier than the ratio of two medians on a shared machine.
    """
    return statistics.median(a / b for a, b in zip(slow, fast) if a > 0 and b > 0)


def spread_pct(samples: list[float]) -> float:
    """The interquartile range of ``samples`` as a percentage of their median (the full range
    below four samples)."""
    lo, hi = (statistics.quantiles(samples, n=4)[::2] if len(samples) >= 4 else (min(samples), max(samples)))
    return (hi - lo) / statistics.median(samples) * 100


def speed_verdict(slow: list[float], fast: list[float], slow_name: str, fast_name: str) -> str:
    """One line on how ``fast`` compares with ``slow`` (per-round step times, interleaved). A
    verdict needs a difference the spread cannot explain: at least 5 rounds, every one of them
    agreeing on which is faster (under noise alone, 5 agreeing rounds happen 1 time in 16; the
    interquartile range alone calls a difference on identical code 1 run in 2 or 3). Otherwise
    the machine was too noisy to tell them apart."""
    ratios = [a / b for a, b in zip(slow, fast) if a > 0 and b > 0]
    mid = statistics.median(ratios)
    lo, hi = min(ratios), max(ratios)
    if len(ratios) < 5 or lo <= 1.0 <= hi:
        return (f"too noisy to tell {fast_name} from {slow_name} here: per round {fast_name} ran "
                f"{lo:.2f}x-{hi:.2f}x {slow_name}'s speed (median {mid:.2f}x over {len(ratios)} rounds)")
    return f"{fast_name} ran {mid:.2f}x {slow_name}'s speed (every one of {len(ratios)} rounds: {lo:.2f}x-{hi:.2f}x)"


def peak_mem_mb(fn: Callable[[], Any], device: str | torch.device) -> float | None:
    """CUDA: the most memory one call of ``fn`` allocates above what was allocated before it (MiB);
    None on the CPU (not measured)."""
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def profile(fns: dict[str, Callable[[], Any]], device: str, steps: int = 0, top: int = 8) -> dict[str, Any]:
    """Top operators/kernels by self time per step, and calls per step of every operator, per callable."""
    cuda = torch.device(device).type == "cuda"
    steps = steps or (5 if cuda else 10)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out: dict[str, Any] = {}
    for name, fn in fns.items():
        fn()
        sync(device)
        with torch_profile(activities=acts) as prof:
            for _ in range(steps):
                fn()
            sync(device)
        # On CUDA a kernel's time shows twice: on the kernel's own (device) event and as the
        # device time of the CPU-side op or launcher that issued it. Time counts kernels only;
        # call counts come from every event (operators, launches and kernels).
        timed, calls = [], {}
        for ev in prof.key_averages():
            calls[ev.key[:90]] = ev.count / steps
            if cuda and ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            if getattr(ev, "is_user_annotation", False):
                continue  # a record_function range drawn on the GPU timeline (e.g. the optimizer step): not a kernel
            dev_t = getattr(ev, "self_device_time_total", None)
            if dev_t is None:
                dev_t = getattr(ev, "self_cuda_time_total", 0.0)
            t = dev_t if cuda else ev.self_cpu_time_total
            timed.append({"name": ev.key[:90], "calls_per_step": ev.count / steps, "self_ms_per_step": t / 1e3 / steps})
        timed.sort(key=lambda r: -r["self_ms_per_step"])
        out[name] = {"clock": "device" if cuda else "cpu", "steps": steps,
                     "total_ms_per_step": sum(r["self_ms_per_step"] for r in timed),
                     "top": [r for r in timed if r["self_ms_per_step"] > 0][:top],
                     "calls": calls}
    return out
