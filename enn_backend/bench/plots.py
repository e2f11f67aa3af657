"""Summaries, the Markdown table and the PNG plots of a benchmark result.

A result is the dict :func:`enn_backend.bench.runner.run_suite` returns (also the
JSON written next to the Markdown). Everything here reads only that dict, so a
saved JSON can be re-rendered: ``python -m enn_backend bench --render FILE.json``.

The goals checked (issue 6):

- GPU, bf16: geomean speedup of enn over inductor >= 1.10 over training and
  inference steps; no workload below 0.97x; enn's compile time <= 1.3x
  inductor's (checked cold over all workloads, warm as a geomean, and, stricter,
  for the worst single workload); enn's accuracy no worse than inductor's on
  every workload;
- CPU: geomean >= 1.0x inductor on the quick preset.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

GPU_GOALS = {"geomean": 1.10, "min_workload": 0.97, "compile_ratio": 1.3}
CPU_GOALS = {"geomean": 1.0}


def geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _be(wl: dict[str, Any], name: str) -> dict[str, Any]:
    return wl.get("backends", {}).get(name) or {}


def _label(wl: dict[str, Any]) -> str:
    return f"{wl['model']} {wl['mode']} {wl['dtype']}"


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Geomeans, ratios, accuracy counts and goal verdicts of a result."""
    wls = result.get("workloads", [])
    timed = [w for w in wls if w.get("speedup_enn_vs_inductor")]
    s: dict[str, Any] = {"workloads": len(wls), "timed": len(timed), "skipped": len(result.get("skipped", []))}
    geo: dict[str, Any] = {}
    for key, sel in [("train", lambda w: w["mode"] == "train"), ("infer", lambda w: w["mode"] == "infer"),
                     ("overall", lambda w: True)]:
        geo[key] = geomean([w["speedup_enn_vs_inductor"] for w in timed if sel(w)])
    for dt in sorted({w["dtype"] for w in timed}):
        geo[f"overall_{dt}"] = geomean([w["speedup_enn_vs_inductor"] for w in timed if w["dtype"] == dt])
    s["geomean_enn_vs_inductor"] = geo
    s["geomean_inductor_vs_eager"] = geomean([w.get("speedup_inductor_vs_eager") for w in wls])
    s["per_workload"] = {_label(w): w["speedup_enn_vs_inductor"] for w in timed}
    if timed:
        worst = min(timed, key=lambda w: w["speedup_enn_vs_inductor"])
        s["worst"] = {"workload": _label(worst), "speedup": worst["speedup_enn_vs_inductor"]}
    # compile times
    ratios, warm_ratios, tot_i, tot_e = [], [], 0.0, 0.0
    for w in wls:
        ci, ce = _be(w, "inductor").get("compile_cold_s"), _be(w, "enn").get("compile_cold_s")
        if ci and ce:
            ratios.append(ce / ci)
            tot_i, tot_e = tot_i + ci, tot_e + ce
        wi, we = _be(w, "inductor").get("compile_warm_s"), _be(w, "enn").get("compile_warm_s")
        if wi and we:
            warm_ratios.append(we / wi)
    s["compile"] = {"cold_total_inductor_s": tot_i, "cold_total_enn_s": tot_e,
                    "cold_total_ratio": tot_e / tot_i if tot_i else None,
                    "cold_geomean_ratio": geomean(ratios), "cold_worst_ratio": max(ratios) if ratios else None,
                    "warm_geomean_ratio": geomean(warm_ratios)}
    # accuracy
    acc: dict[str, Any] = {}
    for b in sorted({b for w in wls for b in w.get("backends", {})}):
        verdicts = [(_be(w, b).get("accuracy") or {}) for w in wls if b in w.get("backends", {})]
        acc[b] = {"pass": sum(1 for v in verdicts if v.get("passed")), "fail": sum(1 for v in verdicts if not v.get("passed")),
                  "failed": [_label(w) for w in wls if b in w.get("backends", {})
                             and not (_be(w, b).get("accuracy") or {}).get("passed")]}
    s["accuracy"] = acc
    worse = [_label(w) for w in wls if w.get("accuracy_enn_no_worse") and not w["accuracy_enn_no_worse"]["passed"]]
    s["accuracy_enn_worse_than_inductor"] = worse
    s["eager_self_check_failed"] = [_label(w) for w in wls if not w.get("eager_self_check", {}).get("passed", True)]
    s["goals"] = _goals(result, timed, s)
    return s


