"""Where a process's first compile goes, Inductor against enn (whose CUDA graphs get Inductor's
C++ wrapper): each variant runs in a new process, one after another on the same machine, and
compiles one small training step (forward + backward). Per process it prints the first step's
wall time, the time spent in the C++ compiler (building the wrapper's precompiled header apart
from compiling wrappers), and whether the precompiled header was already on disk.

    python bench/gpu_first_compile.py                      # default variants, below
    python bench/gpu_first_compile.py --variants "enn,enn,enn fresh cache"

Variants: "inductor", "enn" (both with Inductor's default cache folder, so a later process finds
what an earlier one left there), and "<backend> fresh cache" (a new empty TORCHINDUCTOR_CACHE_DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, time
import torch
from torch._inductor import codecache, cpp_builder  # Inductor's internals: what this probe times (no public API)

spent = {"header": 0.0, "wrapper": 0.0, "header_builds": 0, "wrapper_builds": 0}
name = "run_compile_cmd" if hasattr(cpp_builder, "run_compile_cmd") else "_run_compile_cmd"
run = getattr(cpp_builder, name)  # every C++ build of Inductor's main process goes through it

def timed(cmd_line, cwd):
    kind = "header" if ".gch" in cmd_line or " -E -P " in cmd_line else "wrapper"
    t0 = time.perf_counter()
    try:
        return run(cmd_line, cwd)
    finally:
        spent[kind] += time.perf_counter() - t0
        spent[kind + "_builds"] += 1

setattr(cpp_builder, name, timed)
header_dir = getattr(codecache, "_HEADER_DIR", None)
had = sorted(os.listdir(header_dir)) if header_dir and os.path.isdir(header_dir) else []
m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256)).cuda()
f = torch.compile(m, backend=sys.argv[1])
x = torch.randn(64, 256, device="cuda")
profile_n = int(os.environ.get("FIRST_COMPILE_PROFILE", "0"))
if profile_n:
    import cProfile, pstats
    prof = cProfile.Profile()
    prof.enable()
t0 = time.perf_counter()
f(x).sum().backward()
torch.cuda.synchronize()
first = time.perf_counter() - t0
if profile_n:
    prof.disable()
    pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(profile_n)
t0 = time.perf_counter()
for _ in range(10):
    f(x).sum().backward()
torch.cuda.synchronize()
print(json.dumps({"first_step_s": first, "next_step_ms": (time.perf_counter() - t0) * 100, **spent,
                  "header_dir": header_dir, "headers_before": len(had),
                  "headers_after": len(os.listdir(header_dir)) if header_dir and os.path.isdir(header_dir) else 0}))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="inductor,enn,enn,enn fresh cache,inductor fresh cache")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="run each variant under cProfile and print its N costliest functions (cumulative)")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    print(f"# python bench/gpu_first_compile.py --variants \"{args.variants}\"")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"{'variant':22s} {'first step s':>12s} {'then ms':>8s} {'g++ header s (n)':>17s} "
          f"{'g++ wrappers s (n)':>19s} {'headers on disk before/after':>29s}")
    for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
        backend, _, rest = variant.partition(" ")
        env = dict(os.environ)
        if rest == "fresh cache":
            env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="first-compile-")
        elif rest:
            raise SystemExit(f"unknown variant {variant!r}")
        if args.profile:
            env["FIRST_COMPILE_PROFILE"] = str(args.profile)
        out = subprocess.run([sys.executable, "-c", CHILD, backend], env=env, capture_output=True, text=True)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if out.returncode or not lines:
            print(f"{variant:22s} failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(lines[-1])
        print(f"{variant:22s} {r['first_step_s']:12.2f} {r['next_step_ms']:8.3f} "
              f"{r['header']:12.2f} ({r['header_builds']}) {r['wrapper']:13.2f} ({r['wrapper_builds']}) "
              f"{r['headers_before']:>14d} / {r['headers_after']}")
        if args.profile:
            print("\n".join(ln for ln in out.stdout.splitlines() if not ln.startswith("{")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
