"""What one fused attention call costs the host and the device, per SDPA kernel, at the real suite's shapes.

    python bench/gpu_sdpa_host_cost.py [--calls 50] [--rounds 7]

The attention pass picks a kernel by its device time; on a step bound by the host (small
inference steps: T5, BERT) what a call costs the CPU decides the step's time. For each shape
(the real suite's BERT / T5 / LLaMA attention, inference) and each ATen kernel as enn's graphs
call it -- ``_scaled_dot_product_{cudnn,efficient,flash}_attention``, no dispatcher choice --
and for the unfused attention compiled by Inductor (what enn's ``inductor`` choice leaves):

- host us / call: the time to issue ``--calls`` calls back to back, no sync (short enough that
  the launch queue never fills), divided by the calls;
- device us / call: CUDA events around the same loop after a sync, divided by the calls.

Median over ``--rounds`` rounds. Printed as one table; JSON under ``$OUT`` when set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

aten = torch.ops.aten

# name -> (B, H, T, D, bias shape or None, causal)
SHAPES = {
    "bert B16 H12 T512 D64, padding bias [B,1,1,T]": (16, 12, 512, 64, "key", False),
    "t5 B8 H12 T512 D64, position bias [1,H,T,T] + padding": (8, 12, 512, 64, "full", False),
    "llama B4 H16 T1024 D128, causal": (4, 16, 1024, 128, None, True),
    "small B8 H12 T128 D64, padding bias [B,1,1,T]": (8, 12, 128, 64, "key", False),
}


def _inputs(b: int, h: int, t: int, d: int, bias: str | None):
    q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if bias == "key":
        pad = torch.zeros(b, 1, 1, t, device="cuda", dtype=torch.bfloat16)
        pad[1::2, ..., -t // 4:] = torch.finfo(torch.bfloat16).min
        bias_t = pad.expand(b, h, t, t)
    elif bias == "full":
        bias_t = (torch.randn(1, h, t, t, device="cuda", dtype=torch.bfloat16)
                  + torch.zeros(b, 1, 1, t, device="cuda", dtype=torch.bfloat16)).contiguous()
    else:
        bias_t = None
    return q, k, v, bias_t


def _kernels(q, k, v, bias, causal):
    s = q.shape[-1] ** -0.5
    out = {
        "cudnn": lambda: aten._scaled_dot_product_cudnn_attention(q, k, v, bias, False, 0.0, causal, False, scale=s),
        "efficient": lambda: aten._scaled_dot_product_efficient_attention(q, k, v, bias, False, 0.0, causal, scale=s),
    }
    if bias is None:
        out["flash"] = lambda: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=s)

    def unfused(q, k, v, bias):
        scores = (q @ k.transpose(-1, -2)) * s
        if bias is not None:
            scores = scores + bias
        if causal:
            t = q.shape[-2]
            scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v

    compiled = torch.compile(unfused, backend="inductor")
    out["inductor (unfused, compiled)"] = lambda: compiled(q, k, v, bias)
    return out


def _measure(fn, calls: int, rounds: int) -> tuple[float, float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    host, dev = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - t0) / calls * 1e6)
        end.record()
        torch.cuda.synchronize()
        dev.append(start.elapsed_time(end) / calls * 1e3)
    return statistics.median(host), statistics.median(dev)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    rows = []
    with torch.no_grad():
        for shape, (b, h, t, d, bias, causal) in SHAPES.items():
            q, k, v, bias_t = _inputs(b, h, t, d, bias)
            for name, fn in _kernels(q, k, v, bias_t, causal).items():
                try:
                    host, dev = _measure(fn, args.calls, args.rounds)
                except Exception as exc:  # noqa: BLE001 - a kernel that refuses the shape is a row too
                    rows.append({"shape": shape, "kernel": name, "error": f"{type(exc).__name__}: {exc}"[:120]})
                    continue
                rows.append({"shape": shape, "kernel": name, "host_us": round(host, 1), "device_us": round(dev, 1)})
    print(f"\n{args.calls} calls back to back, median of {args.rounds} rounds, bf16, inference\n")
    print("| shape | kernel | host us / call | device us / call |\n|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['kernel']} | refused: {r['error']} | |")
        else:
            print(f"| {r['shape']} | {r['kernel']} | {r['host_us']} | {r['device_us']} |")
    out = os.environ.get("OUT", "")
    if out:
        with open(os.path.join(out, "sdpa_host_cost.json"), "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
