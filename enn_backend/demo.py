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

from .bench.steps import autocast, timed_step
from .bench.timing import Timer, speed_verdict, spread_pct
from .models import gpt_small
from .report import report, reset


def _device(text: str) -> torch.device:
    """A device this torch can run the demo on (argparse turns the error into exit status 2)."""
    try:
        device = torch.device(text)
    except RuntimeError as exc:
        raise argparse.ArgumentTypeError(str(exc).splitlines()[0]) from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: the demo runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "no CUDA device found"
        raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available (torch {torch.__version__}: {build})")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m enn_backend demo", description=__doc__.splitlines()[0])
    ap.add_argument("--device", type=_device, default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu, cuda or cuda:N (default: cuda where available)")
    ap.add_argument("--steps", type=int, default=3, help="training steps compared with eager")
    ap.add_argument("--reps", type=int, default=10, help="timed steps per backend")
    args = ap.parse_args(argv)
    device = args.device
    on_gpu = device.type == "cuda"
    size, dtype = ("gpu-real", "bf16") if on_gpu else ("cpu-small", "fp32")
    overrides = dict(n_layer=2, batch=8) if on_gpu else {}
    tol = dict(atol=3e-2, rtol=3e-2) if on_gpu else dict(atol=1e-4, rtol=1e-4)
    amp = autocast(device, dtype)

    model, make_inputs, loss_fn = gpt_small(size, attention="naive", device=device, **overrides)
    batch = make_inputs()
    print(f"enn demo: GPT-2-style model ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params) "
          f"on {device}, {'bf16 autocast' if on_gpu else 'fp32'}")

    def step_fn(m: torch.nn.Module, backend: str | None) -> Callable[[], torch.Tensor]:
        fwd = torch.compile(m, backend=backend) if backend else m
        return timed_step(fwd, torch.optim.AdamW(m.parameters(), lr=1e-3), batch, loss_fn, "train", amp)

    reset()
    eager_model = copy.deepcopy(model)
    t0 = time.perf_counter()
    enn_step = step_fn(model, "enn")
    eager_step = step_fn(eager_model, None)
    ok = True
    for i in range(args.steps):
        a, b = enn_step().detach(), eager_step().detach()
        same = torch.allclose(a.float(), b.float(), **tol)
        ok &= same
        print(f"  step {i}: loss enn {a.item():.5f}  eager {b.item():.5f}  {'ok' if same else 'MISMATCH'}")
        if i == 0:
            print(f"  (first enn step includes compiling: {time.perf_counter() - t0:.1f}s)")
    worst = max((p - q).abs().max().item() for p, q in zip(model.parameters(), eager_model.parameters()))
    params_ok = all(torch.allclose(p, q, **tol) for p, q in zip(model.parameters(), eager_model.parameters()))
    ok &= params_ok
    print(f"  parameters after {args.steps} steps: max |enn - eager| = {worst:.2e}  {'ok' if params_ok else 'MISMATCH'}")

    with torch.no_grad(), amp():
        infer = torch.compile(model, backend="enn")
        got, ref = infer(*batch.args), model(*batch.args)
    inf_ok = torch.allclose(got.float(), ref.float(), **tol)
    ok &= inf_ok
    print(f"  inference logits vs eager: max diff {(got.float() - ref.float()).abs().max().item():.2e}  {'ok' if inf_ok else 'MISMATCH'}")

    print(f"timing a training step (median of {args.reps} interleaved rounds after the guard's warm-up; "
          "spread: interquartile range over rounds):")
    steps = {name: step_fn(copy.deepcopy(eager_model), None if name == "eager" else name)
             for name in ("eager", "inductor", "enn")}
    samples = Timer(device, rounds=args.reps, steps_per_sample=1).measure(steps)
    timings = {name: statistics.median(ms) for name, ms in samples.items()}
    for name, ms in timings.items():
        print(f"  {name:<9} {ms:8.2f} ms/step (spread {spread_pct(samples[name]):4.1f}%)   "
              f"{timings['eager'] / ms:5.2f}x eager   {timings['inductor'] / ms:5.2f}x inductor")
    print("  " + speed_verdict(samples["inductor"], samples["enn"], "inductor", "enn"))
    print()
    print(report())
    print("demo:", "PASSED (enn matches eager)" if ok else "FAILED (see MISMATCH above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