def _miss(measured: float, target: float, higher_is_better: bool = True) -> str:
    if higher_is_better:
        return f"missed by {target - measured:.3f} ({(target - measured) / target * 100:.1f}% below {target:g})"
    return f"missed by {measured - target:.3f} ({(measured - target) / target * 100:.1f}% above {target:g})"


def _goals(result: dict[str, Any], timed: list[dict[str, Any]], s: dict[str, Any]) -> list[dict[str, Any]]:
    goals: list[dict[str, Any]] = []
    cuda = str(result.get("device", {}).get("device", "cpu")).startswith("cuda")
    if not cuda:
        g = s["geomean_enn_vs_inductor"]["overall"]
        goals.append(_goal("CPU: geomean speedup enn vs inductor (all timed workloads)", CPU_GOALS["geomean"], g, True))
        return goals
    bf16 = [w for w in timed if w["dtype"] == "bf16"]
    scope = "bf16" if bf16 else "all dtypes (no bf16 workload ran)"
    sel = bf16 or timed
    g = geomean([w["speedup_enn_vs_inductor"] for w in sel])
    goals.append(_goal(f"GPU {scope}: geomean speedup enn vs inductor (train + infer)", GPU_GOALS["geomean"], g, True))
    if sel:
        worst = min(sel, key=lambda w: w["speedup_enn_vs_inductor"])
        goal = _goal(f"GPU {scope}: slowest workload vs inductor", GPU_GOALS["min_workload"], worst["speedup_enn_vs_inductor"], True)
        goal["where"] = _label(worst)
        goal["below"] = [f"{_label(w)}: {w['speedup_enn_vs_inductor']:.3f}" for w in sel
                         if w["speedup_enn_vs_inductor"] < GPU_GOALS["min_workload"]]
        goals.append(goal)
    # compile time: the zoo's total (cold) and geomean (warm), and, stricter, the worst workload
    pairs = [(_be(w, "inductor").get("compile_cold_s"), _be(w, "enn").get("compile_cold_s")) for w in sel]
    pairs = [(i, e) for i, e in pairs if i and e]
    goals.append(_goal(f"GPU {scope}: enn / inductor cold compile time, all workloads", GPU_GOALS["compile_ratio"],
                       sum(e for _, e in pairs) / sum(i for i, _ in pairs) if pairs else None, False))
    warm = [_be(w, "enn")["compile_warm_s"] / _be(w, "inductor")["compile_warm_s"] for w in sel
            if _be(w, "inductor").get("compile_warm_s") and _be(w, "enn").get("compile_warm_s")]
    if warm:
        goals.append(_goal(f"GPU {scope}: enn / inductor warm compile time (geomean)", GPU_GOALS["compile_ratio"],
                           geomean(warm), False))
    goals.append(_goal(f"GPU {scope}: worst enn / inductor cold compile time (one workload)", GPU_GOALS["compile_ratio"],
                       max(e / i for i, e in pairs) if pairs else None, False))
    worse = [_label(w) for w in sel if w.get("accuracy_enn_no_worse") and not w["accuracy_enn_no_worse"]["passed"]]
    goals.append({"goal": f"GPU {scope}: enn accuracy no worse than inductor on every workload", "target": "0 worse",
                  "measured": f"{len(worse)} worse", "met": not worse and bool(sel),
                  "miss": "" if not worse else "worse on: " + ", ".join(worse)})
    return goals


