"""Per-call cost of enn at a launch-bound size: one attention, forward + backward, T=1024.

The same direct SDPA function compiled by Inductor and by enn, the hand-written causal pattern
compiled by enn (with and without its guard), and eager SDPA, timed interleaved in one process
(do_bench, 10 rounds). At this size the step is bound by the host, so the differences are
per-call costs, not kernels (every compiled variant runs the same cuDNN kernels).

Run:  python bench/gpu_host_overhead.py      (bench/results/gpu-h100/host_overhead.log)
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_attention import causal, sdpa_causal  # noqa: E402  (the benchmark's own functions)

import enn_backend  # noqa: E402,F401  (registers backend="enn")


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    from triton.testing import do_bench

    torch._dynamo.config.recompile_limit = 64  # several compiles of one function
    q, k, v = (torch.randn(4, 16, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    fns = {
        "eager sdpa": sdpa_causal,
        "inductor sdpa": torch.compile(sdpa_causal, backend="inductor", dynamic=False),
        "enn sdpa": torch.compile(sdpa_causal, backend="enn", dynamic=False),
        "enn causal": torch.compile(causal, backend="enn", dynamic=False),
        "enn causal guard off": torch.compile(causal, backend="enn", dynamic=False, options={"guard": "off"}),
    }

    def make_step(fn):
        def step():
            for a in (q, k, v):
                a.grad = None
            out = fn(q, k, v)
            out.backward(torch.ones_like(out))
        return step

    steps = {name: make_step(fn) for name, fn in fns.items()}
    for step in steps.values():
        for _ in range(30):  # compile, then past enn's guard warm-up
            step()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(10):
        for name, step in steps.items():
            times[name].append(do_bench(step, warmup=5, rep=50, return_mode="median"))
    for name, ts in times.items():
        print(f"{name:<22} fwd+bwd {statistics.median(ts):.3f} ms (T=1024, B4 H16 D64 bf16)")


if __name__ == "__main__":
    main()
