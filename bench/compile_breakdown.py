"""Cold first call per workload and compiler, with where its compile time went, by phase.

Each (workload, mode, variant) runs in a new process with empty caches (its own
TORCHINDUCTOR_CACHE_DIR and ENN_CACHE_DIR): the model is built, compiled and its first step
(training: forward, backward, optimizer; inference: one forward) timed by the wall clock, then
the phases are printed. The phases are the rules of ``enn_backend.compile_time`` applied to
torch's compile events, for Inductor too (it has no guard, so no ``guard`` / ``first_run``); under
enn they are the report's per graph, with each graph's build choice (C++ wrapper, combo kernels).

Variants: ``inductor``; ``enn``; ``enn host rule on`` (enn with the rule of
``enn_backend.build_choice`` applied: its launch-saving defaults only on host-bound graphs).

Run:  python bench/compile_breakdown.py [--only hf_llama_eager,timm_vit_small] [--modes train,infer]
          [--variants "inductor,enn,enn host rule on"] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

VARIANTS = ("inductor", "enn", "enn host rule on")


def one(name: str, mode: str, variant: str, device: str) -> dict:
    """The cold first step of ``name`` under ``variant``, in this process."""
    import torch

    import enn_backend
    from enn_backend import build_choice, models
    from enn_backend.bench.steps import autocast, timed_step
    from enn_backend.compat.compile_events import EVENT_TAPE
    from enn_backend.compile_time import attribute
    from enn_backend.report import GraphRecord

    if variant == "enn host rule on":
        build_choice.APPLIED = True
    entry = models.build(name, "gpu-real" if device == "cuda" else "cpu-small", device=device, seed=0)
    opt = torch.optim.AdamW(entry.model.parameters(), lr=1e-4) if mode == "train" else None
    fn = torch.compile(entry.model, backend="inductor" if variant == "inductor" else "enn")
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
    t0 = time.perf_counter()
    step()
    if device == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    stop()
    graphs = ([{"id": "all graphs", "phases": whole.compile_phases, "choice": {}}] if variant == "inductor" else
              [{"id": g.id, "phases": g.compile_phases, "choice": g.build_choices} for g in enn_backend.report().graphs])
    return {"first_s": first, "graphs": graphs, "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="hf_llama_eager,hf_gpt2_eager,hf_bert_sdpa,timm_vit_small")
    ap.add_argument("--modes", default="train")
    ap.add_argument("--variants", default="inductor,enn")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--one", nargs=4, metavar=("WORKLOAD", "MODE", "VARIANT", "DEVICE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one(*a.one)))
        return
    from enn_backend.report import CompilePhase

    order = [p.value for p in CompilePhase]
    for name in a.only.split(","):
        for mode in a.modes.split(","):
            firsts: dict[str, float] = {}
            for variant in a.variants.split(","):
                with tempfile.TemporaryDirectory() as ind, tempfile.TemporaryDirectory() as enn:
                    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=ind, ENN_CACHE_DIR=enn)
                    proc = subprocess.run([sys.executable, __file__, "--one", name, mode, variant, a.device],
                                          env=env, capture_output=True, text=True)
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if line is None:
                    print(f"{name} {mode} {variant}: failed\n{proc.stderr[-2000:]}")
                    continue
                res = json.loads(line[len("RESULT "):])
                firsts[variant] = res["first_s"]
                ratio = f" ({res['first_s'] / firsts['inductor']:.2f}x inductor)" if "inductor" in firsts and variant != "inductor" else ""
                print(f"{name} {mode} {variant}: cold first step {res['first_s']:.2f} s{ratio} (torch {res['torch']})")
                for g in res["graphs"]:
                    phases = sorted(g["phases"].items(), key=lambda kv: order.index(kv[0]))
                    text = ", ".join(f"{k} {v:.2f}" for k, v in phases if v >= 0.005)
                    print(f"  {g['id']:<14} {sum(g['phases'].values()):7.2f} s: {text}")
                    if g["choice"]:
                        opts = ", ".join(f"{k}={v}" for k, v in sorted(g["choice"]["options"].items()))
                        print(f"  {'':<14} {opts} ({g['choice']['reason']})")


if __name__ == "__main__":
    main()
