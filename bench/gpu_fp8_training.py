"""FP8 training under enn's ``fp8`` option, as issue #42 asks it be shown: a loss curve, injected
faults each in a fresh process, and the guard's cost with FP8 on. One command, one GPU:

    python bench/gpu_fp8_training.py [--device cuda] [--layers 4 --d 1024 --ffn 2816 --t 1024 --b 1]
                                     [--steps 300] [--fault-step 50] [--fault-layer model.layers.1.mlp.down_proj]
                                     [--parts curve,faults,guard] [--jobs 5] [--rounds 7] [--budget-s 520] [--out DIR]

Model: Hugging Face's ``LlamaForCausalLM`` from a random config (sizes are flags; GQA, sdpa
attention), bf16 autocast, fp32 weights, AdamW. Every run starts from the same weights (seed 0).
Data: sequences of a fixed random Markov chain (each token has ``--successors`` possible next
tokens with fixed probabilities; the same chain in every run), which the model learns, so the
loss falls from ``ln(vocab)`` towards the chain's entropy. A *data seed* picks which sequences a
run draws, in which order.

Parts (each run a fresh process; processes run ``--jobs`` at a time, sharing one Inductor cache
folder, new for each invocation):

- ``curve``: enn with ``fp8`` off for data seeds 0, 1 and 2 (the *run-to-run spread*: the same
  weights, the same distribution, other samples in another order), and ``fp8="rowwise"`` and
  ``"tensorwise"`` with data seed 0, ``--steps`` steps each. Per variant, the loss averaged over
  the ``--window`` steps ending at steps 50, 100, 200 and the last; the bf16 runs' min..max per
  window; whether each FP8 curve is inside it, or by how much it is outside.
- ``faults``: ``fault_inject`` scoped to one FP8 layer (``--fault-layer``; the ``/<module>``
  qualifier of enn_backend/fault_spec.py), ``--fault-recipe``, data seed 0:
  (a) ``inf@<fault-step>+:fwd``: the layer's forward FP8 GEMM returns Inf from its
  ``--fault-step``-th call on (what an overflowed scale gives: amax Inf, scale 0);
  (b) ``nan:bwd``: its backward FP8 GEMMs return NaN from the first step;
  (c) ``scale<--drift>:fwd``: its forward GEMM's result times 1.05 (``--drift``) from the first step
  (finite, wrong).
  These run with every call screened synchronously (``guard_warmup`` >= steps), so a fault that
  starts mid-run is met on its first call; (a-default) is (a) under the guard's default schedule
  (a screen every ``guard_every``-th call, on a GPU read back one call late). A reference run
  has the layer in bf16 from the start (``fp8_exclude``). Every step checks the gradients before
  the optimizer step (non-finite: the step is skipped, as a grad scaler would, and counted) and
  the parameters after it. Per fault: steps whose gradients were non-finite, the modules the guard
  demoted (its pinned nodes' module paths) and its fallback lines with their step, and the final
  parameters against the reference's and against the clean FP8 run's (the ``curve`` run of that
  recipe): per tensor ``max|a - b| / max|b|``, the worst tensor reported. The clean FP8 run
  against the reference is the yardstick: how far that one layer's FP8 moves the parameters.
- ``guard``: step time with the guard on (``guard="nonfinite"``, the default) and off, for
  rowwise and tensorwise, timed interleaved in ``--rounds`` rounds in one process; on/off as the
  median of the per-round ratios.

Writes DIR/<--name>.md (the command on its first line) and DIR/<--name>.json (DIR: --out, else
$OUT, else the working directory), rewritten after each part. ``--budget-s`` bounds the whole run:
the curve and fault processes are stopped 150 s before it, to leave the guard part its time.
On the CPU (``--device cpu``) the defaults are tiny (2 layers, d=64, T=32, 20 steps, fault at step
5): they check the script, not FP8's speed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import torch

SIZES = {  # per device: layers, d, ffn, heads, kv_heads, t, b, vocab, steps, fault_step
    "cuda": dict(layers=4, d=1024, ffn=2816, heads=8, kv_heads=2, t=1024, b=1, vocab=8192, steps=300, fault_step=50),
    "cpu": dict(layers=2, d=64, ffn=128, heads=4, kv_heads=2, t=32, b=1, vocab=256, steps=20, fault_step=5),
}
BF16_SEEDS = (0, 1, 2)
CHAIN_SEED = 1234  # the Markov chain itself: one for every run
BF16_RTOL = 1.6e-2  # torch.testing's rtol for bfloat16: the "bf16 tolerance" of the parameter comparison
GUARD_RESERVE_S = 150  # seconds of --budget-s kept for the guard part


# ----------------------------------------------------------------- model and data
def llama(a: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.d, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=a.t,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(a.device)


def chain(vocab: int, successors: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Markov chain: ``next[v]`` the successors of token v, ``probs[v]`` their probabilities."""
    g = torch.Generator().manual_seed(CHAIN_SEED)
    nxt = torch.randint(0, vocab, (vocab, successors), generator=g)
    probs = torch.softmax(torch.randn(vocab, successors, generator=g) * 1.5, dim=-1)
    return nxt, probs


