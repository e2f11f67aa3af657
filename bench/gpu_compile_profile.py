"""Where the cold compile time goes, enn vs inductor, for one zoo workload on the GPU.

Compiles the workload's first training step (forward + backward) into an empty Inductor cache
per backend (as the benchmark suite does: enn_backend.bench.backends.cache_dir) and prints
torch._dynamo.utils.compile_times() (seconds per compiler phase) and the wall time, so a slow
compile can be traced to the phase that takes it.

Run:  python bench/gpu_compile_profile.py alibi train
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from torch._dynamo.utils import compile_times  # torch's own per-phase timers (no public API)

from enn_backend import models
from enn_backend.bench.backends import cache_dir, compile_with, warm_up_compiler


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="bench/gpu_compile_profile.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="alibi", help="a zoo or real-suite model (default: alibi)")
    ap.add_argument("mode", nargs="?", default="train", choices=("train", "infer"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    name, mode = args.model, args.mode
    root = tempfile.mkdtemp(prefix="compile-profile-")
    warm_up_compiler("cuda", root, ["inductor", "enn"])  # once-per-process costs, paid before either backend
    for backend in ("inductor", "enn"):
        torch.compiler.reset()
        torch._dynamo.utils.compilation_time_metrics.clear()  # per backend, not accumulated
        model, make_inputs, loss_fn = models.build(name, "gpu-real", device="cuda", seed=0)
        model.train(mode == "train")
        batch = make_inputs(0)
        with cache_dir(os.path.join(root, backend)):
            fn = compile_with(model, {"backend": backend})
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast("cuda", torch.bfloat16), torch.set_grad_enabled(mode == "train"):
                out = fn(*batch.args)
                if mode == "train":
                    loss_fn(out, batch.target).backward()
            torch.cuda.synchronize()
        print(f"=== {backend}: {name} {mode} cold compile {time.perf_counter() - t0:.2f} s")
        print(compile_times(repr="str", aggregate=True))


if __name__ == "__main__":
    main()
