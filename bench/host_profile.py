"""Where a step's host time goes, enn against Inductor, on real models: cProfile of steady steps.

    python bench/host_profile.py --device cuda --size gpu-real hf_bert_sdpa:train hf_qwen2_sdpa:infer decode
    python bench/host_profile.py --device cpu --size cpu-small hf_bert_sdpa:train

A workload is ``model:mode`` (a model of the zoo or of the real suite, at ``--size``, bf16 autocast
on cuda) or ``decode`` (bench/gpu_decode_cudagraphs.py's HF LLaMA decode-sized step, inference,
where the compiled variants also run under ``reduce-overhead``). Each variant -- inductor, enn,
enn with the guard off -- is compiled and run past the guard's warm-up and its first sampled
checks, then ``--steps`` steps are profiled (cProfile, the device synchronized once at the end).

For each workload it prints: wall time per profiled step; the time per step spent in enn's own
Python (the self time of its runtime's functions) and in the functions
whose per-step time differs most between enn and Inductor. That is the host tax, located: on a
step that is bound by the host (a decode step, CUDA graphs) it is the difference in step time; on
a step bound by the device it hides behind the kernels and shows here only.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import re
import sys
import time
from typing import Any, Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _variants(ro: bool) -> dict[str, dict[str, Any]]:
    v = {"inductor": dict(backend="inductor"), "enn": dict(backend="enn"),
         "enn guard=off": dict(backend="enn", options={"guard": "off"})}
    if ro:
        v = {**{k: dict(kw) for k, kw in v.items()},
             **{f"{k} reduce-overhead": ({**kw, "mode": "reduce-overhead"} if k == "inductor" else
                                         {**kw, "options": {**kw.get("options", {}), "mode": "reduce-overhead"}})
                for k, kw in v.items()}}
    return v


def _workload(name: str, device: str, size: str) -> tuple[Callable[[Callable], Callable[[], Any]], Any, bool]:
    """(step factory: compiled model -> one step, the model, whether CUDA-graph variants apply)."""
    from enn_backend import models
    from enn_backend.bench.steps import autocast, timed_step

    if name == "decode":
        from gpu_decode_cudagraphs import build

        model, ids = build(8, 1)

        def decode(fn: Callable) -> Callable[[], Any]:
            def step() -> Any:
                with torch.no_grad():
                    return fn(input_ids=ids).logits
            return step

        return decode, model, True
    model_name, mode = name.split(":")
    entry = models.spec(model_name).builder(torch.device(device), **models.config(model_name, size))
    batch = entry.make_inputs(0)
    cast = autocast(device, "bf16" if device == "cuda" else "fp32")
    model = entry.model.train(mode == "train")

    def make(fn: Callable) -> Callable[[], Any]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4) if mode == "train" else None
        return timed_step(fn, opt, batch, entry.loss_fn, mode, cast)

    return make, model, False


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def profile_one(step: Callable[[], Any], steps: int, device: str) -> tuple[float, pstats.Stats]:
    prof = cProfile.Profile()
    _sync(device)
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step()
    _sync(device)
    prof.disable()
    wall = (time.perf_counter() - t0) / steps
    return wall, pstats.Stats(prof)


def _kernels(step: Callable[[], Any], steps: int = 5) -> dict[str, tuple[float, float]]:
    """Device kernels of a step: name -> (launches per step, ms per step)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA and not getattr(ev, "is_user_annotation", False):
            t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0.0)
            out[ev.key] = (ev.count / steps, t / 1e3 / steps)
    return out