def chain_entropy(vocab: int, successors: int) -> float:
    """Mean entropy of a token's successors (nats), every token weighted alike: about the loss floor."""
    _, p = chain(vocab, successors)
    return float(-(p * p.log()).sum(-1).mean())


def markov_batches(a: argparse.Namespace, seed: int) -> torch.Tensor:
    """``[steps, b, t]`` token ids drawn from the chain; ``seed`` picks the samples and their order."""
    nxt, probs = chain(a.vocab, a.successors)
    g = torch.Generator().manual_seed(seed)
    n = a.steps * a.b
    ids = torch.empty(n, a.t, dtype=torch.long)
    ids[:, 0] = torch.randint(0, a.vocab, (n,), generator=g)
    for i in range(1, a.t):
        prev = ids[:, i - 1]
        pick = torch.multinomial(probs[prev], 1, generator=g).squeeze(1)
        ids[:, i] = nxt[prev, pick]
    return ids.view(a.steps, a.b, a.t)


# ----------------------------------------------------------------- the cases
def cases(a: argparse.Namespace) -> dict[str, dict]:
    """name -> what the run does: fp8 recipe, data seed, enn options. In launch order: the fault
    runs first (their localizations recompile; they take longest)."""
    every_call = {"guard_warmup": a.steps + 1}  # every call screened synchronously (schedule.py)
    layer, recipe, n = a.fault_layer, a.fault_recipe, a.fault_step
    out: dict[str, dict] = {}
    if "faults" in a.parts:
        for key, spec, what in (
                ("a", f"enn.fp8_mm/{layer}:inf@{n}+:fwd", f"overflow: the layer's forward GEMM returns Inf from step {n}"),
                ("b", f"enn.fp8_mm/{layer}:nan:bwd", "NaN out of the layer's backward FP8 GEMMs from step 1"),
                ("c", f"enn.fp8_mm/{layer}:scale{a.drift}:fwd",
                 f"finite drift: the forward GEMM's result x{a.drift} from step 1")):
            out[f"fault {key}"] = {"part": "faults", "fp8": recipe, "seed": 0, "what": what,
                                   "options": {"fault_inject": spec, **every_call}}
        out["fault a-default"] = {"part": "faults", "fp8": recipe, "seed": 0,
                                  "what": "(a) under the guard's default schedule",
                                  "options": {"fault_inject": f"enn.fp8_mm/{layer}:inf@{n}+:fwd"}}
        out["reference"] = {"part": "faults", "fp8": recipe, "seed": 0, "options": {"fp8_exclude": layer},
                            "what": f"{layer} in bf16 from the start (fp8_exclude)"}
    if "curve" in a.parts or "faults" in a.parts:  # the faults compare with the clean FP8 run
        out["rowwise"] = {"part": "curve", "fp8": "rowwise", "seed": 0, "options": {}}
        out["tensorwise"] = {"part": "curve", "fp8": "tensorwise", "seed": 0, "options": {}}
    if "curve" in a.parts:
        for seed in BF16_SEEDS:
            out[f"bf16 seed {seed}"] = {"part": "curve", "fp8": "off", "seed": seed, "options": {}}
    return out


def all_finite(ts: list[torch.Tensor]) -> bool:
    return bool(torch.stack([t.isfinite().all() for t in ts]).all()) if ts else True


