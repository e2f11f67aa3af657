"""GEMM epilogue kernels: the registry's measured choice against the rules' choice and Inductor.

For each GEMM shape (real-model projections and MLPs, decode M=1, squares) and each epilogue
family (bias, relu, gelu, gelu_tanh, silu, residual), one linear layer + epilogue compiled three
ways, timed side by side in one process:

  inductor   torch.compile(backend="inductor")
  rule       enn, guard off, rules only (measure_ms=0)
  measured   enn, guard off, measure_ms=BUDGET, a fresh choice cache

``--extra`` adds variants of enn side by side (``default``: the guard on; ``no cpp wrapper``,
``no combo``, ``python wrapper``: the rule variant built without enn's C++ wrapper, without combo
kernels, or without both), for a graph enn builds differently from Inductor because it predicts it
host-bound (decode M=1).

Every variant is compiled first, then timed in interleaved rounds (``enn_backend.bench.timing``'s
Timer: one sample per variant per round, the order rotated), so the variants share the moment's
clocks and noise; ratios are medians of per-round ratios. On CUDA each variant's device kernels
(names and time per call, by the profiler) and its wall time per back-to-back call are added:
variants that launch the same kernels differ only by noise or host time.

Columns: the kernel each enn variant chose, median ms per call (do_bench on CUDA; wall clock on
CPU), the ratios measured/rule and measured/inductor (<= 1.00 is what the registry promises, within
noise), the widest spread of a variant's samples, and whether the measured variant launched the same
kernels as Inductor. Then a second process compiles the measured variant again with the same choice cache and
an empty Inductor cache: its compile time, and how each choice was made (``cached``: no timing).

    python -m enn_backend bench --tool gemm_registry                       # GPU, bf16, every shape
    python -m enn_backend bench --tool gemm_registry -- --shapes decode,sq4096 --families gelu,residual
    python -m enn_backend bench --tool gemm_registry -- --device cpu --shapes tiny   # smoke test

Writes gemm_registry.json (and the table as gemm_registry.md) to $OUT (else the working
directory). A configuration that would start after --budget-s seconds is skipped and marked so.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from enn_backend.bench.timing import Timer, paired_ratio, profile, spread_pct, sync

# name -> (M, N, K): tokens x out x in of one projection
SHAPES = {
    "llama_qkv": (4096, 12288, 4096), "llama_up": (4096, 11008, 4096), "llama_down": (4096, 4096, 11008),
    "gpt2_fc": (8192, 3072, 768), "gpt2_proj": (8192, 768, 3072), "bert_fc": (4096, 3072, 768),
    "decode": (1, 11008, 4096), "sq4096": (4096, 4096, 4096), "sq8192": (8192, 8192, 8192),
    "tiny": (64, 96, 80),
}
FAMILIES = ("bias", "relu", "gelu", "gelu_tanh", "silu", "residual")
ACT = {"bias": lambda y: y, "relu": torch.relu, "gelu": F.gelu, "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
       "silu": F.silu}


def model_fn(family: str):
    if family == "residual":
        return lambda x, w, b, r: r + F.linear(x, w, b)
    act = ACT[family]
    return lambda x, w, b, r: act(F.linear(x, w, b))


def fresh(family: str, variant: str):
    """``model_fn(family)`` with a code object of its own (Dynamo keeps its compiled code per code
    object), so that each variant is compiled apart and stays alive to be timed in the same
    interleaved rounds as the others."""
    fn = model_fn(family)
    fn.__code__ = fn.__code__.replace(co_name=f"{family}_{variant}".replace(" ", "_"))
    return fn


def choices() -> list[dict]:
    import enn_backend

    return [c for g in enn_backend.report().graphs for c in g.kernel_choices]


# name -> enn options for --extra (added to the three variants above)
EXTRA = {"default": {}, "no cpp wrapper": {"guard": "off", "cpp_wrapper": False},
         "no combo": {"guard": "off", "combo_kernels": False},
         "python wrapper": {"guard": "off", "cpp_wrapper": False, "combo_kernels": False}}


def wall_us(fn, device: str, calls: int = 200) -> float:
    """Wall time per call over back-to-back calls, synchronized once at the end."""
    fn()
    sync(device)
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return 1e6 * (time.perf_counter() - t) / calls


def run_config(shape: str, family: str, args, cache_dir: str) -> dict:
    import enn_backend

    m, n, k = SHAPES[shape]
    dev, dtype = args.device, getattr(torch, args.dtype)
    g = torch.Generator(device=dev).manual_seed(0)
    x, w = torch.randn(m, k, device=dev, dtype=dtype, generator=g), torch.randn(n, k, device=dev, dtype=dtype, generator=g)
    b, r = torch.randn(n, device=dev, dtype=dtype, generator=g), torch.randn(m, n, device=dev, dtype=dtype, generator=g)
    row = {"shape": shape, "mnk": [m, n, k], "family": family}
    variants = {"inductor": ("inductor", None), "rule": ("enn", {"guard": "off"}),
                "measured": ("enn", {"guard": "off", "measure_ms": args.measure_ms, "cache_dir": cache_dir})}
    variants.update({name: ("enn", EXTRA[name]) for name in filter(None, args.extra.split(","))})
    fns = {}
    with torch.no_grad():
        want = model_fn(family)(x, w, b, r)
        for name, (backend, options) in variants.items():
            seen = len(enn_backend.report().graphs)
            t0 = time.perf_counter()
            c = torch.compile(fresh(family, name), backend=backend, options=options, dynamic=False)
            got = c(x, w, b, r)
            row[f"{name}_compile_s"] = round(time.perf_counter() - t0, 2)
            row[f"{name}_maxerr"] = (got.float() - want.float()).abs().max().item()
            if backend == "enn":
                made = [c for g in enn_backend.report().graphs[seen:] for c in g.kernel_choices]
                row[f"{name}_kernel"] = made[0]["choice"] if made else "inductor (no site)"
                row[f"{name}_how"] = made[0].get("how", "rule") if made else ""
                row[f"{name}_timings"] = made[0].get("timings_ms", {}) if made else {}
                row[f"{name}_reason"] = made[0].get("reason", "") if made else ""
            fns[name] = functools.partial(c, x, w, b, r)
        samples = Timer(dev, rounds=args.rounds).measure(fns)
        for name, fn in fns.items():
            row[f"{name}_ms"] = statistics.median(samples[name])
            if dev.startswith("cuda"):
                row[f"{name}_wall_us"] = round(wall_us(fn, dev), 1)
                prof = profile({name: fn}, dev, steps=20)[name]
                row[f"{name}_kernel_us"] = round(1e3 * prof["total_ms_per_step"], 1)
                row[f"{name}_kernels"] = sorted(t["name"] for t in prof["top"])
    # per-round ratios of back-to-back samples (timing.paired_ratio); the widest spread of a variant
    row["measured_vs_rule"] = round(paired_ratio(samples["measured"], samples["rule"]), 3)
    row["measured_vs_inductor"] = round(paired_ratio(samples["measured"], samples["inductor"]), 3)
    row["spread_pct"] = round(max(spread_pct(v) for v in samples.values()), 1)
    if "measured_kernels" in row:
        row["same_kernels_as_inductor"] = row["measured_kernels"] == row["inductor_kernels"]
    return row


def second_process(args, cache_dir: str, configs: list[tuple[str, str]]) -> dict:
    """Compile the measured variant again in a new process, same choice cache, empty Inductor cache."""
    code = (
        "import json, sys, time, torch\n"
        "sys.path.insert(0, %r)\n"
        "import gemm_registry as G, enn_backend\n"
        "args = G.parse(sys.argv[1:])\n"
        "out = []\n"
        "for shape, family in json.loads(%r):\n"
        "    m, n, k = G.SHAPES[shape]; dev, dt = args.device, getattr(torch, args.dtype)\n"
        "    x, w = torch.randn(m, k, device=dev, dtype=dt), torch.randn(n, k, device=dev, dtype=dt)\n"
        "    b, r = torch.randn(n, device=dev, dtype=dt), torch.randn(m, n, device=dev, dtype=dt)\n"
        "    torch._dynamo.reset(); enn_backend.reset(); t0 = time.perf_counter()\n"
        "    with torch.no_grad():\n"
        "        torch.compile(G.model_fn(family), backend='enn', options={'guard': 'off', 'measure_ms': args.measure_ms,\n"
        "                      'cache_dir': %r}, dynamic=False)(x, w, b, r)\n"
        "    made = G.choices()\n"
        "    out.append({'shape': shape, 'family': family, 'compile_s': round(time.perf_counter() - t0, 2),\n"
        "                'how': made[0].get('how', 'rule') if made else '', 'kernel': made[0]['choice'] if made else ''})\n"
        "print('RESULT ' + json.dumps(out))\n"
    ) % (os.path.dirname(os.path.abspath(__file__)), json.dumps(configs), cache_dir)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="gemm-registry-ind2-")}
    p = subprocess.run([sys.executable, "-c", code, *sys.argv[1:]], capture_output=True, text=True, env=env,
                       timeout=max(60, int(args.budget_s)))
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        return {"error": p.stderr[-2000:]}
    return {"rows": json.loads(line[len("RESULT "):])}


def parse(argv):
    p = argparse.ArgumentParser(prog="python bench/gemm_registry.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--shapes", default=",".join(s for s in SHAPES if s != "tiny"), help=f"of {', '.join(SHAPES)}")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--measure-ms", type=int, default=100, help="enn's measure_ms for the measured variant")
    p.add_argument("--extra", default="", help=f"comma-separated enn variants to add, of: {', '.join(EXTRA)}")
    p.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds (one sample per variant each)")
    p.add_argument("--budget-s", type=float, default=480.0, help="start no configuration after this many seconds")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    out_dir = os.environ.get("OUT") or "."
    cache_dir = tempfile.mkdtemp(prefix="gemm-registry-enn-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="gemm-registry-ind-")
    t0 = time.perf_counter()
    rows, done = [], []
    for shape in args.shapes.split(","):
        for family in args.families.split(","):
            if time.perf_counter() - t0 > args.budget_s:
                rows.append({"shape": shape, "family": family, "skipped": "over --budget-s"})
                continue
            try:
                rows.append(run_config(shape, family, args, cache_dir))
                done.append((shape, family))
            except Exception as exc:  # noqa: BLE001 - one configuration's failure is a row, not the end
                rows.append({"shape": shape, "family": family, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            r = rows[-1]
            print(json.dumps(r), flush=True)
    second = second_process(args, cache_dir, done) if done else {}
    head = ("| shape | MxNxK | family | rule kernel | measured kernel | inductor ms | rule ms | measured ms | "
            "measured/rule | measured/inductor | spread % | same kernels as inductor |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        if "measured_ms" not in r:
            lines.append(f"| {r['shape']} | | {r['family']} | {r.get('skipped') or r.get('error')} |" + " |" * 8)
            continue
        same = {True: "yes", False: "no"}.get(r.get("same_kernels_as_inductor"), "")
        lines.append(f"| {r['shape']} | {'x'.join(map(str, r['mnk']))} | {r['family']} | {r['rule_kernel']} | "
                     f"{r['measured_kernel']} ({r['measured_how']}) | {r['inductor_ms']:.4f} | {r['rule_ms']:.4f} | "
                     f"{r['measured_ms']:.4f} | {r['measured_vs_rule']:.3f} | {r['measured_vs_inductor']:.3f} | "
                     f"{r['spread_pct']} | {same} |")
    shown = ["inductor", "rule", "measured", *filter(None, args.extra.split(","))]
    if any("inductor_kernel_us" in r for r in rows):
        lines += ["", "Every variant (ms: the interleaved rounds' median; wall us: per call, back to back; kernel us: "
                  "device kernels per call, profiler):", "", "| shape | family | variant | kernel | ms | wall us | kernel us |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['shape']} | {r['family']} | {v} | {r.get(f'{v}_kernel', '')} | {r[f'{v}_ms']:.4f} | "
                  f"{r.get(f'{v}_wall_us', '')} | {r.get(f'{v}_kernel_us', '')} |"
                  for r in rows if "measured_ms" in r for v in shown]
    if second.get("rows"):
        lines += ["", "Second process, same choice cache, empty Inductor cache:", "",
                  "| shape | family | compile s | how | kernel |", "|---|---|---|---|---|"]
        lines += [f"| {r['shape']} | {r['family']} | {r['compile_s']} | {r['how']} | {r['kernel']} |" for r in second["rows"]]
    elif second:
        lines += ["", f"second process failed: {second.get('error', '')[:500]}"]
    table = "\n".join(lines)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\n{device}, torch {torch.__version__}, {args.dtype}, measure_ms={args.measure_ms}\n\n{table}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gemm_registry.json"), "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "args": vars(args), "rows": rows, "second": second}, f,
                  indent=1)
    with open(os.path.join(out_dir, "gemm_registry.md"), "w") as f:
        f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
