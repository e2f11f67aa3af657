"""Summaries and goal verdicts of a benchmark result.

A result is the dict :func:`enn_backend.bench.runner.run_suite` returns (also the JSON written
next to the Markdown). Everything here and in :mod:`.markdown` / :mod:`.plots` reads only that
dict, so a saved JSON can be re-rendered: ``python -m enn_backend bench --render FILE.json``.

The goals checked (issue 6):

- GPU, bf16: geomean speedup of enn over inductor >= 1.10 over training and
  inference steps; no workload below 0.97x; enn's compile time <= 1.3x
  inductor's (checked cold over all workloads, warm as a geomean, and, stricter,
  for the worst single workload); enn's accuracy no worse than inductor's on
  every workload;
- CPU: geomean >= 1.0x inductor on the quick preset.

On the real-model presets (``real``, third-party models; issue 17) the GPU goals are stricter:
geomean >= 1.15 over training and inference and no workload below 1.00x.
"""

from __future__ import annotations

import math
from typing import Any

GPU_GOALS = {"geomean": 1.10, "min_workload": 0.97, "compile_ratio": 1.3}
REAL_GPU_GOALS = {"geomean": 1.15, "min_workload": 1.00, "compile_ratio": 1.3}
CPU_GOALS = {"geomean": 1.0}


def geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def backend_of(wl: dict[str, Any], name: str) -> dict[str, Any]:
    """The result of backend ``name`` in workload ``wl`` ({} when it did not run)."""
    return wl.get("backends", {}).get(name) or {}


def label(wl: dict[str, Any]) -> str:
    """``model mode dtype`` of a workload."""
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
    s["per_workload"] = {label(w): w["speedup_enn_vs_inductor"] for w in timed}
    if timed:
        worst = min(timed, key=lambda w: w["speedup_enn_vs_inductor"])
        s["worst"] = {"workload": label(worst), "speedup": worst["speedup_enn_vs_inductor"]}
    # compile times
    ratios, warm_ratios, tot_i, tot_e = [], [], 0.0, 0.0
    for w in wls:
        ci, ce = backend_of(w, "inductor").get("compile_cold_s"), backend_of(w, "enn").get("compile_cold_s")
        if ci and ce:
            ratios.append(ce / ci)
            tot_i, tot_e = tot_i + ci, tot_e + ce
        wi, we = backend_of(w, "inductor").get("compile_warm_s"), backend_of(w, "enn").get("compile_warm_s")
        if wi and we:
            warm_ratios.append(we / wi)
    s["compile"] = {"cold_total_inductor_s": tot_i, "cold_total_enn_s": tot_e,
                    "cold_total_ratio": tot_e / tot_i if tot_i else None,
                    "cold_geomean_ratio": geomean(ratios), "cold_worst_ratio": max(ratios) if ratios else None,
                    "warm_geomean_ratio": geomean(warm_ratios)}
    # accuracy
    acc: dict[str, Any] = {}
    for b in sorted({b for w in wls for b in w.get("backends", {})}):
        verdicts = [(backend_of(w, b).get("accuracy") or {}) for w in wls if b in w.get("backends", {})]
        acc[b] = {"pass": sum(1 for v in verdicts if v.get("passed")),
                  "fail": sum(1 for v in verdicts if v.get("passed", False) is False),
                  "failed": [label(w) for w in wls if b in w.get("backends", {})
                             and (backend_of(w, b).get("accuracy") or {}).get("passed", False) is False]}
        not_judged = sum(1 for v in verdicts if v and v.get("passed") is None)
        if not_judged:
            acc[b]["not_judged"] = not_judged
    s["accuracy"] = acc
    worse = [label(w) for w in wls if w.get("accuracy_enn_no_worse") and not w["accuracy_enn_no_worse"]["passed"]]
    s["accuracy_enn_worse_than_inductor"] = worse
    s["eager_self_check_failed"] = [label(w) for w in wls if w.get("eager_self_check", {}).get("passed", True) is False]
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
    goals_of = REAL_GPU_GOALS if str(result.get("preset", "")).startswith("real") else GPU_GOALS
    bf16 = [w for w in timed if w["dtype"] == "bf16"]
    scope = "bf16" if bf16 else "all dtypes (no bf16 workload ran)"
    sel = bf16 or timed
    g = geomean([w["speedup_enn_vs_inductor"] for w in sel])
    goals.append(_goal(f"GPU {scope}: geomean speedup enn vs inductor (train + infer)", goals_of["geomean"], g, True))
    if sel:
        worst = min(sel, key=lambda w: w["speedup_enn_vs_inductor"])
        goal = _goal(f"GPU {scope}: slowest workload vs inductor", goals_of["min_workload"], worst["speedup_enn_vs_inductor"], True)
        goal["where"] = label(worst)
        goal["below"] = [f"{label(w)}: {w['speedup_enn_vs_inductor']:.3f}" for w in sel
                         if w["speedup_enn_vs_inductor"] < goals_of["min_workload"]]
        goals.append(goal)
    # compile time: the zoo's total (cold) and geomean (warm), and, stricter, the worst workload
    pairs = [(backend_of(w, "inductor").get("compile_cold_s"), backend_of(w, "enn").get("compile_cold_s")) for w in sel]
    pairs = [(i, e) for i, e in pairs if i and e]
    goals.append(_goal(f"GPU {scope}: enn / inductor cold compile time, all workloads", goals_of["compile_ratio"],
                       sum(e for _, e in pairs) / sum(i for i, _ in pairs) if pairs else None, False))
    warm = [backend_of(w, "enn")["compile_warm_s"] / backend_of(w, "inductor")["compile_warm_s"] for w in sel
            if backend_of(w, "inductor").get("compile_warm_s") and backend_of(w, "enn").get("compile_warm_s")]
    if warm:
        goals.append(_goal(f"GPU {scope}: enn / inductor warm compile time (geomean)", goals_of["compile_ratio"],
                           geomean(warm), False))
    goals.append(_goal(f"GPU {scope}: worst enn / inductor cold compile time (one workload)", goals_of["compile_ratio"],
                       max(e / i for i, e in pairs) if pairs else None, False))
    worse = [label(w) for w in sel if w.get("accuracy_enn_no_worse") and not w["accuracy_enn_no_worse"]["passed"]]
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