def fp8_modules() -> tuple[int, int, list[str]]:
    """(GEMMs in FP8, GEMMs the fp8 pass saw, modules with an FP8 GEMM) from enn's report."""
    import enn_backend

    fp8 = seen = 0
    mods: set[str] = set()
    for g in enn_backend.report().graphs:
        for c in g.kernel_choices:
            if "role" in c and "mnk" in c:
                seen += 1
                if c["choice"] == "fp8":
                    fp8 += 1
                    mods.add(c.get("module", "?"))
    return fp8, seen, sorted(mods)


def run_case(a: argparse.Namespace, name: str, case: dict) -> dict:
    """Train one case; its result as JSON data, and its final parameters in ``a.work``."""
    import enn_backend

    data = markov_batches(a, case["seed"])
    model = llama(a)
    params = [p for p in model.parameters() if p.requires_grad]
    compiled = torch.compile(model, backend="enn", options={"fp8": case["fp8"], **case["options"]})
    cuda = a.device == "cuda"
    opt = torch.optim.AdamW(params, lr=a.lr, **({"fused": True} if cuda else {"foreach": True}))
    losses, bad_grads, bad_params, fallbacks = [], [], [], []
    seen = 0
    t0 = time.time()
    first_s = 0.0
    for step in range(1, a.steps + 1):
        ids = data[step - 1].to(a.device)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(a.device, dtype=torch.bfloat16):
            out = compiled(input_ids=ids, labels=ids)
        out.loss.backward()
        if all_finite([p.grad for p in params if p.grad is not None]):
            opt.step()
        else:
            bad_grads.append(step)  # what would have reached the optimizer: the step is skipped
        if not all_finite([p.detach() for p in params]):
            bad_params.append(step)
        losses.append(float(out.loss.detach()))
        if step == 1:
            first_s = time.time() - t0
        new = enn_backend.report().fallbacks[seen:]
        seen += len(new)
        fallbacks += [{"step": step, "kind": f.kind, "graph": f.graph, "phase": f.phase,
                       "modules": sorted({s.get("module", "?") for s in f.sites}),
                       "reason": f.reason[:300], "action": f.action[:300]} for f in new]
    if cuda:
        torch.cuda.synchronize()
    train_s = time.time() - t0 - first_s
    pinned = {g.id: sorted({g.sites.get(n, {}).get("module", "?") for n in g.pinned})
              for g in enn_backend.report().graphs}
    fp8, gemms, mods = fp8_modules()
    torch.save({k: v.detach().float().cpu() for k, v in model.state_dict().items()},
               os.path.join(a.work, f"{slug(name)}.pt"))
    return {"name": name, **case, "losses": losses, "nonfinite_grad_steps": bad_grads,
            "nonfinite_param_steps": bad_params, "fallbacks": fallbacks, "pinned_modules": pinned,
            "fp8_gemms": fp8, "gemms": gemms, "fp8_modules": mods, "first_step_s": round(first_s, 1),
            "steps_s": round(train_s, 1), "ms_per_step": round(train_s * 1e3 / max(a.steps - 1, 1), 2)}


def run_guard(a: argparse.Namespace) -> dict:
    """Step time, guard on and off, rowwise and tensorwise: interleaved rounds in this process."""
    from enn_backend.bench.timing import Timer, paired_ratio, spread_pct

    ids = markov_batches(argparse.Namespace(**{**vars(a), "steps": 1}), 0)[0].to(a.device)
    fns = {}
    for recipe in ("rowwise", "tensorwise"):
        for guard in ("nonfinite", "off"):
            model = llama(a)
            compiled = torch.compile(model, backend="enn", options={"fp8": recipe, "guard": guard})
            opt = torch.optim.AdamW(model.parameters(), lr=a.lr,
                                    **({"fused": True} if a.device == "cuda" else {"foreach": True}))

            def step(compiled=compiled, opt=opt) -> None:
                opt.zero_grad(set_to_none=True)
                with torch.autocast(a.device, dtype=torch.bfloat16):
                    out = compiled(input_ids=ids, labels=ids)
                out.loss.backward()
                opt.step()

            t0 = time.time()
            step()
            print(f"  guard part: {recipe} guard={guard} compiled + first step {time.time() - t0:.0f}s", flush=True)
            fns[f"{recipe} guard={guard}"] = step
    timer = Timer(a.device, rounds=a.rounds)
    samples = timer.measure(fns)
    out = {"method": timer.method, "rounds": a.rounds, "samples_ms": samples, "recipes": {}}
    for recipe in ("rowwise", "tensorwise"):
        on, off = samples[f"{recipe} guard=nonfinite"], samples[f"{recipe} guard=off"]
        out["recipes"][recipe] = {"on_ms": statistics.median(on), "off_ms": statistics.median(off),
                                  "on_over_off": paired_ratio(on, off),
                                  "per_round": [x / y for x, y in zip(on, off)],
                                  "spread_pct": max(spread_pct(on), spread_pct(off))}
    return out


