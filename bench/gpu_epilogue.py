"""GPU benchmark of the epilogue family: linear + bias + activation, bf16, 8192x4096x4096.

For GELU (exact), GELU (tanh) and ReLU, forward and forward+backward, side by side:

  eager        act(F.linear(x, w, b))
  inductor     torch.compile(backend="inductor")
  enn          torch.compile(backend="enn", options={"guard": "off"})   (kernels only)
  enn+guard    torch.compile(backend="enn")                             (default NaN/Inf guard)
  addmm_act    torch._addmm_activation(b, x, w.t(), use_gelu=...) called directly (forward only;
               it has no autograd). On CUDA its GELU is the tanh approximation, so on the exact-GELU
               row its error against the fp64 exact-GELU reference shows that it is a different function.
  enn_op       torch.ops.enn.gemm_bias_act eager (cuBLASLt forward, enn's registered backward)

Correctness: every output (and in fwd+bwd every gradient) is compared with an fp64 reference;
``ok`` means RMSE(candidate) <= 3 * RMSE(eager) + 1e-6 (torch's bf16 accuracy rule).
Timings: median ms (triton.testing.do_bench when available, else CUDA events).

Run after ``pip install -e .`` in the repository root:  python bench/gpu_epilogue.py
Prints a table and writes $OUT/epilogue.json (or ./epilogue.json). Budget: ~3 minutes; a config
that would start after EPI_BUDGET_S seconds (default 150) is skipped and marked so.
Shape override for a quick check: EPI_SHAPE=1024x1024x1024.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

T0 = time.perf_counter()
BUDGET_S = float(os.environ.get("EPI_BUDGET_S", "150"))
M, N, K = (int(v) for v in os.environ.get("EPI_SHAPE", "8192x4096x4096").split("x"))
DTYPE = torch.bfloat16
DEV = os.environ.get("EPI_DEVICE", "cuda")  # "cpu" only to smoke-test this script's logic
ACTS = {
    "gelu": lambda y: F.gelu(y, approximate="none"),
    "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
    "relu": torch.relu,
}


def bench_ms(fn, grad_to_none=None) -> float:
    if DEV == "cpu":
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ts)
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, grad_to_none=grad_to_none, return_mode="median"))
    except ImportError:
        pass
    for _ in range(5):
        fn()
    times = []
    for _ in range(30):
        if grad_to_none:
            for t in grad_to_none:
                t.grad = None
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def rmse(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref).pow(2).mean().sqrt().item()


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="bench/gpu_epilogue.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    if DEV == "cuda" and not torch.cuda.is_available():
        print("gpu_epilogue: needs a CUDA device", file=sys.stderr)
        return 2
    try:
        import enn_backend  # noqa: F401
        import enn_backend.custom_ops  # noqa: F401  (registers enn::gemm_bias_act)
    except ImportError as exc:
        print(f"gpu_epilogue: enn is not installed ({exc}); run `pip install -e .` first", file=sys.stderr)
        return 2
    from enn_backend.custom_ops import gemm as G

    torch.manual_seed(0)
    dev = DEV
    x0 = torch.randn(M, K, device=dev, dtype=DTYPE)
    w0 = (torch.randn(N, K, device=dev, dtype=DTYPE) / K**0.5).to(DTYPE)
    b0 = torch.randn(N, device=dev, dtype=DTYPE)
    g0 = torch.randn(M, N, device=dev, dtype=DTYPE)
    x64, w64, b64, g64 = (t.double() for t in (x0, w0, b0, g0))
    flops_fwd = 2 * M * N * K
    info = {
        "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__,
        "shape": [M, N, K], "dtype": "bfloat16",
    }
    rows = []

    for act, fa in ACTS.items():
        # fp64 references (forward, and grads of sum(out * g))
        xr, wr, br = (t.clone().requires_grad_() for t in (x64, w64, b64))
        ref = fa(F.linear(xr, wr, br))
        ref_grads = torch.autograd.grad(ref, (xr, wr, br), g64)
        ref = ref.detach()

        def f(x, w, b, fa=fa):
            return fa(F.linear(x, w, b))

        for mode in ("fwd", "fwd+bwd"):
            train = mode == "fwd+bwd"
            cands = {
                "eager": f,
                "inductor": torch.compile(f, backend="inductor"),
                "enn": torch.compile(f, backend="enn", options={"guard": "off"}),
                "enn+guard": torch.compile(f, backend="enn"),
                "enn_op": lambda x, w, b, act=act: torch.ops.enn.gemm_bias_act(x, w, b, act),
            }
            if not train:
                cands["addmm_act"] = lambda x, w, b, act=act: torch._addmm_activation(
                    b, x, w.t(), use_gelu=act != "relu")
            eager_err = None
            eager_gerr = None
            for name, fn in cands.items():
                row = {"act": act, "mode": mode, "impl": name}
                if time.perf_counter() - T0 > BUDGET_S:
                    row["skipped"] = f"time budget {BUDGET_S:.0f}s spent"
                    rows.append(row)
                    continue
                if name == "enn_op":
                    choice = G.select_kernel(G.GemmProblem(DEV, DTYPE, act, True))
                    row["kernel"] = choice.kernel
                x, w, b = (t.clone().requires_grad_(train) for t in (x0, w0, b0))
                try:
                    torch._dynamo.reset()  # each compiled candidate starts from a clean Dynamo cache
                    enn_backend.reset()
                    t_c = time.perf_counter()
                    with torch.set_grad_enabled(train):
                        out = fn(x, w, b)
                        if train:
                            grads = torch.autograd.grad(out, (x, w, b), g0)
                    if DEV == "cuda":
                        torch.cuda.synchronize()
                    row["first_call_s"] = round(time.perf_counter() - t_c, 2)
                    if name.startswith("enn") and name != "enn_op":
                        rep = enn_backend.report()
                        row["fusions"] = rep.fusions().get("epilogue", 0)
                        row["kernel"] = ",".join(sorted({c["choice"] for g in rep.graphs for c in g.kernel_choices})) or "-"
                    row["rmse"] = rmse(out, ref)
                    row["max_abs_err"] = (out.double() - ref).abs().max().item()
                    if name == "eager":
                        eager_err = row["rmse"]
                    row["ok"] = row["rmse"] <= 3 * eager_err + 1e-6
                    if train:
                        gerr = max(rmse(a, r) / (r.pow(2).mean().sqrt().item() + 1e-30) for a, r in zip(grads, ref_grads))
                        row["grad_rel_rmse"] = gerr
                        if name == "eager":
                            eager_gerr = gerr
                        row["ok"] = row["ok"] and gerr <= 3 * eager_gerr + 1e-6
                    del out
                    if train:
                        del grads

                        def step(fn=fn, x=x, w=w, b=b):
                            fn(x, w, b).backward(g0)

                        row["ms"] = bench_ms(step, grad_to_none=[x, w, b])
                    else:
                        with torch.no_grad():
                            row["ms"] = bench_ms(lambda fn=fn, x=x, w=w, b=b: fn(x, w, b))
                    row["tflops"] = round((flops_fwd * (3 if train else 1)) / (row["ms"] * 1e-3) / 1e12, 1)
                except Exception as exc:  # noqa: BLE001 - a failing candidate is reported, not fatal
                    row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
                rows.append(row)

    # table
    print(f"\nlinear+bias+act  {M}x{N}x{K} bf16  on {info['device']}  torch {info['torch']}")
    hdr = f"{'act':<10} {'mode':<8} {'impl':<10} {'ms':>8} {'TFLOP/s':>8} {'vs ind':>7} {'rmse':>9} {'grad_rel':>9} {'ok':>3}  kernel / fusions / note"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        base = next((q.get("ms") for q in rows if q["act"] == r["act"] and q["mode"] == r["mode"] and q["impl"] == "inductor"), None)
        if "skipped" in r or "error" in r:
            print(f"{r['act']:<10} {r['mode']:<8} {r['impl']:<10} {'-':>8} {'-':>8} {'-':>7} {'-':>9} {'-':>9} {'-':>3}  {r.get('skipped') or r.get('error')}")
            continue
        rel = f"{base / r['ms']:.3f}x" if base else "-"
        note = " ".join(str(v) for v in (r.get("kernel"), f"fusions={r['fusions']}" if "fusions" in r else None) if v)
        print(f"{r['act']:<10} {r['mode']:<8} {r['impl']:<10} {r['ms']:>8.3f} {r['tflops']:>8.1f} {rel:>7} "
              f"{r['rmse']:>9.2e} {r.get('grad_rel_rmse', float('nan')):>9.2e} {'yes' if r['ok'] else 'NO':>3}  {note}")
    print(f"\ntotal {time.perf_counter() - T0:.0f}s  ('vs ind' > 1 means faster than Inductor)")
    out_dir = os.environ.get("OUT") or "."
    path = os.path.join(out_dir, "epilogue.json")
    with open(path, "w") as fh:
        json.dump({"info": info, "rows": rows, "wall_s": round(time.perf_counter() - T0, 1)}, fh, indent=2, default=str)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
