"""What a full NaN/Inf screen of every call would cost: the time of the guard's screen of a
graph's outputs against the step time, per graph phase, for a small GPT training step.

    OMP_NUM_THREADS=1 python bench/guard_screen_cost.py [--device cpu] [--steps 20]

The guard screens every call of a graph's warm-up and then every `guard_every`-th call; this
measures the screen alone (the compiled calls run unchecked) to decide that sampling rate.
"""

from __future__ import annotations

import argparse
import time

import torch

from enn_backend import models
from enn_backend.bench.steps import autocast, timed_step
from enn_backend.guard import runtime as R
from enn_backend.guard.screen import nonfinite_outputs, outputs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="gpt2_sdpa")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device(args.device)
    model, make_inputs, loss_fn = models.build(args.model, "gpu-real" if dev.type == "cuda" else "cpu-small", device=dev)
    batch = make_inputs()
    stats: dict[str, list[float]] = {}
    call = R.GuardedGraph.__call__

    def timed(self, graph_args):
        t0 = time.perf_counter()
        out = call(self, graph_args)
        t1 = time.perf_counter()
        nonfinite_outputs(out)  # the screen of a checked call (it syncs on a GPU)
        t2 = time.perf_counter()
        nbytes = sum(o.numel() * o.element_size() for o in outputs(out) if isinstance(o, torch.Tensor))
        s = stats.setdefault(self.record.phase, [0.0, 0.0, 0, 0])
        s[0], s[1], s[2], s[3] = s[0] + t1 - t0, s[1] + t2 - t1, s[2] + 1, nbytes
        return out

    R.GuardedGraph.__call__ = timed
    fn = torch.compile(model, backend="enn", options={"guard_warmup": 0, "guard_every": 10**9})
    step = timed_step(fn, torch.optim.AdamW(model.parameters(), lr=1e-4), batch, loss_fn, "train", autocast(dev, "fp32"))

    for _ in range(3):
        step()
    stats.clear()
    t = time.perf_counter()
    for _ in range(args.steps):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    per_step = (time.perf_counter() - t) / args.steps
    print(f"{args.model} {dev.type} training step: {per_step * 1e3:.2f} ms (outputs screened apart)")
    print("| graph | call ms | screen ms | outputs MB | screen / step |")
    print("|---|---|---|---|---|")
    for phase, (call_s, screen_s, n, nbytes) in stats.items():
        print(f"| {phase} | {call_s / n * 1e3:.2f} | {screen_s / n * 1e3:.3f} | {nbytes / 1e6:.2f} | "
              f"{screen_s / n / per_step * 100:.1f}% |")


if __name__ == "__main__":
    main()
