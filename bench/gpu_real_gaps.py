"""Where the real-model suite's slowest workloads lose: kernel time vs host time, per variant.

For each workload (third-party models of the real preset, gpu-real size, bf16 autocast): Inductor,
enn with its defaults, enn without its precision pass, and enn with its guard off, each on its own
copy of the model (same seed), timed interleaved (do_bench medians, ``--rounds`` rounds), plus the
device's kernel time and kernel count of one step (torch.profiler, 10 steps). Then, for training
workloads, whether the model's loss stays finite over ``--train-steps`` steps (eager and enn) and
what enn's report recorded.

Run:  python bench/gpu_real_gaps.py [--only a,b] [--rounds 7] [--variants ...] [--wall-steps N]
      (bench/results/gpu-h100/real_gaps*.log)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import statistics
import time

import torch

import enn_backend  # noqa: F401  (registers backend="enn")
from enn_backend import models
from enn_backend.backend import enn
from enn_backend.bench.steps import autocast, timed_step
from enn_backend.report import report, reset

WORKLOADS = ["tv_resnet18:infer", "hf_bloom:infer", "hf_bert_sdpa:infer", "hf_t5:infer", "timm_vit_small:train",
             "hf_t5:train", "hf_bloom:train"]
VARIANTS = {
    "inductor": dict(backend="inductor"),
    "enn": dict(backend="enn"),
    "enn precision off": dict(backend="enn", options={"precision": False}),
    "enn guard off": dict(backend="enn", options={"guard": "off"}),
    "enn attention off": dict(backend="enn", options={"attention": False}),
    # Inductor knobs that cut host work per step, tried on both backends (enn's default has combo
    # kernels on: graph_compiler.INDUCTOR_DEFAULTS):
    "inductor combo": dict(backend="inductor", options={"combo_kernels": True}),  # horizontal fusion: fewer launches
    "enn combo": dict(backend="enn", options={"combo_kernels": True}),
    "enn combo benchmarked": dict(backend="enn", options={"benchmark_combo_kernel": True}),  # kept where faster
    "enn combo pointwise": dict(backend="enn", options={"combo_kernels_pointwise_only": True}),
    "enn combo own blocks": dict(backend="enn", options={"combo_kernel_per_subkernel_blocks": True}),
    "enn no combo": dict(backend="enn", options={"combo_kernels": False}),
    "enn shared blocks": dict(backend="enn", options={"combo_kernel_per_subkernel_blocks": False}),
    "inductor no asserts": dict(backend="inductor",  # the generated wrapper's per-call size/stride/alignment checks
                                options={"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}),
    # a C++ wrapper launches the graph's kernels without a Python frame per launch
    "inductor cpp wrapper": dict(backend="inductor", options={"cpp_wrapper": True}),
    "enn cpp wrapper": dict(backend="enn", options={"cpp_wrapper": True}),
    "enn no cpp wrapper": dict(backend="enn", options={"cpp_wrapper": False}),  # enn's default: on (not for backward)
    "enn coordesc": dict(backend="enn", options={"coordinate_descent_tuning": True}),  # tunes block sizes per kernel
    # the C++ wrapper for inference graphs only, not for training forwards (a backend callable of
    # its own: with backend="enn" Dynamo would reuse the plain enn variant's compiled code)
    "enn cpp wrapper inference only": dict(backend=lambda gm, example_inputs: enn(gm, example_inputs),
                                           compile_under=lambda: _cpp_wrapper_for_inference_only()),
    "enn combo untuned": dict(backend="enn", options={"combo_kernels_autotune": 0}),  # compile time of combo kernels
    # the backward compiled when AOT Autograd asks (fake inputs): the Python wrapper, as before
    # enn's default compiled it on its first call with the C++ wrapper (own backend callable, as above)
    "enn backward python wrapper": dict(backend=lambda gm, example_inputs: enn(gm, example_inputs),
                                        compile_under=lambda: _backward_when_asked()),
}
DEFAULT_VARIANTS = "inductor,enn,enn precision off,enn guard off"


@contextlib.contextmanager
def _cpp_wrapper_for_inference_only():
    from enn_backend import backend, graph_compiler

    def defaults(example_inputs, opts, config_patches):
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs):
            return {}
        return graph_compiler.compile_fx_defaults(example_inputs, opts, config_patches)

    real = backend.compile_fx_defaults
    backend.compile_fx_defaults = defaults
    try:
        yield
    finally:
        backend.compile_fx_defaults = real


@contextlib.contextmanager
def _backward_when_asked():
    from enn_backend import graph_compiler

    cls = graph_compiler.GraphCompiler
    real = cls.waits_for_first_call
    cls.waits_for_first_call = property(lambda self: False)
    try:
        yield
    finally:
        cls.waits_for_first_call = real


def kernel_time(step, n: int = 10) -> tuple[float, float]:
    """(device kernel ms per step, kernels per step) over ``n`` profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total for e in events)
    return total_us / 1e3 / n, len(events) / n


