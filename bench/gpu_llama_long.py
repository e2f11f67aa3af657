"""Long-context LLaMA on the GPU: Hugging Face's LlamaForCausalLM from a random config (2 layers,
D=128, GQA 4:1, bf16 autocast), one training step (forward, backward, AdamW; or with ``--mode
infer`` one forward without gradients, a prefill) under eager, Inductor and enn, with eager and
sdpa attention, with and without left padding; first SDPA alone on the same attention shapes,
fwd+bwd, for every kernel that takes ``is_causal`` (the yardstick for what enn's fused attention
should cost).

    python bench/gpu_llama_long.py [--t 4096] [--impls eager,sdpa] [--pad 0,256] [--mode train|infer] [--out DIR]

Prints a table per row: step time per backend (median of interleaved rounds and spread),
enn/inductor, enn's fusions and kernel choices, fallback lines, host (CPU) and kernel (device)
time per step, peak memory. Writes the rows as JSON to DIR/llama_long.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import enn_backend
from enn_backend.bench.backends import compile_with, enn_summary, enn_units
from enn_backend.bench.timing import Timer, paired_ratio, peak_mem_mb, profile


def llama(impl: str, t: int, layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=t,
                      attn_implementation=impl)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).cuda()


def train_step(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        opt.step()
        return out.loss

    return step


def infer_step(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None):
    """One forward (a prefill): logits of every position, no gradients."""
    model.eval()

    @torch.no_grad()
    def step() -> torch.Tensor:
        with torch.autocast("cuda", torch.bfloat16):
            return model(input_ids=ids, attention_mask=mask).logits

    return step


def host_and_kernel(fns: dict, steps: int = 3) -> dict[str, dict[str, float]]:
    """Per step: host time (from an idle GPU until the step returns, no sync inside: the CPU time
    to issue the step, waits included where the step itself syncs) and device kernel time."""
    out = {}
    prof = profile(fns, "cuda", steps=steps, top=6)
    for name, fn in fns.items():
        host = []
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        out[name] = {"kernel_ms": round(prof[name]["total_ms_per_step"], 3), "host_ms": round(statistics.median(host), 3),
                     "top": [(r["name"][:60], round(r["self_ms_per_step"], 3)) for r in prof[name]["top"]]}
    return out


def sdpa_alone(b: int, h: int, hkv: int, t: int, d: int, rounds: int) -> dict[str, float]:
    """SDPA fwd+bwd on the model's attention shapes (K/V expanded to H heads as HF's repeat_kv does)."""
    q = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)
    bias = torch.zeros(b, 1, t, t, device="cuda", dtype=torch.bfloat16).masked_fill_(
        torch.ones(t, t, device="cuda", dtype=torch.bool).triu(1), torch.finfo(torch.bfloat16).min)
    fns = {}
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def run(be=be):
            with sdpa_kernel([be]):
                F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)
        fns[f"{name} causal"] = run

    def biased():
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            F.scaled_dot_product_attention(q, k, v, attn_mask=bias.expand(b, h, t, t)).backward(g)
    fns["efficient + T*T bias"] = biased
    ok = {}
    for name, fn in fns.items():
        try:
            fn()
            ok[name] = fn
        except RuntimeError as e:
            print(f"  sdpa {name}: not available ({str(e)[:80]})")
    samples = Timer("cuda", rounds=rounds).measure(ok)
    return {n: round(statistics.median(s), 3) for n, s in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, default=4096)
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--impls", default="eager,sdpa")
    ap.add_argument("--pad", default="0,256", help="left-padding lengths of sample 0 (0: no mask passed)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mode", default="train", choices=("train", "infer"),
                    help="train: forward, backward, AdamW; infer: one forward without gradients")
    ap.add_argument("--no-sdpa-alone", action="store_true", help="skip timing SDPA alone on the shapes")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, T={args.t} B={args.b}", flush=True)
    rows = []
    if not args.no_sdpa_alone:
        sd = sdpa_alone(args.b, 16, 4, args.t, 128, args.rounds)
        print("SDPA alone, fwd+bwd ms: " + ", ".join(f"{k} {v}" for k, v in sd.items()), flush=True)
        rows.append({"sdpa_alone_fwd_bwd_ms": sd})
    make_step = train_step if args.mode == "train" else infer_step
    for impl in args.impls.split(","):
        for pad in (int(p) for p in args.pad.split(",")):
            t0 = time.time()
            torch._dynamo.reset()
            enn_backend.reset()
            ids = torch.randint(0, 32000, (args.b, args.t), device="cuda")
            mask = None
            if pad:
                mask = torch.ones(args.b, args.t, dtype=torch.long, device="cuda")
                mask[0, :pad] = 0
            fns = {}
            for backend in ("eager", "inductor", "enn"):
                m = llama(impl, args.t, args.layers)
                fns[backend] = make_step(m if backend == "eager" else compile_with(m, {"backend": backend}), ids, mask)
            samples = Timer("cuda", rounds=args.rounds).measure(fns)
            enn = enn_summary(enn_units())
            med = {n: round(statistics.median(s), 3) for n, s in samples.items()}
            spread = {n: round((max(s) - min(s)) / statistics.median(s) * 100, 1) for n, s in samples.items()}
            peaks = {n: round(peak_mem_mb(f, "cuda") or 0) for n, f in fns.items()}
            hk = host_and_kernel(fns)
            row = {"impl": impl, "pad": pad, "mode": args.mode, "ms": med, "spread_pct": spread,
                   "enn_vs_inductor": round(paired_ratio(samples["inductor"], samples["enn"]), 3),
                   "peak_mib": peaks, "host_kernel": hk, "fusions": enn["fusions"],
                   "kernel_choices": enn["kernel_choices"][:4], "fallbacks": enn["fallback_details"],
                   "seconds": round(time.time() - t0, 1)}
            rows.append(row)
            print(f"{impl:6s} {args.mode} pad={pad:<4d} eager {med['eager']:8.2f}  inductor {med['inductor']:8.2f}  "
                  f"enn {med['enn']:8.2f} ms  enn/inductor {row['enn_vs_inductor']:.3f}x  "
                  f"spread {spread}  peak {peaks}  fusions {enn['fusions']}  ({row['seconds']} s)", flush=True)
            for n, v in hk.items():
                print(f"    {n:9s} kernel {v['kernel_ms']:8.2f} ms  host {v['host_ms']:8.2f} ms  top {v['top'][:3]}")
            print(f"    kernel choices: {row['kernel_choices']}\n    fallbacks: {row['fallbacks']}", flush=True)
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, "llama_long.json"), "w") as f:
                    json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
