"""Where a host-bound step spends its host time, Inductor vs enn: torch.profiler's CPU ops and
cProfile's Python functions for one real-suite workload (default: HF T5 inference, gpu-real, bf16).

Run:  python bench/gpu_host_profile_t5.py [--workload hf_t5:infer]   (bench/results/gpu-h100/host_profile_t5.log)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import enn_backend  # noqa: F401  (registers backend="enn")
from enn_backend import models
from enn_backend.bench.steps import autocast, timed_step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="hf_t5:infer")
    ap.add_argument("--steps", type=int, default=50)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    from torch.profiler import ProfilerActivity, profile

    name, mode = a.workload.split(":")
    steps = {}
    for be in ("inductor", "enn"):
        e = models.build(name, "gpu-real", device="cuda", seed=0)
        m = e.model if mode == "train" else e.model.eval()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4) if mode == "train" else None
        steps[be] = timed_step(torch.compile(m, backend=be), opt, e.make_inputs(0), e.loss_fn, mode,
                               autocast("cuda", "bf16"))
        for _ in range(60):
            steps[be]()
    torch.cuda.synchronize()
    for rnd in range(3):  # interleaved: host time per step, the device kept busy
        for be, step in steps.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(a.steps):
                step()
            host = (time.perf_counter() - t) / a.steps * 1e3
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t) / a.steps * 1e3
            print(f"round {rnd} {be:<9} host (launch) {host:.3f} ms/step, wall {wall:.3f} ms/step")
    for be, step in steps.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(a.steps):
                step()
        torch.cuda.synchronize()
        print(f"\n===== {be}: CPU ops by self time, per step")
        rows = sorted(prof.key_averages(), key=lambda r: -r.self_cpu_time_total)[:22]
        for r in rows:
            print(f"  {r.key[:70]:<70} calls {r.count / a.steps:6.1f}  self {r.self_cpu_time_total / a.steps:8.1f} us")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.steps):
            step()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
        print(f"\n===== {be}: Python functions by own time ({a.steps} steps)")
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:5000])


if __name__ == "__main__":
    main()
