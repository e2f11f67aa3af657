"""A decode-sized inference step under CUDA graphs (``mode="reduce-overhead"``), enn against Inductor.

    python bench/gpu_decode_cudagraphs.py [--rounds 15] [--steps 50] [--batch 8] [--tokens 1]

A transformers LLaMA from a random config (2 layers, hidden 1024, GQA 4:1, bf16 weights), one
forward over ``--tokens`` new tokens per sequence (no KV cache: the step's size is what a decode
step launches), so that a step is launch-bound. Variants: eager, Inductor and enn with default
options and with ``reduce-overhead``, timed interleaved (median of rounds, interquartile spread);
every compiled variant's logits are checked against eager's first. Then the guard under CUDA
graphs: enn ``reduce-overhead`` with a NaN injected into one ``mm`` kernel must return eager's
logits on every step, the faulting one included, with the fault recorded and pinned.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

import enn_backend
from enn_backend.bench.backends import compile_with
from enn_backend.bench.timing import Timer, spread_pct

RO = {"mode": "reduce-overhead"}
VARIANTS = {
    "eager": None,
    "inductor": dict(backend="inductor"),
    "inductor reduce-overhead": dict(backend="inductor", mode="reduce-overhead"),
    "enn": dict(backend="enn"),
    "enn reduce-overhead": dict(backend="enn", options=RO),
}
# --guard-variants: where enn's time under CUDA graphs goes, the guard's parts one by one (as bench/host_tax.py)
GUARD_VARIANTS = {
    "enn reduce-overhead, screens only": dict(backend="enn", options={**RO, "guard_values": 0}),
    "enn reduce-overhead, fast path only": dict(backend="enn", options={**RO, "guard_every": 10**9, "guard_values": 0}),
    "enn reduce-overhead, guard off": dict(backend="enn", options={**RO, "guard": "off"}),
}


def build(batch: int, tokens: int):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=1024, intermediate_size=2816,
                                   num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                                   max_position_embeddings=256, attn_implementation="sdpa")
    cfg.use_cache = False
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(3, 32000, (batch, tokens), device="cuda")
    return model, ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--guard-variants", action="store_true",
                    help="also time enn reduce-overhead with screens only, the guard's fast path only, and guard off")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    variants = {**VARIANTS, **(GUARD_VARIANTS if args.guard_variants else {})}
    torch._dynamo.config.recompile_limit = 64  # one module, compiled once per variant
    model, ids = build(args.batch, args.tokens)

    def logits(f):
        with torch.no_grad():
            return f(input_ids=ids).logits

    want = logits(model).float()
    fns, compiled = {}, {}
    for name, kw in variants.items():
        f = model if kw is None else compile_with(model, kw)
        compiled[name] = f
        got = logits(f).float()
        for _ in range(30):  # past the guard's warm-up and Inductor's CUDA-graph recording
            got = logits(f).float()
        err = (got - want).abs().max().item()
        print(f"{name:26s} max |logits - eager| {err:.3g}")
        fns[name] = lambda f=f: logits(f)
    samples = Timer("cuda", rounds=args.rounds, steps_per_sample=args.steps).measure(fns)
    base = statistics.median(samples["inductor reduce-overhead"])
    rows = {}
    print(f"\nbatch {args.batch}, {args.tokens} token(s) per sequence: ms per step (median of {args.rounds} "
          f"interleaved rounds x {args.steps} steps)")
    print("| variant | ms | spread | vs inductor reduce-overhead |\n|---|---|---|---|")
    for name, s in samples.items():
        med = statistics.median(s)
        rows[name] = {"ms": round(med, 4), "spread_pct": round(spread_pct(s), 1), "vs_inductor_ro": round(base / med, 3)}
        print(f"| {name} | {med:.4f} | {rows[name]['spread_pct']}% | {base / med:.3f}x |")

    torch._dynamo.reset()
    enn_backend.reset()
    faulty = compile_with(model, dict(backend="enn", options={**RO, "fault_inject": "aten.mm:nan:fwd", "persist": False}))
    worst = max((logits(faulty).float() - want).abs().max().item() for _ in range(6))
    rep = enn_backend.report().to_dict()
    fbs = [(f["kind"], f["node"], f["action"]) for f in rep["fallbacks"] if f["kind"] != "pinned_from_state"]
    print(f"\nNaN injected in aten.mm under reduce-overhead: worst |logits - eager| over 6 steps {worst:.3g}; "
          f"fallbacks: {fbs}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_cudagraphs.json"), "w") as fh:
            json.dump({"rows": rows, "fault_worst_abs": worst, "fallbacks": fbs}, fh, indent=1)


if __name__ == "__main__":
    main()
