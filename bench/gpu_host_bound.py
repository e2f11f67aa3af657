"""Host-bound steps under CUDA graphs, the parts the suite's tables do not show (issue #43).

    python bench/gpu_host_bound.py --part state      # BatchNorm statistics and parameters after N steps
    python bench/gpu_host_bound.py --part padding    # a training loop with dynamic padding
    python bench/gpu_host_bound.py --part generate   # HF generate with a static KV cache
    [--steps 100] [--out DIR] [--budget-s 540] [--tiny]   (--tiny: small sizes, for a CPU smoke run)

Step times of the suite's host-bound models under each backend's default mode and CUDA graphs are
the suite's (``python -m enn_backend bench --preset host-bound``); this tool adds:

- **state**: torchvision ResNet-50 trained ``--steps`` steps (AdamW, batch 32, 224 px) under eager,
  Inductor ``reduce-overhead`` and enn (default and ``reduce-overhead``), fp32 and bf16 autocast:
  the largest difference from eager's of every BatchNorm running mean / variance, the batch counters,
  the parameters and AdamW's moments (fp32 and bf16), and each backend's step time.
- **padding**: HF BERT (masked LM, 2 layers, hidden 768) trained on batches of 20 different
  lengths (32..512, right-padded, the order shuffled per epoch), as Hugging Face's dynamic padding
  makes them: enn and Inductor, default and ``reduce-overhead``; the time of the epochs after the
  first (which compiles), how many CUDA graphs each recorded, and the loss of the last epoch against
  eager's.
- **generate**: ``model.generate(cache_implementation="static", max_new_tokens=256, greedy)`` of HF
  LLaMA-style and Qwen2-style models (4 layers, random weights, bf16), batch 1 and 8, ``forward``
  compiled through transformers' own ``compile_config`` (how a user hands a backend to generate):
  eager, Inductor ``reduce-overhead``, enn default and ``reduce-overhead``; tokens per second of a
  warm call, the tokens against eager's greedy tokens, the KV cache against eager's.

Writes DIR/host_bound_<part>.json and .md (DIR: --out, else $OUT, else the current folder is NOT
used: the run prints only). Each part stops starting new variants past --budget-s.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from typing import Any, Callable

import torch

import enn_backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def compiled(model: torch.nn.Module, variant: str) -> Callable:
    """``model`` compiled as ``variant`` says (its backend and mode), or the model itself (eager)."""
    if variant == "eager":
        return model
    backend, _, mode = variant.partition(" ")
    if backend == "enn":
        return torch.compile(model, backend="enn", options={"mode": mode} if mode else None)
    return torch.compile(model, backend="inductor", mode=mode or None)


def cudagraph_counts() -> dict[str, int]:
    """enn's report counters about CUDA graphs (recorded sizes, calls run without capture)."""
    total: dict[str, int] = {}
    for g in enn_backend.report().graphs:
        for k, v in g.counters.items():
            if "cudagraph" in k or "uncaptured" in k:
                total[k] = total.get(k, 0) + v
    return total


_recorded = [0]


def count_recordings() -> None:
    """Count the CUDA graphs Inductor's CUDA-graph trees record (each a ``CUDAGraphNode``), for
    every backend that uses them; read with :func:`inductor_recordings`."""
    from torch._inductor import cudagraph_trees

    node = cudagraph_trees.CUDAGraphNode
    if getattr(node.__init__, "_counted", False):
        return
    init = node.__init__

    def counted(self, *args: Any, **kwargs: Any) -> None:
        _recorded[0] += 1
        init(self, *args, **kwargs)

    counted._counted = True  # type: ignore[attr-defined]
    node.__init__ = counted


def inductor_recordings() -> int:
    """CUDA graphs Inductor's CUDA-graph trees recorded in this process so far."""
    return _recorded[0]


def fresh_process_state() -> None:
    torch.compiler.reset()
    enn_backend.reset()


def md_table(rows: list[dict[str, Any]], cols: list[str]) -> list[str]:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e-2 and v != 0 else f"{v:.3f}"
        return str(v)

    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] + [
        "| " + " | ".join(cell(r.get(c, "-")) for c in cols) + " |" for r in rows]


