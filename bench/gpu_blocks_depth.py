"""Compile time and step time against depth: Hugging Face's LlamaForCausalLM from a random config
(d=1024, FFN 2816, 16 heads, 4 K/V heads, T=1024, batch 4, bf16 autocast, SDPA attention),
training (forward, backward, fused AdamW), at several depths, under Inductor and under enn
with option ``blocks`` on and off. ``--device cpu`` runs a small model instead (d=256, FFN 688,
4 heads, 2 K/V heads, T=128, batch 2, fp32, AdamW): compile time per layer, on any machine.

    python bench/gpu_blocks_depth.py [--device cuda|cpu] [--layers 2,8,32] [--variants inductor,enn-blocks,enn]
                                     [--steps 20] [--profile N] [--out DIR]

Every (depth, variant) runs in a new process with empty Inductor and Triton caches, one after
another (a first untimed process warms the machine: compile workers, the C++ wrapper's
precompiled header). Per run: the first step's wall time (Dynamo, AOT Autograd, enn, Inductor,
kernel builds, the guard's first checks and the step itself), the median step time after it
(CUDA events around each of ``--steps`` steps, after untimed ones past enn's guard warm-up), the first losses (the runs
start from one seed: enn's must match Inductor's to bf16 rounding), peak memory, and enn's
``blocks.compiled`` / ``blocks.reused`` counters, and under enn the first step's compile phases
summed over its graphs (``enn_backend.compile_time``). ``--profile N`` adds the N functions with
the most cumulative time in the first step (cProfile of the main process: it slows the step). Writes DIR/blocks_depth.md and .json (DIR:
--out, else $OUT, else the current folder is NOT used: the table is printed only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = {
    "inductor": ("inductor", {}),
    "enn": ("enn", {"blocks": "off"}),
    "enn-blocks": ("enn", {"blocks": "on"}),
}
# the model per device: (hidden, FFN, heads, K/V heads, vocabulary, T, batch)
SIZES = {"cuda": (1024, 2816, 16, 4, 32000, 1024, 4), "cpu": (256, 688, 4, 2, 1000, 128, 2)}


def child(layers: int, variant: str, steps: int, device: str, profile: int) -> dict:
    import contextlib

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    backend, options = VARIANTS[variant]
    d, ffn, heads, kv, vocab, t, batch = SIZES[device]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=t,
                      use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device)
    ids = torch.randint(0, vocab, (batch, t), device=device, generator=torch.Generator(device).manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    kw = {"options": options} if backend == "enn" else {}
    compiled = torch.compile(model, backend=backend, **kw)
    precision = torch.autocast("cuda", torch.bfloat16) if device == "cuda" else contextlib.nullcontext()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step() -> float:
        with precision:
            loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    sync()
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    losses = [step()]
    sync()
    first = time.perf_counter() - t0
    if prof is not None:
        import io
        import pstats

        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(profile)
        print(text.getvalue(), file=sys.stderr)
    import enn_backend.options as O

    for _ in range(O.Options().guard_warmup + 5 if steps else 0):  # past the guard's warm-up (every call checked)
        losses.append(step())
    times = []
    for _ in range(steps):  # none: the first step alone (--steps 0)
        sync()
        a = time.perf_counter()
        step()
        sync()
        times.append(1e3 * (time.perf_counter() - a))
    out = {"layers": layers, "variant": variant, "first_step_s": round(first, 2),
           "step_ms": round(statistics.median(times), 3) if times else 0.0,
           "step_spread_pct": round(100 * (max(times) - min(times)) / statistics.median(times), 1) if times else 0.0,
           "losses": [round(float(x), 5) for x in losses[:4]],
           "peak_mem_mib": round(torch.cuda.max_memory_allocated() / 2 ** 20)}
    if backend == "enn":
        import enn_backend

        rep = enn_backend.report().to_dict()
        out["blocks_compiled"] = rep["counters"].get("blocks.compiled", 0)
        out["blocks_reused"] = rep["counters"].get("blocks.reused", 0)
        out["fallbacks"] = [f"{f['kind']}: {f['reason'][:120]}" for f in rep["fallbacks"]]
        out["fusions"] = rep["fusions"]
        phases: dict[str, float] = {}
        for g in rep["graphs"]:
            for k, v in g.get("compile_phases", {}).items():
                phases[k] = phases.get(k, 0.0) + v
        out["phases_s"] = {k: round(v, 2) for k, v in sorted(phases.items(), key=lambda kv: -kv[1])}
    return out


def run_child(layers: int, variant: str, steps: int, device: str, profile: int = 0) -> dict:
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="blocks-inductor-")
    env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="blocks-triton-")
    env["ENN_CACHE_DIR"] = tempfile.mkdtemp(prefix="blocks-enn-")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", str(layers), variant, str(steps), device, str(profile)],
                          env=env, capture_output=True, text=True)
    if profile:
        print(proc.stderr[-20000:], file=sys.stderr)
    wall = time.perf_counter() - t0
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
    if proc.returncode or line is None:
        return {"layers": layers, "variant": variant, "error": (proc.stderr or proc.stdout)[-1500:]}
    return json.loads(line) | {"process_s": round(wall, 1)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        print(json.dumps(child(int(argv[1]), argv[2], int(argv[3]), argv[4], int(argv[5]))), flush=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="2,8,32")
    ap.add_argument("--variants", default="inductor,enn-blocks,enn")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda", choices=sorted(SIZES))
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; valid: {', '.join(VARIANTS)}")
    print("warm-up:", json.dumps(run_child(1, "enn-blocks", 2, args.device).get("first_step_s")), flush=True)
    rows = []
    for layers in [int(x) for x in args.layers.split(",")]:
        for v in variants:
            r = run_child(layers, v, args.steps, args.device, args.profile)
            rows.append(r)
            print(json.dumps(r), flush=True)
    base = {(r["layers"]): r for r in rows if r["variant"] == "inductor" and "error" not in r}
    lines = ["| layers | variant | first step s | vs Inductor | step ms | vs Inductor | spread % | losses | peak MiB | compiled / reused |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layers']} | {r['variant']} | error | | | | | {r['error'][-200:]!r} | | |")
            continue
        b = base.get(r["layers"])
        lines.append(
            f"| {r['layers']} | {r['variant']} | {r['first_step_s']} | "
            f"{r['first_step_s'] / b['first_step_s']:.2f}x | {r['step_ms']} | "
            f"{b['step_ms'] / r['step_ms'] if r['step_ms'] else 0:.3f}x | {r['step_spread_pct']} | {r['losses']} | {r['peak_mem_mib']} | "
            f"{r.get('blocks_compiled', '-')} / {r.get('blocks_reused', '-')} |" if b else f"| {r['layers']} | {r['variant']} | {r['first_step_s']} | - | {r['step_ms']} | - | | | | |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "blocks_depth.md"), "w") as f:
            f.write(f"python bench/gpu_blocks_depth.py {' '.join(argv)}\n\n{table}\n")
        with open(os.path.join(args.out, "blocks_depth.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