def _goal(text: str, target: float, measured: float | None, higher_is_better: bool) -> dict[str, Any]:
    if measured is None:
        return {"goal": text, "target": target, "measured": None, "met": False, "miss": "not measured"}
    met = measured >= target if higher_is_better else measured <= target
    return {"goal": text, "target": target, "measured": round(measured, 4), "met": met,
            "miss": "" if met else _miss(measured, target, higher_is_better)}


# ================================================================ Markdown
def _f(x: Any, fmt: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, fmt)


def _acc_cell(be: dict[str, Any]) -> str:
    a = be.get("accuracy")
    if not a:
        return "-"
    if not a.get("passed"):
        return "FAIL"
    if a.get("reliable") is False:
        return "pass?"
    return "pass"


def render_markdown(result: dict[str, Any], files: dict[str, str] | None = None) -> str:
    s = result.get("summary") or summarize(result)
    dev = result.get("device", {})
    cfg = result.get("config", {})
    lines = [f"# enn benchmark: {result.get('preset', 'custom')} preset on {dev.get('gpu') or dev.get('cpu') or dev.get('device')}", ""]
    lines += ["Produced by:", "", "```", result.get("command", "?"), "```", ""]
    lines.append(
        f"torch {dev.get('torch')}, triton {dev.get('triton') or '-'}, python {dev.get('python')}, "
        f"{dev.get('cpu_count')} CPU cores ({dev.get('torch_threads', '?')} torch threads), device `{dev.get('device')}`"
        + (f" ({dev.get('gpu')}, CUDA {dev.get('cuda')})" if dev.get("gpu") else "")
        + f"; started {result.get('started')}; wall time {_f(result.get('wall_s'), '.0f')} s"
        + (f"; load average at start {', '.join(f'{x:.1f}' for x in dev['loadavg'])}" if dev.get("loadavg") else "") + ".")
    lines.append("")
    lines.append(
        f"Size `{cfg.get('size')}`; modes {', '.join(cfg.get('modes', []))}; dtypes {', '.join(cfg.get('dtypes', []))}; "
        f"backends {', '.join(cfg.get('backends', []))}. Step time: median of {cfg.get('rounds')} interleaved rounds "
        f"({result['workloads'][0].get('timing_method', '?') if result.get('workloads') else '?'}), backend order rotated each round, after untimed steps past enn's guard warm-up (its first checked calls); "
        "a speedup is the median over rounds of the per-round time ratio (the two samples of a round share its noise). "
        "Training step = zero_grad + forward + loss + backward + AdamW step (the model is compiled, the optimizer runs eagerly). "
        "Cold compile = first call (forward + backward for training) into an empty per-backend Inductor cache; "
        "warm compile = the same after a Dynamo reset, from that backend's filled disk cache. "
        "Which compiled backend compiles first alternates from workload to workload within each mode and dtype "
        "(`compile_order` in the JSON).")
    if not str(dev.get("device", "")).startswith("cuda"):
        lines += ["", "CPU timings are wall clock on a shared machine: other processes add noise; compare ratios, not absolute times. "
                  "Peak memory is not measured on CPU."]
    lines.append("")
    # goals
    lines += ["## Goals", "", "| goal | target | measured | met | by how much |", "|---|---|---|---|---|"]
    for g in s.get("goals", []):
        miss = g.get("miss", "")
        if g.get("below"):
            miss += ("; " if miss else "") + "below target: " + ", ".join(g["below"])
        lines.append(f"| {g['goal']} | {g['target']} | {g['measured'] if g['measured'] is not None else '-'} | "
                     f"{'yes' if g['met'] else '**no**'} | {miss or '-'} |")
    geo = s.get("geomean_enn_vs_inductor", {})
    lines += ["", "Geomean speedup of enn over inductor: "
              + ", ".join(f"{k} {_f(v)}" for k, v in geo.items())
              + f". Inductor over eager: {_f(s.get('geomean_inductor_vs_eager'))}."]
    c = s.get("compile", {})
    lines.append(f"Cold compile time enn / inductor: total {_f(c.get('cold_total_ratio'))} "
                 f"({_f(c.get('cold_total_enn_s'), '.1f')} s vs {_f(c.get('cold_total_inductor_s'), '.1f')} s), "
                 f"geomean {_f(c.get('cold_geomean_ratio'))}, worst {_f(c.get('cold_worst_ratio'))}; warm geomean {_f(c.get('warm_geomean_ratio'))}.")
    acc = s.get("accuracy", {})
    lines.append("Accuracy verdicts (pass/fail): " + ", ".join(f"{b} {a['pass']}/{a['fail']}" for b, a in acc.items())
                 + (f". enn worse than inductor on: {', '.join(s['accuracy_enn_worse_than_inductor'])}" if s.get("accuracy_enn_worse_than_inductor") else ". enn is no worse than inductor on any workload")
                 + (f". Eager disagrees with itself on: {', '.join(s['eager_self_check_failed'])}" if s.get("eager_self_check_failed") else "") + ".")
    recompiled = [f"{_label(w)} ({w['compiled_during_timing']} graphs)" for w in wls_all(result) if w.get("compiled_during_timing")]
    if recompiled:
        lines.append("Dynamo compiled during the timed steps of (those times include compiling): " + ", ".join(recompiled) + ".")
    if result.get("skipped"):
        lines.append("Skipped: " + ", ".join(f"{x['model']} {x['mode']} {x['dtype']} ({x['why']})" for x in result["skipped"]) + ".")
    # per-workload table
    backends = [b for b in cfg.get("backends", []) if any(b in w.get("backends", {}) for w in result.get("workloads", []))]
    compiled = [b for b in backends if b != "eager"]
    lines += ["", "## Per workload", ""]
    head = ["model", "mode", "dtype"] + [f"{b} ms" for b in backends] + ["enn / inductor speedup"]
    head += [f"{b} cold / warm compile s" for b in compiled]
    if str(dev.get("device", "")).startswith("cuda"):
        head += [f"{b} peak MiB" for b in backends]
    head += [f"accuracy {b}" for b in compiled] + ["enn rel. error vs fp64 (inductor)", "enn fusions", "enn fallbacks"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w in result.get("workloads", []):
        if w.get("error"):
            lines.append(f"| {w['model']} | {w['mode']} | {w['dtype']} | error: {w['error']} |")
            continue
        row = [w["model"], w["mode"], w["dtype"]]
        for b in backends:
            be = _be(w, b)
            row.append(_f(be.get("time_ms"), ".3f") if be.get("ok", False) else f"error: {be.get('error', '')[:60]}")
        sp = w.get("speedup_enn_vs_inductor")
        row.append(f"**{sp:.3f}**" if sp is not None and sp < 0.97 else _f(sp))
        for b in compiled:
            be = _be(w, b)
            row.append(f"{_f(be.get('compile_cold_s'), '.1f')} / {_f(be.get('compile_warm_s'), '.1f')}")
        if str(dev.get("device", "")).startswith("cuda"):
            row += [_f(_be(w, b).get("peak_mem_mb"), ".0f") for b in backends]
        row += [_acc_cell(_be(w, b)) for b in compiled]
        ea, ia = _be(w, "enn").get("accuracy") or {}, _be(w, "inductor").get("accuracy") or {}
        row.append(f"{_f(ea.get('rel_error_compiled'), '.2e')} ({_f(ia.get('rel_error_compiled'), '.2e')})")
        enn = _be(w, "enn").get("enn") or {}
        row.append(", ".join(f"{k}={v}" for k, v in sorted((enn.get("fusions") or {}).items())) or "none")
        fb = enn.get("fallbacks") or {}
        row.append(", ".join(f"{k}={v}" for k, v in sorted(fb.items())) or "0")
        lines.append("| " + " | ".join(row) + " |")
    # accuracy failures in words
    fails = [(w, b) for w in result.get("workloads", []) for b in compiled
             if (_be(w, b).get("accuracy") or {}).get("passed") is False]
    if fails:
        lines += ["", "## Accuracy failures", ""]
        for w, b in fails:
            lines.append(f"- {_label(w)}, {b}: {(_be(w, b).get('accuracy') or {}).get('reason')}")
    fb_lines = [(w, d) for w in result.get("workloads", []) for d in ((_be(w, "enn").get("enn") or {}).get("fallback_details") or [])]
    if fb_lines:
        lines += ["", "## enn fallbacks", ""]
        lines += [f"- {_label(w)}: {d}" for w, d in fb_lines[:30]]
    # profile evidence
    prof = [w for w in result.get("workloads", []) if w.get("profile")]
    if prof:
        lines += ["", "## Why enn is slower where it is (profile evidence)", "",
                  "Top operators by self time per step (torch.profiler; device time on GPU, CPU time on CPU)."]
        for w in prof:
            lines += ["", f"### {_label(w)}: enn / inductor {w['speedup_enn_vs_inductor']:.3f}", ""]
            diff = call_differences(w["profile"])
            if diff:
                lines += ["Operators enn runs more (+) or less (-) often than inductor, per step: "
                          + ", ".join(f"`{n}` {d:+g}" for n, d in diff[:12]) + ".", ""]
            for b in ("inductor", "enn"):
                p = w["profile"].get(b, {})
                lines.append(f"{b}: {p.get('total_ms_per_step', 0):.3f} ms/step of {p.get('clock')} self time")
                lines.append("")
                lines += ["| operator | calls/step | self ms/step |", "|---|---|---|"]
                for r in p.get("top", []):
                    lines.append(f"| `{r['name']}` | {r['calls_per_step']:.1f} | {r['self_ms_per_step']:.4f} |")
                lines.append("")
    if files:
        lines += ["", "## Files", ""] + [f"- `{os.path.basename(v)}`: {k}" for k, v in files.items()]
    return "\n".join(lines) + "\n"


def wls_all(result: dict[str, Any]) -> list[dict[str, Any]]:
    return list(result.get("workloads", []))


def call_differences(profile: dict[str, Any]) -> list[tuple[str, float]]:
    """(operator, enn calls - inductor calls) per step, largest first; compiled-graph names left out."""
    a = (profile.get("enn") or {}).get("calls") or {}
    b = (profile.get("inductor") or {}).get("calls") or {}
    diff = []
    for name in set(a) | set(b):
        if name.startswith(("## Call CompiledFxGraph", "Torch-Compiled Region", "CompiledFunction")):
            continue
        d = a.get(name, 0.0) - b.get(name, 0.0)
        if abs(d) > 1e-9:
            diff.append((name, round(d, 2)))
    return sorted(diff, key=lambda x: (-abs(x[1]), x[0]))


# ================================================================ PNG plots
def write_plots(result: dict[str, Any], out_dir: str, stem: str) -> tuple[dict[str, str], str]:
    """Speedup, compile time and peak memory plots. Returns (files, note); note says what was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}, "matplotlib is not installed (pip install 'enn-backend[bench]'): no PNG plots written"
    files: dict[str, str] = {}
    wls = [w for w in result.get("workloads", []) if not w.get("error")]
    labels = [_label(w) for w in wls]
    title_dev = result.get("device", {}).get("gpu") or "CPU"
    cmd = result.get("command", "")

    def finish(fig: Any, ax: Any, name: str, what: str) -> None:
        fig.text(0.01, 0.005, cmd[:160], fontsize=6, family="monospace")
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        path = os.path.join(out_dir, f"{stem}_{name}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files[what] = path

    sp = [w.get("speedup_enn_vs_inductor") or 0.0 for w in wls]
    if any(sp):
        fig, ax = plt.subplots(figsize=(10, 0.35 * len(wls) + 1.5))
        colors = ["tab:green" if x >= 1.0 else ("tab:orange" if x >= 0.97 else "tab:red") for x in sp]
        ax.barh(labels, sp, color=colors)
        ax.axvline(1.0, color="black", lw=0.8)
        ax.axvline(0.97, color="gray", lw=0.8, ls="--")
        ax.set_xlabel("speedup of enn over inductor (step time ratio, >1 = enn faster)")
        ax.set_title(f"enn vs inductor step time ({title_dev})")
        ax.invert_yaxis()
        finish(fig, ax, "speedup", "speedup of enn over inductor per workload")
    comp = [b for b in result.get("config", {}).get("backends", []) if b != "eager"]
    if comp and any(_be(w, comp[0]).get("compile_cold_s") for w in wls):
        fig, ax = plt.subplots(figsize=(10, 0.35 * len(wls) * max(1, len(comp)) / 2 + 1.5))
        h = 0.8 / len(comp)
        for i, b in enumerate(comp):
            ys = [j + i * h for j in range(len(wls))]
            ax.barh(ys, [_be(w, b).get("compile_cold_s") or 0 for w in wls], height=h, label=f"{b} cold")
            ax.barh(ys, [_be(w, b).get("compile_warm_s") or 0 for w in wls], height=h * 0.4, color="black", alpha=0.5)
        ax.set_yticks([j + 0.4 - h / 2 for j in range(len(wls))], labels)
        ax.set_xlabel("compile time (s); thin dark bar = warm compile")
        ax.set_title(f"compile time ({title_dev})")
        ax.invert_yaxis()
        ax.legend()
        finish(fig, ax, "compile", "compile time per workload and backend")
    note = ""
    mem_backends = [b for b in result.get("config", {}).get("backends", []) if any(_be(w, b).get("peak_mem_mb") for w in wls)]
    if mem_backends:
        fig, ax = plt.subplots(figsize=(10, 0.35 * len(wls) * len(mem_backends) / 2 + 1.5))
        h = 0.8 / len(mem_backends)
        for i, b in enumerate(mem_backends):
            ax.barh([j + i * h for j in range(len(wls))], [_be(w, b).get("peak_mem_mb") or 0 for w in wls], height=h, label=b)
        ax.set_yticks([j + 0.4 - h / 2 for j in range(len(wls))], labels)
        ax.set_xlabel("peak memory of one step above the resident tensors (MiB)")
        ax.set_title(f"peak memory ({title_dev})")
        ax.invert_yaxis()
        ax.legend()
        finish(fig, ax, "memory", "peak memory per workload and backend")
    else:
        note = "no peak-memory plot: memory is measured on CUDA only"
    return files, note


# ================================================================ writing
def device_folder(result: dict[str, Any]) -> str:
    dev = result.get("device", {})
    if dev.get("gpu"):
        return re.sub(r"[^a-z0-9]+", "-", dev["gpu"].lower()).strip("-")
    return "cpu"


def write_outputs(result: dict[str, Any], out_dir: str, stem: str | None = None) -> dict[str, str]:
    """``<stem>.json``, ``<stem>.md`` and PNG plots under ``out_dir``; returns what was written."""
    os.makedirs(out_dir, exist_ok=True)
    stem = stem or result.get("preset", "custom")
    files, note = write_plots(result, out_dir, stem)
    result["plot_note"] = note or None  # replaced, not added to, when a saved result is re-rendered
    if note:
        print(f"enn bench: {note}")
    json_path = os.path.join(out_dir, f"{stem}.json")
    with open(json_path, "w") as f:
        json.dump(clean_json(result), f, indent=1, allow_nan=False)
    files = {"raw results (JSON)": json_path, **files}
    md_path = os.path.join(out_dir, f"{stem}.md")
    md = render_markdown(result, files)
    notes = list(result.get("notes") or []) + ([result["plot_note"]] if result.get("plot_note") else [])
    if notes:
        md += "\nNotes: " + "; ".join(notes) + "\n"
    with open(md_path, "w") as f:
        f.write(md)
    return {"markdown": md_path, **files}


def clean_json(x: Any) -> Any:
    """``x`` with NaN/Inf floats turned into null (strict JSON) and unknown objects into strings."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): clean_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean_json(v) for v in x]
    if x is None or isinstance(x, (str, int, bool)):
        return x
    return str(x)
