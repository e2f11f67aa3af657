"""FP8 training step on the GPU: Hugging Face's LlamaForCausalLM from a random config (8 layers,
D=2048, FFN 5632, GQA 16:4, T=2048, bf16 autocast, sdpa attention), one training step (forward,
backward, fused AdamW) under enn with ``fp8`` off, rowwise and tensorwise, guard on (default).

    python bench/gpu_fp8_llama.py [--layers 8] [--t 2048] [--rounds 5] [--out DIR]

Prints, and writes to DIR/fp8_llama.md (DIR: --out, else $OUT): step time per variant (median
of interleaved rounds, spread), speedup over enn bf16, loss after the timed steps, how many GEMMs
each variant ran in FP8 and why the others did not, fallback lines, peak memory.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import torch

import enn_backend
from enn_backend.bench.backends import compile_with
from enn_backend.bench.timing import Timer


def llama(t: int, layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=t,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).cuda()


def train_step(model: torch.nn.Module, ids: torch.Tensor):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    last = {}

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        last["loss"] = out.loss
        return out.loss

    return step, last


def fp8_summary() -> tuple[int, int, dict[str, int]]:
    """(GEMMs in FP8, GEMMs seen, why the others stayed: count per rule) from enn's report."""
    fp8 = seen = 0
    why: collections.Counter[str] = collections.Counter()
    for g in enn_backend.report().graphs:
        for c in g.kernel_choices:
            if "role" not in c or "mnk" not in c:
                continue
            seen += 1
            if c["choice"] == "fp8":
                fp8 += 1
            else:
                why[c["reason"].removeprefix("fp8 declined: ").split(":")[0]] += 1
    return fp8, seen, dict(why)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, default=2048)
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default="off,rowwise,tensorwise")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    head = f"torch {torch.__version__}, {torch.cuda.get_device_name()}, LLaMA {args.layers}L d=2048 T={args.t} B={args.b}"
    print(head, flush=True)
    ids = torch.randint(0, 32000, (args.b, args.t), device="cuda")
    fns, info = {}, {}
    for variant in args.variants.split(","):
        torch._dynamo.reset()
        enn_backend.reset()
        t0 = time.time()
        model = llama(args.t, args.layers)
        step, last = train_step(compile_with(model, {"backend": "enn", "options": {"fp8": variant}}), ids)
        step()
        torch.cuda.synchronize()
        fp8, seen, why = fp8_summary()
        falls = [f"{f.kind}: {f.reason[:120]}" for f in enn_backend.report().fallbacks]
        info[variant] = {"compile_s": time.time() - t0, "fp8": fp8, "seen": seen, "why": why, "fallbacks": falls,
                         "last": last}
        fns[variant] = step
        print(f"  {variant}: compiled + first step {time.time() - t0:.0f}s; FP8 GEMMs {fp8}/{seen}; others {why}; "
              f"{len(falls)} fallback line(s)", flush=True)
    torch.cuda.reset_peak_memory_stats()
    samples = Timer("cuda", rounds=args.rounds).measure(fns)
    base = statistics.median(samples["off"]) if "off" in samples else None
    lines = [head, "", "| fp8 | step ms (median) | spread | vs enn bf16 | loss | FP8 GEMMs | others stayed because | fallbacks |",
             "|---|---|---|---|---|---|---|---|"]
    for variant, s in samples.items():
        med = statistics.median(s)
        i = info[variant]
        ratio = f"{base / med:.3f}x" if base else "-"
        lines.append(f"| {variant} | {med:.2f} | {min(s):.2f}-{max(s):.2f} | {ratio} | {float(i['last']['loss']):.4f} | "
                     f"{i['fp8']}/{i['seen']} | {i['why']} | {len(i['fallbacks'])} |")
    lines += ["", f"peak memory (all variants resident): {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB", ""]
    for variant, i in info.items():
        lines += [f"fallbacks under fp8={variant}:"] + [f"  {f}" for f in i["fallbacks"][:12]]
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp8_llama.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