# ----------------------------------------------------------------- the driver
def slug(name: str) -> str:
    return name.replace(" ", "_").replace("-", "_")


def launch(a: argparse.Namespace, name: str, timeout: float, env: dict) -> dict:
    """Run case ``name`` in a fresh process; its JSON result, or what went wrong."""
    log = os.path.join(a.logs, f"{slug(name)}.log")
    res = os.path.join(a.work, f"{slug(name)}.json")
    cmd = [sys.executable, os.path.abspath(__file__), *a.argv, "--case", name, "--work", a.work]
    t0 = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=max(timeout, 1)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.time() - t0
    if rc == 0 and os.path.exists(res):
        with open(res) as f:
            out = json.load(f)
        out["wall_s"] = round(wall, 1)
        return out
    with open(log) as f:
        tail = f.read()[-1500:]
    return {"name": name, "error": f"exit {rc} after {wall:.0f}s", "log_tail": tail, "wall_s": round(wall, 1)}


def window(losses: list[float], step: int, w: int) -> float | None:
    if step > len(losses) or step < 1:
        return None
    part = losses[max(0, step - w):step]
    return sum(part) / len(part)


def rel_diff(x: dict, y: dict) -> tuple[float, str, float]:
    """Per tensor ``max|x - y| / max|y|``: (the worst, that tensor's name, the median over tensors)."""
    diffs = {}
    for k, b in y.items():
        d = float((x[k] - b).abs().max() / b.abs().max().clamp_min(1e-30))
        diffs[k] = d if math.isfinite(d) else float("inf")
    name = max(diffs, key=diffs.get)
    return diffs[name], name, statistics.median(diffs.values())


def curve_table(a: argparse.Namespace, results: dict, checkpoints: list[int]) -> tuple[list[str], dict]:
    bf16 = [results[f"bf16 seed {s}"] for s in BF16_SEEDS if "losses" in results.get(f"bf16 seed {s}", {})]
    spread = {c: (min(window(r["losses"], c, a.window) for r in bf16), max(window(r["losses"], c, a.window) for r in bf16))
              for c in checkpoints} if bf16 else {}
    head = "| run | " + " | ".join(f"step {c}" for c in checkpoints) + " | FP8 GEMMs | fallbacks | ms/step |"
    lines = [head, "|---" * (len(checkpoints) + 4) + "|"]
    verdicts: dict[str, dict] = {}
    names = [f"bf16 seed {s}" for s in BF16_SEEDS] + ["rowwise", "tensorwise"]
    for name in names:
        r = results.get(name)
        if r is None:
            continue
        if "losses" not in r:
            lines.append(f"| {name} | {r.get('error', 'did not run')} |")
            continue
        cells, verdicts[name] = [], {}
        for c in checkpoints:
            v = window(r["losses"], c, a.window)
            cell = f"{v:.4f}"
            if name in ("rowwise", "tensorwise") and c in spread:
                lo, hi = spread[c]
                out = v - hi if v > hi else (v - lo if v < lo else 0.0)
                verdicts[name][c] = out
                cell += " (inside)" if out == 0 else f" ({out:+.4f} outside)"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {r['fp8_gemms']}/{r['gemms']} | {len(r['fallbacks'])} | "
                     f"{r['ms_per_step']} |")
    if spread:
        lines.append(f"| bf16 spread (min..max of {len(bf16)}) | "
                     + " | ".join(f"{lo:.4f}..{hi:.4f} ({hi - lo:.4f})" for lo, hi in spread.values()) + " | | | |")
    for name in ("rowwise", "tensorwise"):
        r, ref = results.get(name, {}), results.get("bf16 seed 0", {})
        if "losses" in r and "losses" in ref:
            lines.append(f"| {name} - bf16 seed 0 (same data) | " + " | ".join(
                f"{window(r['losses'], c, a.window) - window(ref['losses'], c, a.window):+.4f}" for c in checkpoints)
                + " | | | |")
    return lines, {"spread": {str(c): v for c, v in spread.items()}, "outside": verdicts}


