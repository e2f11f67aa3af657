"""When is fusing a small attention worth it on CUDA? Host and device time per call, by size.

HF's eager attention with a right-padding mask (BERT's and T5 cross-attention's form:
``scores + where(keep, 0, finfo.min)``, softmax, ``@ V``), bf16 inference, at sizes from T5's
cross-attention to BERT's, compiled by Inductor (left unfused) and by enn (cuDNN with the
key-padding bias, the dead-row fix-up). Per call:

- host: the wall time to launch ``--steps`` calls back to back, divided (the device idles, so
  this is the host's cost); the fastest of ``--rounds`` interleaved rounds and their median;
- device: the kernels' summed time per call (torch.profiler).

Then HF T5 inference (gpu-real) the same way: Inductor, enn, enn with its attention pass off.

Run:  python bench/gpu_attention_size.py   (bench/results/gpu-h100/attention_size.log)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import enn_backend  # noqa: F401  (registers backend="enn")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_real_gaps import kernel_time  # noqa: E402  (the device time of a step, one way for both scripts)

# (name, B, H, Tq, Tk, D)
SIZES = [
    ("T5 decoder self", 8, 12, 128, 128, 64),
    ("T5 cross", 8, 12, 128, 512, 64),
    ("T5 encoder self", 8, 12, 512, 512, 64),
    ("BERT", 16, 12, 512, 512, 64),
]


def padded_attention(q, k, v, mask):
    """transformers' eager attention with ``masking_utils``' padding mask (``where(keep, 0, finfo.min)``)."""
    b = torch.arange(q.shape[0], device=q.device)[:, None, None, None]
    j = torch.arange(k.shape[2], device=q.device)[None, None, None, :]
    bias = torch.where(mask.bool()[b, j], torch.tensor(0.0, dtype=q.dtype), torch.finfo(q.dtype).min)
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5 + bias
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)


def host_us(fn, steps: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    host = (time.perf_counter() - t) / steps * 1e6
    torch.cuda.synchronize()
    return host


def device_us(fn, n: int = 20) -> float:
    return kernel_time(fn, n)[0] * 1e3


def compare(label: str, fns: dict, rounds: int, steps: int) -> None:
    for fn in fns.values():
        for _ in range(30):
            fn()
    samples = {k: [] for k in fns}
    for r in range(rounds):
        names = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
        for k in names:
            samples[k].append(host_us(fns[k], steps))
    print(f"\n{label}")
    print(f"  {'variant':<20} {'host us (fastest)':>18} {'host us (median)':>17} {'device us':>10}")
    for k, s in samples.items():
        print(f"  {k:<20} {min(s):18.1f} {statistics.median(s):17.1f} {device_us(fns[k]):10.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--no-t5", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    torch._dynamo.config.recompile_limit = 64
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; bf16 inference, right padding on every "
          "second row (a quarter of the keys)")
    for name, b, h, tq, tk, d in SIZES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, h, tq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(b, h, tk, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        mask = torch.ones(b, tk, device="cuda", dtype=torch.long)
        mask[1::2, -tk // 4:] = 0
        fns = {}
        for be in ("inductor", "enn"):
            c = torch.compile(padded_attention, backend=be, dynamic=False)
            fns[be] = (lambda c=c: c(q, k, v, mask))
        with torch.no_grad():
            torch.testing.assert_close(fns["enn"]().float(), padded_attention(q, k, v, mask).float(), atol=2e-2, rtol=2e-2)
            compare(f"{name}: B{b} H{h} Tq{tq} Tk{tk} D{d} ({b * h * tq * tk / 1e6:.1f}M scores)", fns, a.rounds, a.steps)
        torch._dynamo.reset()
    if a.no_t5:
        return
    from enn_backend import models
    from enn_backend.bench.steps import autocast, timed_step

    fns = {}
    for label, kwargs in (("inductor", dict(backend="inductor")), ("enn", dict(backend="enn")),
                          ("enn attention off", dict(backend="enn", options={"attention": False}))):
        e = models.build("hf_t5", "gpu-real", device="cuda", seed=0)
        fns[label] = timed_step(torch.compile(e.model.eval(), **kwargs), None, e.make_inputs(0), e.loss_fn, "infer",
                                autocast("cuda", "bf16"))
    compare("HF T5 inference, gpu-real (whole step)", fns, a.rounds, 20)


if __name__ == "__main__":
    main()