def wall_ms(step, n: int) -> float:
    """Wall-clock ms per step over ``n`` steps, synchronized at both ends (host time included)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n


def run_workload(name: str, mode: str, rounds: int, variants: list[str], wall_steps: int = 0) -> None:
    from triton.testing import do_bench

    amp = autocast("cuda", "bf16")
    steps, compile_s = {}, {}
    for variant in variants:
        kwargs = dict(VARIANTS[variant])
        compile_under = kwargs.pop("compile_under", contextlib.nullcontext)
        entry = models.build(name, "gpu-real", device="cuda", seed=0)
        m = entry.model if mode == "train" else entry.model.eval()
        fn = torch.compile(m, **kwargs)
        batch = entry.make_inputs(0)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4) if mode == "train" else None
        step = timed_step(fn, opt, batch, entry.loss_fn, mode, amp)
        t0 = time.perf_counter()
        try:
            with compile_under():
                step()
            torch.cuda.synchronize()
        except Exception as e:  # one variant that cannot compile must not cost the others their numbers
            print(f"  {name} {mode} {variant}: first call failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        compile_s[variant] = time.perf_counter() - t0
        steps[variant] = step
        for _ in range(25):  # past enn's guard warm-up
            step()
    torch.cuda.synchronize()
    times = {v: [] for v in steps}
    gc.collect()
    gc.disable()  # a collection pause lands on whichever variant runs then: keep it out of every round
    try:
        for r in range(rounds):
            order = list(steps)[r % len(steps):] + list(steps)[:r % len(steps)]
            for v in order:
                times[v].append(wall_ms(steps[v], wall_steps) if wall_steps
                                else do_bench(steps[v], warmup=3, rep=60, return_mode="median"))
    finally:
        gc.enable()
    base = "inductor" if "inductor" in times else next(iter(times))  # what "vs ind." compares with
    how = f"wall clock of {wall_steps} steps" if wall_steps else "do_bench medians"
    print(f"\n{name} {mode} bf16 (median of {rounds} interleaved rounds, {how}, GC off while timing; "
          "kernel time from torch.profiler)")
    print(f"  {'variant':<18} {'step ms':>8} {'vs ' + base[:4] + '.':>8} {'spread':>7} {'kernel ms':>10} {'kernels':>8} "
          f"{'host-idle ms':>12} {'1st call s':>10}")
    for v, ts in times.items():
        med = statistics.median(ts)
        ratios = sorted(b / t for b, t in zip(times[base], ts))
        kms, kn = kernel_time(steps[v])
        spread = (max(ts) - min(ts)) / 2 / med
        print(f"  {v:<18} {med:8.3f} {statistics.median(ratios):8.3f} {spread:6.0%} {kms:10.3f} {kn:8.0f} "
              f"{med - kms:12.3f} {compile_s[v]:10.1f}")
    del steps
    torch.cuda.empty_cache()


def divergence(name: str, n: int) -> None:
    """Does training this workload stay finite? eager and enn, ``n`` steps each."""
    amp = autocast("cuda", "bf16")
    for variant in ("eager", "enn"):
        reset()
        entry = models.build(name, "gpu-real", device="cuda", seed=0)
        m = entry.model
        fn = m if variant == "eager" else torch.compile(m, backend="enn")
        batch = entry.make_inputs(0)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        step = timed_step(fn, opt, batch, entry.loss_fn, "train", amp)
        losses, first_bad = [], None
        for i in range(1, n + 1):
            loss = float(step())
            losses.append(loss)
            params_ok = all(bool(torch.isfinite(p).all()) for p in m.parameters())
            if first_bad is None and (not math.isfinite(loss) or not params_ok):
                first_bad = (i, loss, params_ok)
        shown = ", ".join(f"{i}:{losses[i - 1]:.3g}" for i in (1, 10, 20, 30, 40, 50, 60, 80, n) if i <= n)
        print(f"  {name} train {variant:<6} loss at steps {shown}; first non-finite: {first_bad}")
        if variant == "enn":
            d = report().to_dict()
            print(f"    enn counters: { {k: v for k, v in d['counters'].items() if 'fallback' in k or 'nonfinite' in k} }")
            for f in d["fallbacks"]:
                print(f"    [{f['kind']}] {f['graph']}: {f['reason'][:160]} -> {f['action'][:100]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--train-steps", type=int, default=80)
    ap.add_argument("--divergence", default="hf_bloom,hf_t5", help="training workloads to check for divergence ('' : none)")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--wall-steps", type=int, default=0,
                    help="time each sample as the wall clock of this many steps (0: do_bench's median)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.cache_size_limit = 64
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    if a.divergence:
        print("\nDoes training stay finite? (AdamW lr 1e-4, one batch, bf16 autocast, as the suite trains)")
        for name in a.divergence.split(","):
            divergence(name, a.train_steps)
    for w in (a.only.split(",") if a.only else WORKLOADS):
        name, mode = w.split(":")
        torch._dynamo.reset()
        run_workload(name, mode, a.rounds, a.variants.split(","), a.wall_steps)


if __name__ == "__main__":
    main()
