"""Cost of enn's runtime guard: the same model compiled with guard off / exceptions / nonfinite
(every call and every 10th call) and plain Inductor, timed side by side in one process.

    python bench/guard_overhead.py                 # CPU: GPT-2-style model, cpu-small size
    python bench/guard_overhead.py --device cuda   # GPU: GPT-2-style 6-block stack, bf16 autocast

Rounds are interleaved with the order rotated each round; the result per variant is the
median over rounds of the mean step time in the round. Prints a table; writes JSON to
$OUT/guard_overhead.json (or --out).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch

from enn_backend.bench import zoo

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
    size = "gpu-real" if gpu else "cpu-small"
    amp = torch.bfloat16 if gpu else None
    model, make_inputs, loss_fn = zoo.build(args.model, size, device=dev)
    batch = make_inputs()

    steps = {}
    for name, kw in VARIANTS.items():
        m = copy.deepcopy(model)
        fn = torch.compile(m, **kw)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4) if args.mode == "train" else None

        def step(fn=fn, m=m, opt=opt):
            if opt is None:
                with torch.no_grad(), torch.autocast(dev.type, dtype=amp or torch.float32, enabled=amp is not None):
                    return fn(*batch.args)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=amp or torch.float32, enabled=amp is not None):
                loss = loss_fn(fn(*batch.args), batch.target)
            loss.backward()
            opt.step()

        for _ in range(25):  # past the guard's warm-up (20 checked calls): the steady state is measured
            step()
        steps[name] = step

    def sync():
        if gpu:
            torch.cuda.synchronize()

    times = {n: [] for n in steps}
    peak_mib = {n: 0.0 for n in steps}  # GPU: peak allocated memory of a round (the guard's copies show here)
    names = list(steps)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            sync()
            if gpu:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                steps[n]()
            sync()
            times[n].append(1e3 * (time.perf_counter() - t0) / args.steps)
            if gpu:
                peak_mib[n] = max(peak_mib[n], torch.cuda.max_memory_allocated() / 2**20)
    med = {n: statistics.median(v) for n, v in times.items()}
    # the mean counts every step, the sampled checks included (a median of rounds can skip them)
    mean = {n: statistics.fmean(v) for n, v in times.items()}
    spread = {n: (max(v) - min(v)) / statistics.median(v) for n, v in times.items()}
    base = med["enn guard=off"]
    print(f"guard overhead, {args.model} {size} {args.mode} on {dev} ({'bf16 autocast' if amp else 'fp32'}), "
          f"median of {args.rounds} rounds x {args.steps} steps")
    print(f"{'variant':<32} {'ms/step':>9} {'vs guard=off':>13} {'mean vs off':>12} {'vs inductor':>12} "
          f"{'spread':>7} {'peak MiB':>9}")
    for n in names:
        print(f"{n:<32} {med[n]:9.3f} {100 * (med[n] / base - 1):+12.1f}% "
              f"{100 * (mean[n] / mean['enn guard=off'] - 1):+11.1f}% {med['inductor'] / med[n]:11.3f}x "
              f"{100 * spread[n]:6.1f}% {peak_mib[n]:9.0f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "guard_overhead.json"), "w") as f:
            json.dump({"device": str(dev), "model": args.model, "size": size, "mode": args.mode,
                       "times_ms": times, "median_ms": med, "mean_ms": mean, "peak_mib": peak_mib, "torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name() if gpu else None}, f, indent=1)


if __name__ == "__main__":
    main()
