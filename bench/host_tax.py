"""enn's per-call host cost: a graph so small that a call is all host time (a 3-layer MLP on a
[4, 8] input), compiled by Inductor and by enn, timed interleaved by the wall clock, inference and
training (forward + backward: two graph calls per step). enn variants: defaults; screens only
(``guard_values=0``: no value checks, and so no Dynamo-graph reference either); value checks only
(``guard_every=10**9``: value checks and the Dynamo-graph reference on their schedule, no NaN/Inf
screens past the warm-up); the guard's fast path alone (neither); guard off.

    python bench/host_tax.py [--device cpu|cuda] [--rounds 21] [--steps 200] [--per-call 5000]

Prints per variant the median microseconds per step, the difference to Inductor and the spread
(the interquartile range over rounds, as a share of the median), and the same difference between
the fastest rounds: a fixed per-call cost shows in every round, while the machine's noise only
ever adds time, so the minimum over many rounds reads a few microseconds where the median cannot.

Then, per mode, enn's defaults step by step (``--per-call`` steps, each timed alone, after
Inductor's the same way): the steps grouped by what the guard's schedule made of the graph's call
-- a bare call, a NaN/Inf screen (every ``guard_every``-th call), a value check with the
Dynamo-graph reference (every ``guard_values``-th) -- with their median time, and each kind's
cost above a bare call, amortized over the calls at the default schedule.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.nn as nn

from enn_backend import report
from enn_backend.bench.backends import cache_dir, compile_with
from enn_backend.bench.timing import Timer, sync
from enn_backend.options import Options

VARIANTS = {
    "inductor": dict(backend="inductor"),
    "enn defaults": dict(backend="enn"),
    "enn screens only": dict(backend="enn", options={"guard_values": 0}),
    "enn value checks only": dict(backend="enn", options={"guard_every": 10**9}),
    "enn fast path only": dict(backend="enn", options={"guard_every": 10**9, "guard_values": 0}),
    "enn guard=off": dict(backend="enn", options={"guard": "off"}),
}


def per_call(step, fn, steps: int, device: torch.device) -> dict[str, list[float]]:
    """Microseconds of each of ``steps`` steps, timed alone, grouped by what enn's guard made of
    the graph's call (by its call count, from the report; ``inductor``: every step is "bare")."""
    recs = list(report().graphs)
    before = [r.counters.get("calls", 0) for r in recs]
    step(fn)
    counted = [r for r, n in zip(recs, before) if r.counters.get("calls", 0) != n][:1]
    opts = Options.from_sources(None, None)
    kinds: dict[str, list[float]] = {"bare": [], "screen": [], "value check": []}
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter_ns()
        step(fn)
        sync(device)
        us = (time.perf_counter_ns() - t0) / 1e3
        n = counted[0].counters["calls"] if counted else 1
        kind = ("value check" if opts.guard_values and n % opts.guard_values == 0
                else "screen" if n % opts.guard_every == 0 else "bare")
        kinds[kind].append(us)
    return kinds


def print_per_call(mode: str, kinds: dict[str, list[float]], base: list[float]) -> dict[str, dict[str, float]]:
    opts = Options.from_sources(None, None)
    every = {"bare": 1, "screen": opts.guard_every, "value check": opts.guard_values}
    bare = statistics.median(kinds["bare"])
    print(f"{mode}: enn defaults step by step (median us; inductor's step {statistics.median(base):.2f} us, "
          f"enn's bare step {bare - statistics.median(base):+.2f} us)")
    rows = {}
    for kind, us in kinds.items():
        if not us:
            continue
        med = statistics.median(us)
        extra = med - bare
        rows[kind] = {"n": len(us), "us": round(med, 2), "min_us": round(min(us), 2),
                      "above_bare_us": round(extra, 2), "amortized_us": round(extra / every[kind], 2)}
        print(f"  {kind:12s} n={len(us):5d}  median {med:9.2f} us  min {min(us):9.2f} us  above a bare call "
              f"{extra:+9.2f} us  = {extra / every[kind]:+6.2f} us per call at one in {every[kind]}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--per-call", type=int, default=5000, help="steps timed one by one (0: none)")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 64  # one module, compiled once per variant and mode
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)).to(dev)
    x = torch.randn(4, 8, device=dev)
    xg = x.clone().requires_grad_(True)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp, cache_dir(tmp):
        compiled = {name: compile_with(model, kw) for name, kw in VARIANTS.items()}
        for mode in ("infer", "train"):
            def step(f, mode=mode):
                if mode == "infer":
                    with torch.no_grad():
                        return f(x)
                return f(xg).sum().backward()

            fns = {name: (lambda f=f: step(f)) for name, f in compiled.items()}
            for f in fns.values():  # past the guard's warm-up and first value checks
                for _ in range(1100):
                    f()
            samples = Timer(dev, rounds=args.rounds, steps_per_sample=args.steps).measure(fns)
            base = statistics.median(samples["inductor"]) * 1e3
            base_min = min(samples["inductor"]) * 1e3
            print(f"{mode} on {dev.type}: microseconds per step (median of {args.rounds} interleaved rounds x {args.steps} steps)")
            for name, s in samples.items():
                us = [t * 1e3 for t in s]
                med = statistics.median(us)
                q = statistics.quantiles(us, n=4)
                rows[f"{mode}/{name}"] = {"us": round(med, 2), "vs_inductor_us": round(med - base, 2),
                                          "iqr_pct": round((q[2] - q[0]) / med * 100, 1),
                                          "min_us": round(min(us), 2), "min_vs_inductor_us": round(min(us) - base_min, 2)}
                print(f"  {name:22s} {med:9.2f} us  {med - base:+8.2f} us vs inductor  IQR {rows[f'{mode}/{name}']['iqr_pct']}%"
                      f"  | fastest round {min(us):9.2f} us  {min(us) - base_min:+8.2f} us vs inductor's")
            if args.per_call:
                base_steps = per_call(step, compiled["inductor"], args.per_call, dev)["bare"]
                kinds = per_call(step, compiled["enn defaults"], args.per_call, dev)
                rows[f"{mode}/per call"] = print_per_call(mode, kinds, base_steps)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"host_tax_{dev.type}.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
