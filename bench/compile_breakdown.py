"""Cold first call per workload and compiler, with where its compile time went, by phase.

Each (workload, mode, variant) runs in a new process with empty caches (its own
TORCHINDUCTOR_CACHE_DIR and ENN_CACHE_DIR): the model is built, compiled and its first step
(training: forward, backward, optimizer; inference: one forward) timed by the wall clock, then
the phases are printed. The phases are the rules of ``enn_backend.compile_time`` applied to
torch's compile events, for Inductor too (it has no guard, so no ``guard`` / ``first_run``); under
enn they are the report's per graph, with each graph's build choice (C++ wrapper, combo kernels).

Variants: ``inductor``; ``enn``; ``enn host rule off`` (enn without the rule of
``enn_backend.build_choice``: its launch-saving defaults on every graph, not only host-bound ones);
``enn guard MODE`` (enn with options={"guard": MODE}, e.g. ``enn guard off``: the guard's share);
``enn no combo`` (enn without combo kernels: what they cost at compile time).
Each line also counts Inductor's graph compiles and the Triton kernels it compiled; ``--profile N``
adds the N functions of the main process with the most cumulative time in the first step (cProfile:
compile workers are other processes, and the profiler slows the step).

Run:  python bench/compile_breakdown.py [--only hf_llama_eager,timm_vit_small] [--modes train,infer]
          [--variants "inductor,enn,enn host rule off,enn guard off"] [--device cuda|cpu] [--profile 25]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import functools
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time

def one(name: str, mode: str, variant: str, device: str, profile: int = 0) -> dict:
    """The cold first step of ``name`` under ``variant``, in this process."""
    import torch

    import enn_backend
    from enn_backend import build_choice, models
    from enn_backend.bench.steps import autocast, timed_step
    from enn_backend.compat.compile_events import EVENT_TAPE
    from enn_backend.compile_time import attribute
    from enn_backend.report import GraphRecord

    if variant == "enn host rule off":
        build_choice.APPLIED = False
    entry = models.build(name, "gpu-real" if device == "cuda" else "cpu-small", device=device, seed=0)
    opt = torch.optim.AdamW(entry.model.parameters(), lr=1e-4) if mode == "train" else None
    options = ({"guard": variant.split()[-1]} if variant.startswith("enn guard ") else
               {"combo_kernels": False} if variant == "enn no combo" else None)
    fn = torch.compile(entry.model, backend="inductor" if variant == "inductor" else "enn", options=options)
    counts = _count_compiles()
    dtype = "bf16" if device == "cuda" else "fp32"
    step = timed_step(fn, opt, entry.make_inputs(0), entry.loss_fn, mode, autocast(device, dtype))
    # Inductor's phases: every outermost compile event of the step, by enn's rules
    whole = GraphRecord("inductor", "", "all")
    events: list = []

    def collect(e) -> None:
        events.append(e)
        if e.outermost:
            for rec, phase, seconds in attribute(list(events), [], lambda _e: whole):
                rec.add_compile_time(phase, seconds)
            events.clear()

    stop = EVENT_TAPE.listen(collect) if variant == "inductor" else (lambda: None)
    if device == "cuda":
        torch.cuda.synchronize()
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    with prof if prof else contextlib.nullcontext():
        step()
        if device == "cuda":
            torch.cuda.synchronize()
    first = time.perf_counter() - t0
    stop()
    graphs = ([{"id": "all graphs", "phases": whole.compile_phases, "choice": {}}] if variant == "inductor" else
              [{"id": g.id, "phases": g.compile_phases, "choice": g.build_choices} for g in enn_backend.report().graphs])
    top = ""
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(profile)
        top = buf.getvalue()
    return {"first_s": first, "graphs": graphs, "torch": torch.__version__, "counts": dict(counts), "profile": top}


def _count_compiles() -> collections.Counter:
    """Counts, from now on, Inductor's graph compiles (compile_fx's ``_compile_fx_inner``, which
    its callers look up in the module) and Triton kernels compiled (AsyncCompile.triton)."""
    import torch._inductor.compile_fx as compile_fx
    from torch._inductor.async_compile import AsyncCompile

    counts: collections.Counter = collections.Counter()

    def counted(key: str, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    compile_fx._compile_fx_inner = counted("graph compiles", compile_fx._compile_fx_inner)
    AsyncCompile.triton = counted("triton kernels", AsyncCompile.triton)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="hf_llama_eager,hf_gpt2_eager,hf_bert_sdpa,timm_vit_small")
    ap.add_argument("--modes", default="train")
    ap.add_argument("--variants", default="inductor,enn")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    ap.add_argument("--one", nargs=4, metavar=("WORKLOAD", "MODE", "VARIANT", "DEVICE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one(*a.one, profile=a.profile)))
        return
    from enn_backend.report import CompilePhase

    order = [p.value for p in CompilePhase]
    for name in a.only.split(","):
        for mode in a.modes.split(","):
            firsts: dict[str, float] = {}
            for variant in a.variants.split(","):
                with tempfile.TemporaryDirectory() as ind, tempfile.TemporaryDirectory() as enn:
                    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=ind, ENN_CACHE_DIR=enn)
                    proc = subprocess.run([sys.executable, __file__, "--one", name, mode, variant, a.device,
                                           "--profile", str(a.profile)],
                                          env=env, capture_output=True, text=True)
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if line is None:
                    print(f"{name} {mode} {variant}: failed\n{proc.stderr[-2000:]}")
                    continue
                res = json.loads(line[len("RESULT "):])
                firsts[variant] = res["first_s"]
                ratio = f" ({res['first_s'] / firsts['inductor']:.2f}x inductor)" if "inductor" in firsts and variant != "inductor" else ""
                counts = ", ".join(f"{v} {k}" for k, v in sorted(res["counts"].items()))
                print(f"{name} {mode} {variant}: cold first step {res['first_s']:.2f} s{ratio} ({counts}; torch {res['torch']})")
                for g in res["graphs"]:
                    phases = sorted(g["phases"].items(), key=lambda kv: order.index(kv[0]))
                    text = ", ".join(f"{k} {v:.2f}" for k, v in phases if v >= 0.005)
                    print(f"  {g['id']:<14} {sum(g['phases'].values()):7.2f} s: {text}")
                    if g["choice"]:
                        opts = ", ".join(f"{k}={v}" for k, v in sorted(g["choice"]["options"].items()))
                        print(f"  {'':<14} {opts} ({g['choice']['reason']})")
                if res["profile"]:
                    print(res["profile"])


if __name__ == "__main__":
    main()
