"""Where a steady-state screen's time goes in a decode-sized step, with and without CUDA graphs.

    python bench/gpu_decode_screen_cost.py [--steps 400]

bench/gpu_decode_cudagraphs.py's HF LLaMA decode step (batch 8, one token), compiled by Inductor
and by enn, each with and without ``reduce-overhead``. After the guard's warm-up every step is
timed alone (synchronized before and after) and grouped by what the guard's schedule made of the
graph's call: a screened call (every ``guard_every``-th: the screen is launched on the device),
the call after it (which reads that screen back), and the bare calls between. The host time of
the screen's own parts -- LateScreen's construction (its kernels and the pinned copy), the read
back -- is measured inside the process by wrapping them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import enn_backend  # noqa: E402
from enn_backend.bench.backends import compile_with  # noqa: E402
from enn_backend.guard import runtime as R  # noqa: E402
from enn_backend.options import Options  # noqa: E402
from gpu_decode_cudagraphs import build  # noqa: E402

VARIANTS = {
    "inductor reduce-overhead": dict(backend="inductor", mode="reduce-overhead"),
    "enn reduce-overhead": dict(backend="enn", options={"mode": "reduce-overhead"}),
    "inductor": dict(backend="inductor"),
    "enn": dict(backend="enn"),
}

parts: dict[str, list[float]] = defaultdict(list)


def _timed(name: str, fn):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            parts[name].append((time.perf_counter() - t0) * 1e6)
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=120)
    args = ap.parse_args()
    torch._dynamo.config.recompile_limit = 64
    R.LateScreen = _timed("LateScreen(...)", R.LateScreen)
    R.GuardedGraph._read_late = _timed("_read_late", R.GuardedGraph._read_late)
    every = Options.from_sources(None, None).guard_every
    model, ids = build(8, 1)
    print(f"{args.steps} steps timed one by one after {args.warmup}; guard_every {every}; median us per step\n")
    print("| variant | bare calls | screened call | the call after (reads it) | amortized over guard_every |"
          "\n|---|---|---|---|---|")
    for name, kw in VARIANTS.items():
        torch._dynamo.reset()
        enn_backend.reset()
        fn = compile_with(model, kw)
        with torch.no_grad():
            for _ in range(args.warmup):
                fn(input_ids=ids)
            recs = list(enn_backend.report().graphs)
            kinds: dict[str, list[float]] = defaultdict(list)
            parts.clear()
            for _ in range(args.steps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(input_ids=ids)
                torch.cuda.synchronize()
                us = (time.perf_counter() - t0) * 1e6
                n = recs[0].counters.get("calls", 0) if recs else None  # (Inductor: every call is bare)
                kinds["bare" if n is None or n % every > 1 else "screen" if n % every == 0 else "after"].append(us)
        med = {k: statistics.median(v) for k, v in kinds.items()}
        bare = med["bare"]
        amort = (sum(med.get(k, bare) - bare for k in ("screen", "after"))) / every if recs else 0.0
        print(f"| {name} | {bare:.1f} | {med.get('screen', float('nan')):.1f} | {med.get('after', float('nan')):.1f} "
              f"| +{amort:.1f} |")
        for part, xs in parts.items():
            print(f"|   {name}: {part} host time | {statistics.median(xs):.1f} (max {max(xs):.1f}, {len(xs)} calls) | | | |")


if __name__ == "__main__":
    main()
