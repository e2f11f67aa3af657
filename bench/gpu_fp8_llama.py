"""FP8 training step on the GPU: Hugging Face's LlamaForCausalLM from a random config (8 layers,
D=2048, FFN 5632, GQA 16:4, T=2048, bf16 autocast, sdpa attention), one training step (forward,
backward, fused AdamW) under enn with ``fp8`` off, rowwise and tensorwise, guard on (default).

    python bench/gpu_fp8_llama.py [--layers 8] [--t 2048] [--b 1] [--rounds 5] [--profile]
                                  [--variants off,rowwise,tensorwise,inductor,ao-tensorwise:enn] [--out DIR]

Variants: ``off`` / ``rowwise`` / ``tensorwise`` are enn with that ``fp8`` option; ``inductor``
is Inductor in bf16; ``ao-RECIPE:BACKEND`` is the model converted by torchao's
``convert_to_float8_training`` (that recipe, every linear but ``lm_head``; torchao installed
or carried as a wheel) and compiled by BACKEND (``inductor`` or ``enn``, guard on).

Prints, and writes to DIR/fp8_llama.md (DIR: --out, else $OUT): step time per variant (median
of interleaved rounds, spread), speedup over enn bf16, loss after the timed steps, how many GEMMs
each variant ran in FP8 and why the others did not, how its FP8 GEMMs were compiled (lowered by
enn's ``enn::fp8_mm`` lowering: fused quantization kernels and one scaled GEMM each; or extern
calls of the op's eager kernel; or pinned by the guard to the bf16 GEMM), with the reason of each
lowering fallback, fallback lines, peak memory. With ``--profile``, each variant's GPU kernel time
per step by kind (:data:`KINDS`: bf16 and FP8 GEMMs, the quantization kernels, attention, the rest)
and its top kernels, from ``torch.profiler``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
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


# kernel kinds, first match wins: a kernel's name (cuBLAS / CUTLASS / Triton) against each pattern.
# Inductor names a kernel after the graph ops it fuses: a pointwise or reduction kernel fused from
# an FP8 GEMM's node (``..._mm_...``) holds that GEMM's operand quantization.
KINDS = (
    ("fp8 gemm", re.compile(r"e4m3|e5m2|f8f8|fp8|scaled_mm|_f8_|qqtst|qrtst|rqtst", re.I)),
    ("quantize", re.compile(r"^triton_(poi|red|per)_fused.*_mm(_|$)|amax|clamp_max|clamp_min", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|sm80_|cublas|triton_tem_", re.I)),
    ("optimizer", re.compile(r"adam|foreach|multi_tensor", re.I)),
)


def kernel_kinds(prof: dict) -> dict[str, float]:
    """ms per step of GPU kernel time by kind (:data:`KINDS`, else ``other``), from a
    :func:`enn_backend.bench.timing.profile` entry (its ``top`` list holds every kernel)."""
    out: collections.Counter[str] = collections.Counter()
    for k in prof["top"]:
        kind = next((name for name, pat in KINDS if pat.search(k["name"])), "other")
        out[kind] += k["self_ms_per_step"]
    return dict(out)


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


def build(variant: str, t: int, layers: int) -> tuple[torch.nn.Module, dict]:
    """The model of ``variant`` (module doc) and how to compile it."""
    model = llama(t, layers)
    if variant == "inductor":
        return model, {"backend": "inductor"}
    if variant.startswith("ao-"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        recipe, backend = variant.removeprefix("ao-").split(":")
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                   module_filter_fn=lambda mod, fqn: fqn != "lm_head")
        return model, {"backend": backend}
    return model, {"backend": "enn", "options": {"fp8": variant}}


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


@contextlib.contextmanager
def generated_code(sink: list[str]):
    """Append the output code of every graph Inductor generates (or loads from its FX graph
    cache) meanwhile to ``sink``, one entry per graph (what ``run_and_get_code`` reads)."""
    from torch._inductor.graph import GraphLowering  # Inductor's internals: its output code (no public API)

    old = GraphLowering.save_output_code

    def save(code: str) -> None:
        sink.append(code)
        if old is not None:
            old(code)

    GraphLowering.save_output_code = save
    try:
        yield
    finally:
        GraphLowering.save_output_code = old


def fp8_compiled(codes: list[str], fp8: int) -> dict[str, int | None]:
    """How the ``fp8`` FP8 GEMMs of a variant were compiled, from its generated code: ``extern``
    (calls of the op's eager kernel, ``torch.ops.enn.fp8_mm``), ``pinned`` (the guard's
    ``enn::pinned`` safe path: the bf16 GEMM), ``lowered`` (the others: enn's lowering), and
    ``scaled_mm_calls`` (extern ``_scaled_mm`` calls; a GEMM Inductor gave to a Triton template
    is a template kernel instead). Every graph generated for the variant counts, a guard's
    recompiles too. All None where no generated code was seen (nothing to count from)."""
    if not codes:
        return {"lowered": None, "extern": None, "pinned": None, "scaled_mm_calls": None}
    extern = sum(len(re.findall(r"torch\.ops\.enn\.fp8_mm\.default\(", c)) for c in codes)
    pinned = sum(c.count('"op": "enn.fp8_mm.default"') for c in codes)
    scaled = sum(c.count("extern_kernels._scaled_mm(") for c in codes)
    return {"lowered": max(fp8 - extern - pinned, 0), "extern": extern, "pinned": pinned, "scaled_mm_calls": scaled}


def lowering_fallbacks() -> set[str]:
    """The reasons enn's enn::fp8_mm lowering fell back to the extern op so far in this process."""
    from enn_backend.lowerings import fp8 as lowering

    return set(lowering.fallback_reasons())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, default=2048)
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default="off,rowwise,tensorwise")
    ap.add_argument("--profile", action="store_true", help="kernel time per step by kind, per variant")
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
        model, spec = build(variant, args.t, args.layers)
        step, last = train_step(compile_with(model, spec), ids)
        codes: list[str] = []
        known = lowering_fallbacks()
        with generated_code(codes):  # the compile happens in the first step (the backward's in its backward)
            step()
        torch.cuda.synchronize()
        fp8, seen, why = fp8_summary()
        how = fp8_compiled(codes, fp8)
        not_lowered = sorted(lowering_fallbacks() - known)
        falls = [f"{f.kind}: {f.reason[:120]}" for f in enn_backend.report().fallbacks]
        info[variant] = {"compile_s": time.time() - t0, "fp8": fp8, "seen": seen, "why": why, "fallbacks": falls,
                         "last": last, "how": how, "not_lowered": not_lowered}
        fns[variant] = step
        print(f"  {variant}: compiled + first step {time.time() - t0:.0f}s; FP8 GEMMs {fp8}/{seen}; others {why}; "
              f"enn.fp8_mm lowered {how['lowered']}, extern calls {how['extern']}, pinned {how['pinned']} "
              f"({how['scaled_mm_calls']} extern _scaled_mm calls, {len(codes)} graph(s)); "
              f"{len(falls)} fallback line(s)", flush=True)
        for reason in not_lowered:
            print(f"    enn.fp8_mm not lowered: {reason}", flush=True)
    torch.cuda.reset_peak_memory_stats()
    samples = Timer("cuda", rounds=args.rounds).measure(fns)
    base = statistics.median(samples["off"]) if "off" in samples else None
    lines = [head, "", "| fp8 | step ms (median) | spread | vs enn bf16 | loss | FP8 GEMMs | others stayed because | "
                       "enn.fp8_mm lowered / extern / pinned | fallbacks |",
             "|---|---|---|---|---|---|---|---|---|"]
    for variant, s in samples.items():
        med = statistics.median(s)
        i = info[variant]
        ratio = f"{base / med:.3f}x" if base else "-"
        lines.append(f"| {variant} | {med:.2f} | {min(s):.2f}-{max(s):.2f} | {ratio} | {float(i['last']['loss']):.4f} | "
                     f"{i['fp8']}/{i['seen']} | {i['why']} | {i['how']['lowered']} / {i['how']['extern']} / "
                     f"{i['how']['pinned']} | {len(i['fallbacks'])} |")
    lines += ["", f"peak memory (all variants resident): {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB", ""]
    for variant, i in info.items():
        lines += [f"fallbacks under fp8={variant}:"] + [f"  {f}" for f in i["fallbacks"][:12]]
        lines += [f"  enn.fp8_mm not lowered: {r}" for r in i["not_lowered"]]
    if args.profile:
        from enn_backend.bench.timing import profile

        profs = profile(fns, "cuda", steps=3, top=10_000)
        kinds = sorted({k for p in profs.values() for k in kernel_kinds(p)})
        lines += ["", "GPU kernel time per step by kind (ms; torch.profiler, 3 steps):", "",
                  "| fp8 | total | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 2) + "|"]
        for variant, p in profs.items():
            by = kernel_kinds(p)
            lines.append(f"| {variant} | {p['total_ms_per_step']:.2f} | "
                         + " | ".join(f"{by.get(k, 0.0):.2f}" for k in kinds) + " |")
        for variant, p in profs.items():
            lines += ["", f"top kernels under fp8={variant} (ms per step, calls per step):"]
            lines += [f"  {k['self_ms_per_step']:7.3f} {k['calls_per_step']:6.1f}  {k['name']}" for k in p["top"][:25]]
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp8_llama.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
