"""Host time of each op of the GPU's steady-state screen (guard/screen.py LateScreen), one by one.

    python bench/screen_ops_cost.py [--shape 8,1,32000] [--outputs 1]

Each op runs after a device sync, so its host time is its own; median of 50 repeats, us.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from enn_backend.guard import screen as S


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8,1,32000")
    ap.add_argument("--outputs", type=int, default=1)
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    flat = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(args.outputs)]
    full = list(range(len(flat)))
    host = torch.empty((), dtype=torch.bool, pin_memory=True)
    flag = S.nonfinite_flag(flat, full)
    ops = {
        "_foreach_norm ord 1": lambda: torch._foreach_norm(flat, 1, dtype=torch.float32),
        "_foreach_norm ord inf": lambda: torch._foreach_norm(flat, float("inf"), dtype=torch.float32),
        "_foreach_norm ord 1, no dtype": lambda: torch._foreach_norm(flat, 1),
        "_totals (L1)": lambda: S._totals(flat, full, ord=1),
        "nonfinite_flag": lambda: S.nonfinite_flag(flat, full),
        "isfinite(0-dim)": lambda: torch.isfinite(flag),
        "pinned copy_ non_blocking": lambda: host.copy_(flag, non_blocking=True),
        "Event() + record()": lambda: torch.cuda.Event().record(),
        "LateScreen(...)": lambda: S.LateScreen(flat, {}, host, 1),
    }
    print(f"{len(flat)} output(s) of {list(shape)} bf16; host us per op (median of 50, each after a sync)\n")
    for name, op in ops.items():
        xs = []
        for _ in range(55):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            op()
            xs.append((time.perf_counter() - t0) * 1e6)
        print(f"| {name} | {statistics.median(xs[5:]):.1f} |")


if __name__ == "__main__":
    main()