def fault_table(a: argparse.Namespace, results: dict) -> tuple[list[str], dict]:
    def params(name: str):
        path = os.path.join(a.work, f"{slug(name)}.pt")
        return torch.load(path) if os.path.exists(path) else None

    ref, clean = params("reference"), params(a.fault_recipe)
    lines = ["| fault | fault_inject | steps with non-finite grads (skipped) | params finite | demoted (graph: modules) | "
             "fallback lines (step kind graph) | vs layer-bf16 run: worst rel diff (tensor); median | vs clean FP8 run |",
             "|---|---|---|---|---|---|---|---|"]
    data: dict[str, dict] = {}
    if ref is not None and clean is not None:
        d, t, med = rel_diff(clean, ref)
        data["clean_vs_reference"] = {"worst": d, "tensor": t, "median": med}
    for name, r in results.items():
        if r.get("part") != "faults" and not name.startswith("fault"):
            continue
        if name == "reference":
            continue
        if "losses" not in r:
            lines.append(f"| {name} | {r.get('error', 'did not run')} |")
            continue
        got = params(name)
        demoted = sorted({m for mods in r["pinned_modules"].values() for m in mods})
        where = "; ".join(f"{g}: {', '.join(mods)}" for g, mods in r["pinned_modules"].items() if mods)
        runtime = [f for f in r["fallbacks"] if f["phase"] != "compile" or f["kind"] == "fault_not_planted"]
        falls = "; ".join(f"{f['step']} {f['kind']} {f['graph']}" for f in runtime[:6]) + (
            f"; +{len(runtime) - 6}" if len(runtime) > 6 else "")
        none = (float("nan"), "", float("nan"))
        vs_ref = rel_diff(got, ref) if got is not None and ref is not None else none
        vs_clean = rel_diff(got, clean) if got is not None and clean is not None else none
        bad = r["nonfinite_grad_steps"]
        data[name] = {"demoted": demoted, "pinned_by_graph": r["pinned_modules"], "only_the_layer": demoted == [a.fault_layer], "nonfinite_grad_steps": bad,
                      "params_finite": not r["nonfinite_param_steps"], "vs_reference": vs_ref, "vs_clean": vs_clean,
                      "within_bf16_tol_of_reference": vs_ref[0] <= BF16_RTOL}
        lines.append(f"| {name}: {r.get('what', '')} | `{r['options'].get('fault_inject', '')}` | "
                     f"{len(bad)}{' ' + str(bad[:5]) if bad else ''} | {'yes' if not r['nonfinite_param_steps'] else 'NO'} | "
                     f"{where or 'none'}{' (only the layer)' if demoted == [a.fault_layer] else ''} | "
                     f"{falls or 'none'} | {vs_ref[0]:.2e} ({vs_ref[1]}); median {vs_ref[2]:.2e} | "
                     f"{vs_clean[0]:.2e} ({vs_clean[1]}); median {vs_clean[2]:.2e} |")
    quiet = [n for n, r in results.items() if n.startswith("fault") and "fallbacks" in r
             and not any(f["phase"] != "compile" for f in r["fallbacks"])]
    if quiet:
        lines += ["", f"No run-time fallback (nothing caught, nothing demoted) in: {', '.join(quiet)}. The guard's value "
                      "checks hold a graph that computes in bf16 to rtol = atol = 5e-2 (enn_backend/guard/screen.py), "
                      "so a drift within 5% of a value passes them."]
    if "clean_vs_reference" in data:
        c = data["clean_vs_reference"]
        lines += ["", f"Yardstick: the clean {a.fault_recipe} run against the layer-bf16 run (same data, that one layer "
                      f"FP8 vs bf16 for all {a.steps} steps): worst rel diff {c['worst']:.2e} ({c['tensor']}), median over "
                      f"tensors {c['median']:.2e}. AdamW moves every weight by about lr per step whatever its "
                      "gradient's size, so a gradient element whose sign differs moves its weight by up to "
                      f"lr x steps = {a.lr * a.steps:.1e}: small numeric differences show at that scale. bf16 "
                      f"tolerance: rtol {BF16_RTOL} (torch.testing's for bfloat16). Fault (a) strikes at step "
                      f"{a.fault_step}: the layer ran FP8 for the {a.fault_step - 1} steps before, so it is expected "
                      "between the clean FP8 run and the layer-bf16 run, not equal to either."]
    return lines, data


