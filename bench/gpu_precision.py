"""GPU check of enn's precision guards: their step-time cost and the stress cases.

    python bench/gpu_precision.py          # prints two tables; writes $OUT/precision.json if $OUT is set

1. Cost: a small GPT-style transformer (4 blocks, d=512, T=512, B=8, RMSNorm + LayerNorm,
   vocab 8192), one bf16-autocast training step (forward, cross-entropy, backward, SGD),
   compiled with backend="enn" twice side by side - precision guards on, and off
   (options precision=False, fp32_tail="off") - plus backend="inductor" as the baseline.
   Median of CUDA-event timed steps, measured in two interleaved rounds.
2. Stress cases on the GPU (fp16/bf16): eager vs inductor vs enn, relative error vs fp64.
Budget: well under 4 minutes on an H100/H200.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.n1, self.n2 = nn.RMSNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, D))
        return x + self.proj(F.gelu(self.fc(self.n2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=8192, d=512, h=8, layers=4, T=512) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.zeros(T, d))
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def _step_fn(model, opt):
    def step(idx, tgt):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(idx)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), tgt.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def _time(fn, args, iters=30) -> list[float]:
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(*args)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return times


def cost() -> dict:
    torch.manual_seed(0)
    dev = "cuda"
    idx = torch.randint(0, 8192, (8, 512), device=dev)
    tgt = torch.randint(0, 8192, (8, 512), device=dev)
    variants = {
        "inductor": ("inductor", None),
        "enn precision on": ("enn", {}),
        "enn precision off": ("enn", {"precision": False, "fp32_tail": "off"}),
    }
    steps = {}
    for name, (be, opts) in variants.items():
        torch._dynamo.reset()
        model = GPT().to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        step = _step_fn(model, opt)
        kw = {"options": opts} if opts is not None else {}
        cstep = torch.compile(step, backend=be, **kw)
        t0 = time.perf_counter()
        for _ in range(3):
            cstep(idx, tgt)
        torch.cuda.synchronize()
        steps[name] = (cstep, time.perf_counter() - t0)
    rounds: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(2):  # interleaved, so drift hits every variant alike
        for name, (cstep, _) in steps.items():
            rounds[name] += _time(cstep, (idx, tgt))
    out = {name: {"median_ms": statistics.median(t), "min_ms": min(t), "compile_s": steps[name][1]} for name, t in rounds.items()}
    on, off = out["enn precision on"]["median_ms"], out["enn precision off"]["median_ms"]
    out["precision_cost_pct"] = 100.0 * (on - off) / off
    return out


def _rel(a, ref) -> float:
    a = a.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def stress() -> dict:
    from enn_backend.custom_ops import precision as P

    dev = "cuda"
    cases = {
        "softmax_large_logits bf16": (lambda x: torch.softmax(x, -1), lambda x: P.softmax(x, -1), torch.randn(256, 4096) * 50, torch.bfloat16),
        "layer_norm_large fp16": (lambda x: F.layer_norm(x, (4096,)), None, torch.randn(256, 4096) * 500 + 2000, torch.float16),
        "fp16_sum_100k_ones": (lambda x: x.sum() * 1e-3, None, torch.ones(100_000), torch.float16),
        "logsumexp_large bf16": (lambda x: torch.logsumexp(x, -1), None, torch.randn(256, 4096) * 10 + 1e5, torch.bfloat16),
        "cross_entropy_32k bf16": ("ce", None, torch.randn(64, 32768) * 4, torch.bfloat16),
    }
    results = {}
    for name, (fn, enn_fn, x, dtype) in cases.items():
        tgt = torch.randint(0, x.shape[-1], (x.shape[0],), device=dev)
        if fn == "ce":
            def fn(t, tgt=tgt):
                return F.cross_entropy(t, tgt)
        x0 = x.to(dev, dtype)
        xr = x0.double().requires_grad_()
        ref = fn(xr)
        g = torch.randn_like(ref)
        ref.backward(g)
        row = {}
        for be in ("eager", "inductor", "enn"):
            torch._dynamo.reset()
            f = fn if be == "eager" else torch.compile((enn_fn or fn) if be == "enn" else fn, backend=be)
            xx = x0.clone().requires_grad_()
            y = f(xx)
            y.backward(g.to(y.dtype))
            row[be] = {"fwd": _rel(y, ref), "bwd": _rel(xx.grad, xr.grad)}
        results[name] = row
    return results


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(prog="bench/gpu_precision.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_precision.py needs a CUDA GPU")
    t0 = time.perf_counter()
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    data["cost"] = cost()
    data["stress"] = stress()
    data["wall_s"] = time.perf_counter() - t0
    print(f"\n{data['device']}, torch {data['torch']}: bf16-autocast train step, GPT 4x512, B8 T512")
    print(f"{'variant':<22} {'median ms':>10} {'min ms':>8} {'compile s':>10}")
    for k, v in data["cost"].items():
        if isinstance(v, dict):
            print(f"{k:<22} {v['median_ms']:>10.3f} {v['min_ms']:>8.3f} {v['compile_s']:>10.1f}")
    print(f"precision guards cost: {data['cost']['precision_cost_pct']:+.2f}% step time (on vs off)")
    print(f"\n{'stress case':<28} " + " ".join(f"{b + ' fwd':>13} {b + ' bwd':>13}" for b in ("eager", "inductor", "enn")))
    for name, row in data["stress"].items():
        print(f"{name:<28} " + " ".join(f"{row[b]['fwd']:>13.3g} {row[b]['bwd']:>13.3g}" for b in ("eager", "inductor", "enn")))
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "precision.json"), "w") as f:
            json.dump(data, f, indent=1)
    print(f"\nwall {data['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
