"""Cost of enn's runtime guard: the same model compiled with guard off / exceptions / nonfinite
(every call and every 10th call) and plain Inductor, timed side by side in one process.

    python bench/guard_overhead.py                 # CPU: GPT-2-style model, cpu-small size
    python bench/guard_overhead.py --device cuda   # GPU: GPT-2-style 6-block stack, bf16 autocast

Steps and timing are the benchmark suite's (enn_backend.bench.steps / timing): rounds are
interleaved with the order rotated each round; the result per variant is the median over
rounds of the mean step time in the round. Peak memory (GPU) is that of one step above what
was allocated before it. Prints a table; writes JSON to $OUT/guard_overhead.json (or --out).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics

import torch

from enn_backend import models
from enn_backend.bench.backends import compile_with
from enn_backend.bench.steps import autocast, timed_step
from enn_backend.bench.timing import Timer, peak_mem_mb
from enn_backend.report import atomic_write_text

VARIANTS = {
    "inductor": dict(backend="inductor"),
    "enn guard=off": dict(backend="enn", options={"guard": "off"}),
    "enn guard=exceptions": dict(backend="enn", options={"guard": "exceptions"}),
    "enn nonfinite every call": dict(backend="enn", options={"guard": "nonfinite", "guard_every": 1, "guard_warmup": 0}),
    "enn nonfinite every 10": dict(backend="enn", options={"guard": "nonfinite", "guard_every": 10, "guard_warmup": 0}),
    "enn nonfinite every 50": dict(backend="enn", options={"guard": "nonfinite", "guard_every": 50, "guard_warmup": 0}),
    "enn values every 50": dict(backend="enn", options={"guard": "values", "guard_every": 50, "guard_warmup": 0}),
    "enn defaults": dict(backend="enn"),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="gpt2_sdpa")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--mode", default="train", choices=("train", "infer"))
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    dev = torch.device(args.device)
    gpu = dev.type == "cuda"
    size, dtype = ("gpu-real", "bf16") if gpu else ("cpu-small", "fp32")
    model, make_inputs, loss_fn = models.build(args.model, size, device=dev)
    batch = make_inputs()

    steps = {}
    for name, kw in VARIANTS.items():
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4) if args.mode == "train" else None
        steps[name] = timed_step(compile_with(m, kw), opt, batch, loss_fn, args.mode, autocast(dev, dtype))

    # past the guard's warm-up: the steady state is measured; a sample is --steps steps (the
    # sampled checks of every 10th / 50th call fall inside it), by the wall clock
    times = Timer(dev, rounds=args.rounds, steps_per_sample=args.steps).measure(steps)
    peak_mib = {n: peak_mem_mb(step, dev) for n, step in steps.items()}  # GPU: the guard's copies show here
    med = {n: statistics.median(v) for n, v in times.items()}
    # the mean counts every step, the sampled checks included (a median of rounds can skip them)
    mean = {n: statistics.fmean(v) for n, v in times.items()}
    spread = {n: (max(v) - min(v)) / statistics.median(v) for n, v in times.items()}
    base = med["enn guard=off"]
    print(f"guard overhead, {args.model} {size} {args.mode} on {dev} ({'bf16 autocast' if gpu else 'fp32'}), "
          f"median of {args.rounds} rounds x {args.steps} steps")
    print(f"{'variant':<32} {'ms/step':>9} {'vs guard=off':>13} {'mean vs off':>12} {'vs inductor':>12} "
          f"{'spread':>7} {'peak MiB':>9}")
    for n in steps:
        print(f"{n:<32} {med[n]:9.3f} {100 * (med[n] / base - 1):+12.1f}% "
              f"{100 * (mean[n] / mean['enn guard=off'] - 1):+11.1f}% {med['inductor'] / med[n]:11.3f}x "
              f"{100 * spread[n]:6.1f}% {'-' if peak_mib[n] is None else f'{peak_mib[n]:.0f}':>9}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        atomic_write_text(os.path.join(args.out, "guard_overhead.json"), json.dumps(
            {"device": str(dev), "model": args.model, "size": size, "mode": args.mode,
             "times_ms": times, "median_ms": med, "mean_ms": mean, "peak_mib": peak_mib, "torch": torch.__version__,
             "gpu": torch.cuda.get_device_name() if gpu else None}, indent=1))


if __name__ == "__main__":
    main()
