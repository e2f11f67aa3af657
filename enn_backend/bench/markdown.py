"""The Markdown report of a benchmark result: the command and machine, goals, tables per
workload, accuracy failures, enn's fallbacks and the profile evidence."""

from __future__ import annotations

import math
import os
from typing import Any

from .summary import backend_of, label, summarize


def _f(x: Any, fmt: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, fmt)


def _acc_cell(be: dict[str, Any]) -> str:
    a = be.get("accuracy")
    if not a:
        return "-"
    if a.get("passed") is None:
        return "n/a"
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
    if result.get("partial"):
        lines += [f"**Partial result**: written after workload {len(result.get('workloads', []))}, while the run was "
                  "still going; a run cut short leaves this file as its last record.", ""]
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
        "Cold compile = first call (forward + backward for training) into an empty per-backend Inductor cache "
        "(after the one-time warm-up below); "
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
    if result.get("warm_up_s"):
        lines.append("One-time warm-up before the first workload (a small training step per compiled backend, in no "
                     "workload's cold compile time): " + ", ".join(f"{b} {t:.1f} s" for b, t in result["warm_up_s"].items())
                     + ". It starts Inductor's compile workers, and builds the precompiled header of Inductor's C++ "
                     "wrapper for a backend that uses it on CUDA (enn), once per machine and torch version.")
    acc = s.get("accuracy", {})
    lines.append("Accuracy verdicts (pass/fail): " + ", ".join(f"{b} {a['pass']}/{a['fail']}"
                                                             + (f" ({a['not_judged']} not judged)" if a.get("not_judged") else "")
                                                             for b, a in acc.items())
                 + (f". enn worse than inductor on: {', '.join(s['accuracy_enn_worse_than_inductor'])}" if s.get("accuracy_enn_worse_than_inductor") else ". enn is no worse than inductor on any workload")
                 + (f". Eager disagrees with itself on: {', '.join(s['eager_self_check_failed'])}" if s.get("eager_self_check_failed") else "") + ".")
    recompiled = [f"{label(w)} ({w['compiled_during_timing']} graphs)" for w in result.get("workloads", []) if w.get("compiled_during_timing")]
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
            be = backend_of(w, b)
            row.append(_f(be.get("time_ms"), ".3f") if be.get("ok", False) else f"error: {be.get('error', '')[:60]}")
        sp = w.get("speedup_enn_vs_inductor")
        row.append(f"**{sp:.3f}**" if sp is not None and sp < 0.97 else _f(sp))
        for b in compiled:
            be = backend_of(w, b)
            row.append(f"{_f(be.get('compile_cold_s'), '.1f')} / {_f(be.get('compile_warm_s'), '.1f')}")
        if str(dev.get("device", "")).startswith("cuda"):
            row += [_f(backend_of(w, b).get("peak_mem_mb"), ".0f") for b in backends]
        row += [_acc_cell(backend_of(w, b)) for b in compiled]
        ea, ia = backend_of(w, "enn").get("accuracy") or {}, backend_of(w, "inductor").get("accuracy") or {}
        row.append(f"{_f(ea.get('rel_error_compiled'), '.2e')} ({_f(ia.get('rel_error_compiled'), '.2e')})")
        enn = backend_of(w, "enn").get("enn") or {}
        row.append(", ".join(f"{k}={v}" for k, v in sorted((enn.get("fusions") or {}).items())) or "none")
        fb = enn.get("fallbacks") or {}
        row.append(", ".join(f"{k}={v}" for k, v in sorted(fb.items())) or "0")
        lines.append("| " + " | ".join(row) + " |")
    lines += host_kernel_table(result)
    # accuracy failures in words
    fails = [(w, b) for w in result.get("workloads", []) for b in compiled
             if (backend_of(w, b).get("accuracy") or {}).get("passed") is False]
    if fails:
        lines += ["", "## Accuracy failures", ""]
        for w, b in fails:
            lines.append(f"- {label(w)}, {b}: {(backend_of(w, b).get('accuracy') or {}).get('reason')}")
    fb_lines = [(w, d) for w in result.get("workloads", []) for d in ((backend_of(w, "enn").get("enn") or {}).get("fallback_details") or [])]
    if fb_lines:
        lines += ["", "## enn fallbacks", ""]
        lines += [f"- {label(w)}: {d}" for w, d in fb_lines[:30]]
    # profile evidence
    prof = [w for w in result.get("workloads", []) if w.get("profile")]
    if prof:
        lines += ["", "## Why enn is slower where it is (profile evidence)", "",
                  "Top operators by self time per step (torch.profiler; device time on GPU, CPU time on CPU)."]
        for w in prof:
            lines += ["", f"### {label(w)}: enn / inductor {w['speedup_enn_vs_inductor']:.3f}", ""]
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


