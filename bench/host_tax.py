"""enn's per-call host cost: a graph so small that a call is all host time (a 3-layer MLP on a
[4, 8] input), compiled by Inductor and by enn (defaults; the guard's fast path alone, i.e. no
scheduled checks; guard off), timed interleaved by the wall clock, inference and training
(forward + backward: two graph calls per step).

    python bench/host_tax.py [--device cpu|cuda] [--rounds 21] [--steps 200]

Prints per variant the median microseconds per step, the difference to Inductor and the spread
(the interquartile range over rounds, as a share of the median), and the same difference between
the fastest rounds: a fixed per-call cost shows in every round, while the machine's noise only
ever adds time, so the minimum over many rounds reads a few microseconds where the median cannot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch
import torch.nn as nn

from enn_backend.bench.backends import cache_dir, compile_with
from enn_backend.bench.timing import Timer

VARIANTS = {
    "inductor": dict(backend="inductor"),
    "enn defaults": dict(backend="enn"),
    "enn fast path only": dict(backend="enn", options={"guard_every": 10**9, "guard_values": 0}),
    "enn guard=off": dict(backend="enn", options={"guard": "off"}),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    torch.set_num_threads(1)
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
                print(f"  {name:20s} {med:9.2f} us  {med - base:+8.2f} us vs inductor  IQR {rows[f'{mode}/{name}']['iqr_pct']}%"
                      f"  | fastest round {min(us):9.2f} us  {min(us) - base_min:+8.2f} us vs inductor's")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"host_tax_{dev.type}.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