def render(a: argparse.Namespace, results: dict, guard: dict | None, command: str) -> tuple[str, dict]:
    checkpoints = sorted({c for c in (50, 100, 200, a.steps) if c <= a.steps} | ({a.steps // 4, a.steps // 2}
                         if a.steps < 50 else set()))
    size = (f"LLaMA {a.layers}L d={a.d} ffn={a.ffn} heads {a.heads}/{a.kv_heads} T={a.t} B={a.b} vocab {a.vocab}, "
            f"bf16 autocast, AdamW lr {a.lr}, {a.steps} steps")
    dev = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    lines = [f"`{command}`", "", f"torch {torch.__version__}, {dev}; {size}.", "",
             f"Data: a fixed random Markov chain over {a.vocab} tokens, {a.successors} successors each (mean successor "
             f"entropy {chain_entropy(a.vocab, a.successors):.3f} nats, about the loss floor; ln(vocab) = "
             f"{math.log(a.vocab):.3f}). Run-to-run spread: bf16 (fp8 off) with the same initial weights and data seeds "
             f"{', '.join(map(str, BF16_SEEDS))} (other samples of the chain, in another order); FP8 runs use data seed 0."]
    out: dict = {"command": command, "device": dev, "sizes": size, "runs": results}
    if any(r.get("part") == "curve" for r in results.values()):
        table, data = curve_table(a, results, checkpoints)
        lines += ["", f"## Loss (mean over the {a.window} steps ending at each step)", ""] + table
        out["curve"] = data
    if any(r.get("part") == "faults" for r in results.values()):
        table, data = fault_table(a, results)
        lines += ["", f"## Faults ({a.fault_recipe}, layer {a.fault_layer}; (a)-(c) with every call screened, "
                      "each a fresh process)", ""] + table
        out["faults"] = data
    if guard:
        lines += ["", f"## Guard overhead with FP8 on ({guard.get('method', '')}, {guard.get('rounds', a.rounds)} interleaved rounds)", "",
                  "| fp8 | guard on ms | guard off ms | on/off (median of per-round ratios) | per round | spread |",
                  "|---|---|---|---|---|---|"]
        if "error" in guard:
            lines.append(f"| {guard['error']} |")
        for recipe, g in guard.get("recipes", {}).items():
            lines.append(f"| {recipe} | {g['on_ms']:.2f} | {g['off_ms']:.2f} | {g['on_over_off']:.3f}x | "
                         f"{min(g['per_round']):.3f}-{max(g['per_round']):.3f} | {g['spread_pct']:.1f}% |")
        out["guard"] = guard
    errors = {n: r for n, r in results.items() if "error" in r}
    if errors:
        lines += ["", "Runs that failed:"] + [f"- {n}: {r['error']}" for n, r in errors.items()]
    walls = ", ".join(f"{n} {r.get('wall_s', '?')}s (first step {r.get('first_step_s', '?')}s)" for n, r in results.items())
    lines += ["", f"Process wall times: {walls}."]
    return "\n".join(lines) + "\n", out


def write(a: argparse.Namespace, text: str, data: dict) -> None:
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{a.name}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(a.out, f"{a.name}.json"), "w") as f:
        json.dump(data, f, indent=1, default=str)


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="FP8 training under enn (issue #42): loss curves, one-layer faults, "
                                             "the guard's cost; see the module doc")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    for key in SIZES["cuda"]:
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=None,
                        help=f"default {SIZES['cuda'][key]} on cuda, {SIZES['cpu'][key]} on cpu")
    ap.add_argument("--successors", type=int, default=4, help="next tokens per token of the Markov chain")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--window", type=int, default=10, help="steps averaged per loss point")
    ap.add_argument("--fault-layer", default="model.layers.1.mlp.down_proj")
    ap.add_argument("--drift", type=float, default=1.05, help="fault (c): the factor on the GEMM's result")
    ap.add_argument("--fault-recipe", default="rowwise", choices=("rowwise", "tensorwise"))
    ap.add_argument("--parts", default="curve,faults,guard")
    ap.add_argument("--jobs", type=int, default=5, help="training processes at a time (curve and faults)")
    ap.add_argument("--rounds", type=int, default=7, help="timing rounds of the guard part")
    ap.add_argument("--budget-s", type=float, default=520)
    ap.add_argument("--name", default="fp8_training")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--case", default="", help=argparse.SUPPRESS)  # one run, in this process
    ap.add_argument("--work", default="", help=argparse.SUPPRESS)
    ap.add_argument("--render", default="", metavar="WORK",
                    help="write the tables again from the work folder of an earlier run (printed at its start)")
    a = ap.parse_args(argv)
    for key, v in SIZES[a.device].items():
        if getattr(a, key) is None:
            setattr(a, key, v)
    a.parts = set(a.parts.split(","))
    a.argv = [x for x in argv]
    return a


