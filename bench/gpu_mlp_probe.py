"""Why is the zoo's MLP inference step slower under enn than under Inductor in the suite?

Compiles the zoo MLP (gpu-real size, bf16 autocast, no_grad) with both backends in one
process, in the order given, each into its own empty Inductor cache with Inductor's in-memory
caches cleared, prints the launch config Inductor's pointwise autotuning chose for each GELU
kernel, times both interleaved (20 rounds) and profiles each backend's kernels. Steps, caches
and timing are the benchmark suite's own (enn_backend.bench.steps / backends / timing).

Run:  python bench/gpu_mlp_probe.py enn,inductor
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from functools import partial

import torch

from enn_backend import models
from enn_backend.bench.backends import cache_dir, compile_with
from enn_backend.bench.steps import autocast, timed_step
from enn_backend.bench.timing import Timer, paired_ratio, steady_state_warmup


def _gelu_configs() -> list[str]:
    """The launch config of every loaded GELU kernel (CachingAutotuner.launchers after autotuning)."""
    from torch._inductor.codecache import PyCodeCache

    found = []
    for mod in list(PyCodeCache.modules):
        for name, obj in vars(mod).items():
            if "gelu" in name and hasattr(obj, "launchers"):
                found.extend(f"{name}: {launcher.config}" for launcher in obj.launchers)
    return found


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    entry = models.build("mlp", "gpu-real", device="cuda")
    model = entry.model.eval()
    batch = entry.make_inputs(0)
    step = partial(timed_step, opt=None, batch=batch, loss_fn=entry.loss_fn, mode="infer",
                   autocast=autocast("cuda", "bf16"))

    order = (sys.argv[1] if len(sys.argv) > 1 else "enn,inductor").split(",")
    root = tempfile.mkdtemp(prefix="mlp-probe-")
    compiled = {}
    for backend in order:
        torch.compiler.reset()
        with cache_dir(os.path.join(root, backend)):
            run = step(compile_with(model, {"backend": backend}))
            for _ in range(steady_state_warmup()):  # compiles, then runs past enn's guard warm-up
                run()
            torch.cuda.synchronize()
            compiled[backend] = run
            for line in _gelu_configs():
                print(f"{backend:<9} {line}")

    times = Timer("cuda", rounds=20, rep_ms=100.0).measure(compiled)
    for b, ts in times.items():
        print(f"{b:<9} median {statistics.median(ts):.4f} ms  min {min(ts):.4f}  max {max(ts):.4f}")
    print(f"enn / inductor speedup (median of per-round ratios): {paired_ratio(times['inductor'], times['enn']):.3f}")

    for b, run in compiled.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                run()
            torch.cuda.synchronize()
        gelu = [e for e in prof.key_averages() if "gelu" in e.key]
        for ev in gelu:
            print(f"  {b:<9} {ev.key[:40]:<40} {ev.count / 10:4.1f} calls/step {ev.device_time_total / 10 / 1000:8.4f} ms/step")


if __name__ == "__main__":
    main()
