"""``python -m enn_backend demo``: enn on a small GPT, end to end, in about a minute.

Builds a GPT-2-style model (hand-written causal attention), trains it a few steps
with ``backend="enn"`` next to an identical eager copy, checks that losses and
parameters stay equal within the dtype's tolerance, runs inference, then times a
training step under eager, inductor and enn side by side and prints enn's report.
CPU: fp32, tiny sizes. CUDA: bf16 autocast, GPT-2-small widths.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import Callable

import torch

import enn_backend

from .bench.runner import steady_state_warmup
from .models import gpt_small


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m enn_backend demo", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=3, help="training steps compared with eager")
    ap.add_argument("--reps", type=int, default=10, help="timed steps per backend")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    size, amp = ("gpu-real", torch.bfloat16) if on_gpu else ("cpu-small", None)
    overrides = dict(n_layer=2, batch=8) if on_gpu else {}
    tol = dict(atol=3e-2, rtol=3e-2) if amp else dict(atol=1e-4, rtol=1e-4)

    model, make_inputs, loss_fn = gpt_small(size, attention="naive", device=device, **overrides)
    batch = make_inputs()
    print(f"enn demo: GPT-2-style model ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params) "
          f"on {device}, {'bf16 autocast' if amp else 'fp32'}")

    def step_fn(m: torch.nn.Module, fwd: Callable, opt: torch.optim.Optimizer) -> Callable[[], torch.Tensor]:
        def step() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                loss = loss_fn(fwd(*batch.args), batch.target)
            loss.backward()
            opt.step()
            return loss.detach()

        return step

    enn_backend.reset()
    eager_model = copy.deepcopy(model)
    t0 = time.perf_counter()
    enn_step = step_fn(model, torch.compile(model, backend="enn"), torch.optim.AdamW(model.parameters(), lr=1e-3))
    eager_step = step_fn(eager_model, eager_model, torch.optim.AdamW(eager_model.parameters(), lr=1e-3))
    ok = True
    for i in range(args.steps):
        a, b = enn_step(), eager_step()
        same = torch.allclose(a.float(), b.float(), **tol)
        ok &= same
        print(f"  step {i}: loss enn {a.item():.5f}  eager {b.item():.5f}  {'ok' if same else 'MISMATCH'}")
        if i == 0:
            print(f"  (first enn step includes compiling: {time.perf_counter() - t0:.1f}s)")
    worst = max((p - q).abs().max().item() for p, q in zip(model.parameters(), eager_model.parameters()))
    params_ok = all(torch.allclose(p, q, **tol) for p, q in zip(model.parameters(), eager_model.parameters()))
    ok &= params_ok
    print(f"  parameters after {args.steps} steps: max |enn - eager| = {worst:.2e}  {'ok' if params_ok else 'MISMATCH'}")

    with torch.no_grad(), torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
        infer = torch.compile(model, backend="enn")
        got, ref = infer(*batch.args), model(*batch.args)
    inf_ok = torch.allclose(got.float(), ref.float(), **tol)
    ok &= inf_ok
    print(f"  inference logits vs eager: max diff {(got.float() - ref.float()).abs().max().item():.2e}  {'ok' if inf_ok else 'MISMATCH'}")

    print(f"timing a training step (median of {args.reps}, after the guard's warm-up, side by side):")
    timings = {}
    warm = steady_state_warmup()  # the same for every backend
    for name in ("eager", "inductor", "enn"):
        m = copy.deepcopy(eager_model)
        fwd = m if name == "eager" else torch.compile(m, backend=name)
        step = step_fn(m, fwd, torch.optim.AdamW(m.parameters(), lr=1e-3))
        for _ in range(warm):  # past enn's guard warm-up: its first calls of each graph are checked (host sync)
            step()
        timings[name] = _median_ms(step, device, args.reps)
    for name, ms in timings.items():
        print(f"  {name:<9} {ms:8.2f} ms/step   {timings['eager'] / ms:5.2f}x eager   {timings['inductor'] / ms:5.2f}x inductor")
    print()
    print(enn_backend.report())
    print("demo:", "PASSED (enn matches eager)" if ok else "FAILED (see MISMATCH above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