# ---------------------------------------------------------------- state
def part_state(args: argparse.Namespace) -> dict[str, Any]:
    import torchvision

    batch, img = (4, 32) if args.tiny else (32, 224)
    torch.manual_seed(0)
    base = torchvision.models.resnet50(weights=None, num_classes=1000).to(DEVICE)
    g = torch.Generator(device="cpu").manual_seed(1)
    data = [(torch.randn(batch, 3, img, img, generator=g).to(DEVICE),
             torch.randint(0, 1000, (batch,), generator=g).to(DEVICE)) for _ in range(4)]
    cols = ["dtype", "variant", "step ms", "first step s", "max |d| running_mean", "max |d| running_var",
            "max |d| num_batches_tracked", "max |d| param", "max |d| adamw", "rel running_mean", "rel running_var",
            "rel param", "rel adamw", "fallbacks"]
    what = f"ResNet-50, batch {batch}, {img} px, {args.steps} AdamW steps at lr {args.lr}"
    rows, t_start = [], time.perf_counter()
    for dtype in args.dtypes.split(","):
        finals: dict[str, dict[str, torch.Tensor]] = {}
        for variant in ["eager"] + [v for v in args.variants.split(",") if v != "eager"]:
            if time.perf_counter() - t_start > args.budget_s:
                rows.append({"dtype": dtype, "variant": variant, "note": "skipped: budget"})
                continue
            fresh_process_state()
            model = copy.deepcopy(base).train()
            fn = compiled(model, variant)
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
            amp = torch.autocast(DEVICE, torch.bfloat16, enabled=dtype == "bf16")
            times = []
            for step in range(args.steps):
                x, y = data[step % len(data)]
                sync()
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                with amp:
                    loss = torch.nn.functional.cross_entropy(fn(x), y)
                loss.backward()
                opt.step()
                sync()
                times.append(time.perf_counter() - t0)
            state = {f"buffer {k}": v.detach().clone() for k, v in model.named_buffers()}
            state.update({f"param {k}": p.detach().clone() for k, p in model.named_parameters()})
            for k, p in model.named_parameters():
                for s, v in opt.state[p].items():
                    if torch.is_tensor(v):
                        state[f"adamw {s} {k}"] = v.detach().clone()
            finals[variant] = state
            row = {"dtype": dtype, "variant": variant, "step ms": 1e3 * statistics.median(times[args.steps // 2:]),
                   "first step s": times[0]}
            if variant != "eager" and "eager" in finals:
                ref = finals["eager"]
                for group in ("running_mean", "running_var", "num_batches_tracked", "param", "adamw"):
                    keys = [k for k in ref if group in k]
                    row[f"max |d| {group}"] = max(float((state[k].double() - ref[k].double()).abs().max()) for k in keys)
                    # the same, each tensor's difference over its largest magnitude in eager's run
                    row[f"rel {group}"] = max(float((state[k].double() - ref[k].double()).abs().max()
                                                    / ref[k].double().abs().max().clamp_min(1e-30)) for k in keys)
                row["fallbacks"] = len(enn_backend.report().fallbacks) if variant.startswith("enn") else "-"
                row.update(cudagraph_counts() if variant.startswith("enn") else {})
            rows.append(row)
            args.partial(rows, cols, what)
            del fn, model, opt
    return {"rows": rows, "columns": cols, "what": what}


# ---------------------------------------------------------------- padding
def part_padding(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    lengths = list(range(32, 513, 24))[:20] if not args.tiny else list(range(8, 48, 2))
    batch, layers = (2, 1) if args.tiny else (16, 2)
    cfg = transformers.BertConfig(vocab_size=30522 if not args.tiny else 128, hidden_size=768 if not args.tiny else 64,
                                  num_hidden_layers=layers, num_attention_heads=12 if not args.tiny else 4,
                                  intermediate_size=3072 if not args.tiny else 128, max_position_embeddings=512,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    torch.manual_seed(0)
    base = transformers.BertForMaskedLM(cfg).to(DEVICE).train()
    g = torch.Generator().manual_seed(2)
    batches = []
    for n in lengths:
        ids = torch.randint(5, cfg.vocab_size, (batch, n), generator=g)
        mask = torch.ones(batch, n, dtype=torch.long)
        mask[1:, n - n // 4:] = 0  # the shorter sequences of the batch, right-padded to its longest
        labels = ids.masked_fill(mask == 0, -100)
        batches.append(tuple(t.to(DEVICE) for t in (ids.masked_fill(mask == 0, 0), mask, labels)))
    epochs = 3
    if DEVICE == "cuda":
        count_recordings()
    orders = [torch.randperm(len(batches), generator=g).tolist() for _ in range(epochs)]
    cols = ["variant", "first epoch s", "later epochs s (each)", "speed-up vs enn default", "dynamo graphs",
            "CUDA graphs recorded", "cudagraph_shapes", "uncaptured_shapes", "uncaptured_calls", "max |loss - eager|", "fallbacks"]
    what = (f"HF BERT MLM, {layers} layers, batch {batch}, {len(lengths)} lengths {lengths[0]}..{lengths[-1]}, "
            f"{epochs} epochs of {len(lengths)} steps, bf16 autocast, AdamW")
    rows, t_start = [], time.perf_counter()
    for variant in ["eager"] + [v for v in args.variants.split(",") if v != "eager"]:
        if time.perf_counter() - t_start > args.budget_s:
            rows.append({"variant": variant, "note": "skipped: budget"})
            continue
        fresh_process_state()
        rec0 = inductor_recordings()
        graphs0 = int(torch._dynamo.utils.counters["stats"].get("unique_graphs", 0))
        model = copy.deepcopy(base)
        fn = compiled(model, variant)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        epoch_s, losses = [], []
        for order in orders:
            sync()
            t0 = time.perf_counter()
            losses = []
            for i in order:
                ids, mask, labels = batches[i]
                opt.zero_grad(set_to_none=True)
                with torch.autocast(DEVICE, torch.bfloat16, enabled=DEVICE == "cuda"):
                    loss = fn(input_ids=ids, attention_mask=mask, labels=labels).loss
                loss.backward()
                opt.step()
                losses.append(loss.detach().clone())
            sync()
            epoch_s.append(time.perf_counter() - t0)
        row = {"variant": variant, "first epoch s": epoch_s[0],
               "later epochs s (each)": statistics.mean(epoch_s[1:]),
               "last epoch losses": [round(float(x), 5) for x in losses]}
        if "reduce-overhead" in variant:
            row["CUDA graphs recorded"] = inductor_recordings() - rec0
        row["dynamo graphs"] = int(torch._dynamo.utils.counters["stats"].get("unique_graphs", 0)) - graphs0
        if variant.startswith("enn"):
            row.update(cudagraph_counts())
            row["fallbacks"] = len(enn_backend.report().fallbacks)
            row["per graph"] = {g.id: {k: v for k, v in g.counters.items() if k == "calls" or "captur" in k}
                                for g in enn_backend.report().graphs}
        rows.append(row)
        args.partial(rows, cols, what)
        del fn, model, opt
    by = {r["variant"]: r for r in rows if "later epochs s (each)" in r}
    for r in by.values():
        if "enn" in by:
            r["speed-up vs enn default"] = by["enn"]["later epochs s (each)"] / r["later epochs s (each)"]
        if "eager" in by:
            r["max |loss - eager|"] = max(abs(a - b) for a, b in zip(r["last epoch losses"], by["eager"]["last epoch losses"]))
    return {"rows": rows, "columns": cols, "what": what}


# ---------------------------------------------------------------- generate
def _lm(family: str, tiny: bool) -> torch.nn.Module:
    import transformers

    common = dict(num_hidden_layers=1 if tiny else 4, max_position_embeddings=512, attn_implementation="sdpa",
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=128 if tiny else 32000, hidden_size=64 if tiny else 2048,
                                       intermediate_size=128 if tiny else 5632, num_attention_heads=4 if tiny else 16,
                                       num_key_value_heads=1 if tiny else 4, **common)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.Qwen2Config(vocab_size=128 if tiny else 151936, hidden_size=64 if tiny else 1536,
                                       intermediate_size=128 if tiny else 8960, num_attention_heads=4 if tiny else 12,
                                       num_key_value_heads=1 if tiny else 2, **common)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    return cls(cfg).to(DEVICE, torch.bfloat16 if DEVICE == "cuda" else torch.float32).eval()


def near_tie(want: list[torch.Tensor], got: list[torch.Tensor], seq: int, step: int) -> dict[str, Any]:
    """At the first token where greedy decoding differs from eager's (sequence ``seq``, new token
    ``step``; the same tokens before it): eager's margin between its best and its second-best logit,
    and how far the compiled logits are from eager's there. A margin smaller than the logits'
    difference is a near tie that any rounding can flip, not a wrong result."""
    a, b = want[step][seq], got[step][seq]
    top2 = a.topk(2).values
    diff = float((a - b).abs().max())
    margin = float(top2[0] - top2[1])
    return {"eager's top-2 margin there": margin, "max |logit - eager| there": diff, "near tie": margin <= 2 * diff}


def part_generate(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    new_tokens = 8 if args.tiny else 256
    prompt_len = 16 if args.tiny else 128
    cols = ["model", "batch", "variant", "first call s", "tokens/s", "vs inductor reduce-overhead",
            "tokens equal eager's", "first differing token", "eager's top-2 margin there", "max |logit - eager| there",
            "near tie", "max |kv - eager|", "fallbacks"]
    what = (f"generate, static cache, prompt {prompt_len}, {new_tokens} new tokens, greedy, "
            f"{'fp32' if DEVICE == 'cpu' else 'bf16 weights'}")
    rows, t_start = [], time.perf_counter()
    for family in ("llama", "qwen2"):
        base = _lm(family, args.tiny)
        for batch in (1, 8):
            g = torch.Generator().manual_seed(3)
            ids = torch.randint(3, base.config.vocab_size, (batch, prompt_len), generator=g).to(DEVICE)
            prompt = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            want = None
            for variant in ("eager", "inductor reduce-overhead", "enn", "enn reduce-overhead"):
                if time.perf_counter() - t_start > args.budget_s:
                    rows.append({"model": family, "batch": batch, "variant": variant, "note": "skipped: budget"})
                    continue
                fresh_process_state()
                model = copy.deepcopy(base)
                kw: dict[str, Any] = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                          cache_implementation="static", return_dict_in_generate=True,
                                          output_logits=True)
                if variant == "eager":
                    kw["disable_compile"] = True
                else:
                    backend, _, mode = variant.partition(" ")
                    kw["compile_config"] = transformers.CompileConfig(backend=backend, mode=mode or "default")
                    kw["compile_config"]._compile_all_devices = args.tiny  # transformers compiles on CUDA only, unless
                times, out = [], None
                for _ in range(3):  # the first compiles (and records); the others are timed
                    sync()
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        out = model.generate(**prompt, **kw)
                    sync()
                    times.append(time.perf_counter() - t0)
                tokens = out.sequences[:, prompt_len:].cpu()
                row = {"model": family, "batch": batch, "variant": variant, "first call s": times[0],
                       "tokens/s": batch * new_tokens / statistics.median(times[1:])}
                if want is None:
                    want = (tokens, out.past_key_values, [x.float() for x in out.logits])
                else:
                    same = tokens == want[0]
                    row["tokens equal eager's"] = f"{int(same.all(dim=1).sum())}/{batch} sequences"
                    first = (~same).nonzero()
                    row["first differing token"] = int(first[0, 1]) if len(first) else "-"
                    if len(first):  # up to there both ran on the same tokens: their logits there compare
                        row.update(near_tie(want[2], [x.float() for x in out.logits], int(first[0, 0]), int(first[0, 1])))
                    row["max |kv - eager|"] = max(
                        float((getattr(a, p).float() - getattr(b, p).float()).abs().max())
                        for a, b in zip(out.past_key_values.layers, want[1].layers) for p in ("keys", "values"))
                if variant.startswith("enn"):
                    row["fallbacks"] = len(enn_backend.report().fallbacks)
                    row.update(cudagraph_counts())
                rows.append(row)
                args.partial(rows, cols, what)
                del model
    by = {(r["model"], r["batch"], r["variant"]): r for r in rows if "tokens/s" in r}
    for (m, b, v), r in by.items():
        ind = by.get((m, b, "inductor reduce-overhead"))
        if ind and v.startswith("enn"):
            r["vs inductor reduce-overhead"] = r["tokens/s"] / ind["tokens/s"]
    return {"rows": rows, "columns": cols, "what": what}


PARTS = {"state": part_state, "padding": part_padding, "generate": part_generate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=sorted(PARTS), required=True)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--tiny", action="store_true", help="small sizes (a CPU smoke run)")
    ap.add_argument("--variants", default="inductor,inductor reduce-overhead,enn,enn reduce-overhead",
                    help="what runs beside eager (always first): backend and mode, comma-separated")
    ap.add_argument("--dtypes", default="fp32,bf16", help="state: fp32 and / or bf16 (autocast)")
    ap.add_argument("--lr", type=float, default=1e-4,
                    help="state: AdamW's learning rate (0: parameters stay, statistics and moments still change)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    args.partial = lambda rows, columns, what: write(args, {"rows": rows, "columns": columns, "what": what}, final=False)
    write(args, PARTS[args.part](args))


def write(args: argparse.Namespace, result: dict[str, Any], final: bool = True) -> None:
    """Print the part's table and write it to --out (after every variant: a run cut short keeps what it measured)."""
    result.update(device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", torch=torch.__version__,
                  command=f"python bench/gpu_host_bound.py --part {args.part} --steps {args.steps} --lr {args.lr} "
                          f"--dtypes {args.dtypes} --variants '{args.variants}'" + (" --tiny" if args.tiny else ""))
    lines = [f"# Host-bound steps: {args.part}", "", f"`{result['command']}` -- {result['device']}, torch {result['torch']}",
             "", result["what"], ""] + md_table(result["rows"], result["columns"])
    print("\n".join(lines) if final else json.dumps(result["rows"][-1], default=str), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"host_bound_{args.part}.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
        with open(os.path.join(args.out, f"host_bound_{args.part}.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
