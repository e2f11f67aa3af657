"""Cold and warm compile of one training workload, and what AOT Autograd's cache did.

For each variant, a fresh process with an empty Inductor cache folder compiles the workload
(first training step: forward, backward, optimizer) and times that step, then a warm start in
the same process (Dynamo reset, Inductor's in-memory caches dropped, the disk caches kept)
times it again, and prints AOT Autograd's cache counters (hit / miss / saved) and Inductor's FX
graph cache counters for each start. The steady step time after each start is printed too
(median of 21 steps), so a faster warm start can be told from a slower step.

Run:  python bench/gpu_warm_start.py [--only timm_vit_small] [--variants "inductor,enn,enn no pch"]
      (bench/results/gpu-h100/warm_start_*.log)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("inductor", "enn", "enn backward python wrapper", "enn no pch", "enn wrapper O0")
OPTIONS = {"enn no pch": {"cpp_cache_precompile_headers": False},  # the C++ wrappers without a precompiled header
           "enn wrapper O0": {"aot_inductor.compile_wrapper_opt_level": "O0"}}  # ... compiled unoptimized (O1 by default)


def one(name: str, variant: str) -> dict:
    """Cold then warm start of ``name`` (training) under ``variant``, in this process."""
    import torch

    import enn_backend
    from enn_backend import compat, graph_compiler, models
    from enn_backend.bench.steps import autocast, timed_step

    if variant == "enn backward python wrapper":  # the backward built when AOT Autograd asks
        graph_compiler.GraphCompiler.waits_for_first_call = property(lambda self: False)
    backend = "inductor" if variant == "inductor" else "enn"
    out = {}
    for start in ("cold", "warm"):
        torch._dynamo.reset()
        enn_backend.reset()
        compat.clear_inductor_memory_caches()
        compat.dynamo_counters.clear()
        entry = models.build(name, "gpu-real", device="cuda", seed=0)
        opt = torch.optim.AdamW(entry.model.parameters(), lr=1e-4)
        fn = torch.compile(entry.model, backend=backend, options=OPTIONS.get(variant))
        step = timed_step(fn, opt, entry.make_inputs(0), entry.loss_fn, "train", autocast("cuda", "bf16"))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        for _ in range(25):  # past enn's guard warm-up
            step()
        times = []
        for _ in range(21):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        aot = dict(compat.dynamo_counters["aot_autograd"])
        fx = dict(compat.dynamo_counters["inductor"])
        out[start] = {"first_step_s": round(first, 2), "step_ms": round(statistics.median(times), 3),
                      "aot": {k: v for k, v in aot.items() if "cache" in k},
                      "fx": {k: v for k, v in fx.items() if "fxgraph_cache" in k}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="timm_vit_small")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--one", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one(*a.one)))
        return
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for name in a.only.split(","):
        for variant in a.variants.split(","):
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
                proc = subprocess.run([sys.executable, __file__, "--one", name, variant], env=env,
                                      capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(f"{name} train {variant}: failed\n{proc.stderr[-2000:]}")
                continue
            res = json.loads(line[len("RESULT "):])
            for start, r in res.items():
                print(f"{name} train {variant:<28} {start}: first step {r['first_step_s']:7.2f} s, "
                      f"then {r['step_ms']:7.3f} ms/step; AOT cache {r['aot']}; FX graph cache {r['fx']}")


if __name__ == "__main__":
    main()
