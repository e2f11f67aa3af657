"""Why is the zoo's MLP inference step slower under enn than under Inductor in the suite?

Compiles the zoo MLP (gpu-real size, bf16 autocast, no_grad) with both backends in one
process, in the order given, each into its own empty Inductor cache with Inductor's in-memory
caches cleared (as the benchmark suite does), prints the launch config Inductor's pointwise
autotuning chose for each GELU kernel, times both interleaved (do_bench, 20 rounds) and
profiles each backend's kernels.

Run:  python bench/gpu_mlp_probe.py enn,inductor
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

import torch

import enn_backend  # noqa: F401  (registers backend="enn")
from enn_backend import compat
from enn_backend import models


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
    import triton.testing

    spec = models.MODELS["mlp"]
    entry = spec.builder(torch.device("cuda"), **spec.sizes["gpu-real"])
    model = entry.model.eval()
    batch = entry.make_inputs(0)

    def step(fn):
        def run():
            with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
                fn(*batch.args)
        return run

    order = (sys.argv[1] if len(sys.argv) > 1 else "enn,inductor").split(",")
    root = tempfile.mkdtemp(prefix="mlp-probe-")
    compiled = {}
    for backend in order:
        torch.compiler.reset()
        compat.clear_inductor_memory_caches()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, backend)
        os.environ["TRITON_CACHE_DIR"] = os.path.join(root, backend, "triton")
        fn = torch.compile(model, backend=backend)
        for _ in range(60):  # past enn's guard warm-up
            step(fn)()
        torch.cuda.synchronize()
        compiled[backend] = fn
        for line in _gelu_configs():
            print(f"{backend:<9} {line}")

    times: dict[str, list[float]] = {b: [] for b in compiled}
    for r in range(20):
        for b in (order if r % 2 == 0 else order[::-1]):
            times[b].append(triton.testing.do_bench(step(compiled[b]), warmup=25, rep=100))
    for b, ts in times.items():
        print(f"{b:<9} median {statistics.median(ts):.4f} ms  min {min(ts):.4f}  max {max(ts):.4f}")
    ratios = [i / e for i, e in zip(times["inductor"], times["enn"])]
    print(f"enn / inductor speedup (median of per-round ratios): {statistics.median(ratios):.3f}")

    for b, fn in compiled.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                step(fn)()
            torch.cuda.synchronize()
        gelu = [e for e in prof.key_averages() if "gelu" in e.key]
        for ev in gelu:
            print(f"  {b:<9} {ev.key[:40]:<40} {ev.count / 10:4.1f} calls/step {ev.device_time_total / 10 / 1000:8.4f} ms/step")


if __name__ == "__main__":
    main()