def _cpu_ops(step: Callable[[], Any], steps: int = 10) -> dict[str, tuple[float, float]]:
    """Host side of a step: operator / runtime call name -> (calls per step, self CPU us per step)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    out: dict[str, tuple[float, float]] = {}
    for ev in prof.key_averages():  # (a compiled graph's name is its hash: the same for both backends here)
        key = re.sub(r"\b[a-z0-9]{40,}\b", "<hash>", ev.key)
        calls, us = out.get(key, (0.0, 0.0))
        out[key] = (calls + ev.count / steps, us + ev.self_cpu_time_total / steps)
    return out


def _per_function(stats: pstats.Stats, steps: int) -> dict[str, tuple[float, float]]:
    """function -> (tottime, cumtime) per step, in microseconds."""
    out = {}
    for (file, line, fn), (_, _, tt, ct, _) in stats.stats.items():
        key = f"{os.path.relpath(file) if file.startswith('/') else file}:{line}({fn})"
        out[key] = (tt / steps * 1e6, ct / steps * 1e6)
    return out


def _is_enn(file: str) -> bool:
    """enn's runtime code (not the benchmark's own steps and models, which live under enn_backend too)."""
    return "enn_backend" in file and not any(f"enn_backend/{d}/" in file for d in ("bench", "models"))


def _enn_self(stats: pstats.Stats, steps: int) -> float:
    """Per-step microseconds of Python executed in enn's own functions (their self time)."""
    return sum(tt for (file, _, _), (_, _, tt, _, _) in stats.stats.items() if _is_enn(file)) / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("workloads", nargs="+")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", default="gpu-real")
    ap.add_argument("--warmup", type=int, default=60, help="steps before the profile (past the guard's warm-up)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--kernels", action="store_true",
                    help="also count device kernels per step (torch.profiler) and list those enn and Inductor launch differently")
    ap.add_argument("--cpu-ops", action="store_true",
                    help="also compare the host time of every operator and CUDA runtime call per step (torch.profiler, CPU)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from enn_backend.bench.backends import compile_with

    torch._dynamo.config.cache_size_limit = 64
    results: dict[str, Any] = {}
    for w in args.workloads:
        make, model, ro = _workload(w, args.device, args.size)
        variants = _variants(ro and args.device == "cuda")
        walls, per_fn, enn_us, kernels, cpu_ops = {}, {}, {}, {}, {}
        for name, kw in variants.items():
            torch._dynamo.reset()
            step = make(compile_with(model, kw))
            for _ in range(args.warmup):
                step()
            profile_one(step, 20, args.device)  # (the profiler's own first-use costs)
            wall, stats = profile_one(step, args.steps, args.device)
            walls[name], per_fn[name], enn_us[name] = wall * 1e3, _per_function(stats, args.steps), \
                _enn_self(stats, args.steps)
            if args.kernels and args.device == "cuda":
                kernels[name] = _kernels(step)
            if args.cpu_ops:
                cpu_ops[name] = _cpu_ops(step)
        print(f"\n## {w} ({args.device}, {args.steps} profiled steps after {args.warmup}; wall includes cProfile's cost)\n")
        print("| variant | wall ms / step | enn's own Python (self time), us / step |\n|---|---|---|")
        for name in variants:
            print(f"| {name} | {walls[name]:.3f} | {enn_us[name]:.1f} |")
        for enn_name, base_name in (("enn", "inductor"), ("enn reduce-overhead", "inductor reduce-overhead")):
            if enn_name not in per_fn:
                continue
            a, b = per_fn[enn_name], per_fn[base_name]
            diff = sorted(((a.get(k, (0, 0))[0] - b.get(k, (0, 0))[0], k) for k in set(a) | set(b)), reverse=True)
            print(f"\nself time per step, {enn_name} minus {base_name} (us), largest first:\n")
            for d, k in diff[:args.top]:
                print(f"  {d:+9.1f}  {k}  (enn {a.get(k, (0, 0))[0]:.1f}, base {b.get(k, (0, 0))[0]:.1f}; "
                      f"enn cum {a.get(k, (0, 0))[1]:.1f})")
            enn_fns = sorted(((v[1], k) for k, v in a.items() if _is_enn(k)), reverse=True)[:args.top]
            print(f"\n{enn_name}: enn_backend functions by cumulative time per step (us):\n")
            for ct, k in enn_fns:
                print(f"  {ct:9.1f}  {k}")
        for enn_name, base_name in (("enn", "inductor"), ("enn guard=off", "inductor")):
            if enn_name in kernels:
                a, b = kernels[enn_name], kernels[base_name]
                print(f"\ndevice kernels per step: {enn_name} {sum(c for c, _ in a.values()):.1f} "
                      f"({sum(t for _, t in a.values()):.3f} ms), {base_name} {sum(c for c, _ in b.values()):.1f} "
                      f"({sum(t for _, t in b.values()):.3f} ms); the kernels they launch differently "
                      "(name: calls, ms per step):\n")
                for k in sorted(set(a) | set(b), key=lambda k: -abs(a.get(k, (0, 0))[1] - b.get(k, (0, 0))[1])):
                    if a.get(k, (0, 0))[0] != b.get(k, (0, 0))[0]:
                        print(f"  {k[:100]}: {enn_name} {a.get(k, (0, 0))[0]:g} ({a.get(k, (0, 0))[1]:.3f}), "
                              f"{base_name} {b.get(k, (0, 0))[0]:g} ({b.get(k, (0, 0))[1]:.3f})")
        for enn_name, base_name in (("enn", "inductor"), ("enn guard=off", "inductor")):
            if enn_name in cpu_ops:
                a, b = cpu_ops[enn_name], cpu_ops[base_name]
                print(f"\nhost time of operators and runtime calls per step (torch.profiler, self CPU us): {enn_name} "
                      f"{sum(t for _, t in a.values()):.0f}, {base_name} {sum(t for _, t in b.values()):.0f}; "
                      "largest differences (name: calls and us per step):\n")
                diff = sorted(set(a) | set(b), key=lambda k: -abs(a.get(k, (0, 0))[1] - b.get(k, (0, 0))[1]))
                for k in diff[:args.top]:
                    (ca, ta), (cb, tb) = a.get(k, (0, 0)), b.get(k, (0, 0))
                    print(f"  {ta - tb:+8.1f}  {k[:90]}: {enn_name} {ca:g} x, {ta:.1f} us; {base_name} {cb:g} x, {tb:.1f} us")
        results[w] = {"wall_ms": walls, "cpu_ops": cpu_ops, "enn_python_us": enn_us,
                      "kernels": {n: {k: list(v) for k, v in ks.items()} for n, ks in kernels.items()}}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_profile.json"), "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