def main() -> None:
    argv = sys.argv[1:]
    a = parse(argv)
    if a.case:
        if a.device == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
        result = run_guard(a) if a.case == "guard" else run_case(a, a.case, cases(a)[a.case])
        with open(os.path.join(a.work, f"{slug(a.case)}.json"), "w") as f:
            json.dump(result, f)
        return
    if a.render:
        a.work, a.out = a.render, a.out or os.getcwd()
        results = {}
        for name in cases(a):
            path = os.path.join(a.work, f"{slug(name)}.json")
            if os.path.exists(path):
                with open(path) as f:
                    results[name] = json.load(f)
        path = os.path.join(a.work, "guard.json")
        guard = json.load(open(path)) if os.path.exists(path) else None
        text, data = render(a, results, guard, "python bench/gpu_fp8_training.py " + " ".join(map(shlex.quote, argv)))
        write(a, text, data)
        print(text)
        return
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_fp8_training: no CUDA device (use --device cpu for the tiny CPU check)")
    start = time.time()
    command = "python bench/gpu_fp8_training.py " + " ".join(shlex.quote(x) for x in argv)
    a.out = a.out or os.getcwd()
    a.work = tempfile.mkdtemp(prefix="fp8_training_")
    a.logs = os.path.join(a.out, f"{a.name}_logs")
    os.makedirs(a.logs, exist_ok=True)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(a.work, "inductor"),
           "TRITON_CACHE_DIR": os.path.join(a.work, "triton"), "PYTHONUNBUFFERED": "1"}
    print(f"{command}\nwork folder {a.work}, logs {a.logs}", flush=True)
    todo = cases(a)
    results: dict[str, dict] = {}
    guard = None
    if todo:
        deadline = start + a.budget_s - (GUARD_RESERVE_S if "guard" in a.parts else 0)
        with concurrent.futures.ThreadPoolExecutor(max_workers=a.jobs) as pool:
            futures = {}
            for name in todo:
                case_env = {**env, "ENN_CACHE_DIR": os.path.join(a.work, slug(name), "cache"),
                            "ENN_REPRO_DIR": os.path.join(a.work, slug(name), "repros")}
                futures[pool.submit(lambda n=name, e=case_env: launch(a, n, deadline - time.time(), e))] = name
            for fut in concurrent.futures.as_completed(futures):
                r = fut.result()
                results[r["name"]] = {**todo[r["name"]], **r}
                print(f"  {r['name']}: {r.get('error') or 'done'} ({r['wall_s']}s, {time.time() - start:.0f}s in)",
                      flush=True)
        results = {n: results[n] for n in todo if n in results}
        write(a, *render(a, results, None, command))
    if "guard" in a.parts:
        g = launch(a, "guard", start + a.budget_s - time.time(), env)
        guard = g if "recipes" in g else {"error": g.get("error", "failed"), "log_tail": g.get("log_tail", "")}
    text, data = render(a, results, guard, command)
    data["wall_s"] = round(time.time() - start, 1)
    write(a, text, data)
    print(text, flush=True)
    print(f"total {time.time() - start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