def _spread(be: dict[str, Any]) -> str:
    """``median ms (±half the range over rounds, in % of the median)``."""
    xs, t = be.get("samples_ms") or [], be.get("time_ms")
    if not be.get("ok", False) or not xs or not t or not math.isfinite(t):
        return "-"
    return f"{t:.3f} ±{(max(xs) - min(xs)) / 2 / t * 100:.0f}%"


def host_kernel_table(result: dict[str, Any]) -> list[str]:
    """The real-model presets' table: step times with their spread, enn's fusions, kernel choices and
    fallbacks, and per backend the kernel time within the wall time of a step (CUDA) or the wall
    (host) time alone (CPU). Empty for results measured without ``host_vs_kernel``."""
    wls = [w for w in result.get("workloads", []) if "host_vs_kernel" in w]
    if not wls:
        return []
    cuda = str(result.get("device", {}).get("device", "")).startswith("cuda")
    backends = [b for b in result.get("config", {}).get("backends", []) if any(b in w.get("backends", {}) for w in wls)]
    lines = ["", "## Per workload: spread, enn's decisions, host and kernel time", "",
             "Step time: median over rounds ±half its range. "
             + ("Kernel / host / wall: the device's kernel time of one step (torch.profiler) within the step's wall time; "
                "host = the time a call takes to return, started on an idle device (the host's work per step); "
                "idle = the share of the wall time the device had no kernel to run (host-bound)."
                if cuda else "On the CPU every step is host time: the wall time is the step time above."), ""]
    pairs = sorted({p for w in wls for p in w.get("speedups") or {}})
    head = (["workload"] + [f"{b} ms" for b in backends] + ["enn / inductor"] + [f"speed-up {p}" for p in pairs]
            + ["enn fusions", "enn kernel choices", "enn fallbacks"])
    if cuda:
        head += [f"{b} kernel / host / wall ms (idle)" for b in backends]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w in wls:
        enn = backend_of(w, "enn").get("enn") or {}
        row = ([label(w)] + [_spread(backend_of(w, b)) for b in backends] + [_f(w.get("speedup_enn_vs_inductor"))]
               + [_f((w.get("speedups") or {}).get(p)) for p in pairs])
        for key in ("fusions", "kernel_choice_counts", "fallbacks"):
            row.append(", ".join(f"{k}={v}" for k, v in sorted((enn.get(key) or {}).items())) or "none")
        if cuda:
            hk = w["host_vs_kernel"]
            for b in backends:
                x = hk.get(b) or {}
                row.append(f"{_f(x.get('kernel_ms'))} / {_f(x.get('host_ms'))} / {_f(x.get('wall_ms'))} "
                           f"({_f(x.get('idle_share'), '.0%')})"
                           if x.get("kernel_ms") is not None else "-")
        lines.append("| " + " | ".join(row) + " |")
    judged_not = [(w, b) for w in wls for b in backends
                  if (backend_of(w, b).get("accuracy") or {}).get("passed", False) is None]
    if judged_not:
        lines += ["", "Accuracy not judged: " + "; ".join(
            sorted({f"{label(w)} ({(backend_of(w, b).get('accuracy') or {}).get('reason')})" for w, b in judged_not})) + "."]
    return lines


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
