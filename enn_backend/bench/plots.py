"""The PNG plots of a benchmark result, and the files written for one: ``<stem>.json`` (raw),
``<stem>.md`` (:mod:`.markdown`) and the plots; JSON and Markdown are written atomically."""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

from ..report import atomic_write_text
from .markdown import render_markdown
from .summary import backend_of, label

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
    labels = [label(w) for w in wls]
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
        # bars grow from 1.0 (parity) on an axis fitted to the ratios: from 0 they would hide
        # the few percent that separate the backends
        ax.barh(labels, [x - 1.0 for x in sp], left=1.0, color=colors)
        ax.set_xlim(min(min(sp), 0.95) - 0.02, max(max(sp), 1.05) + 0.02)
        ax.axvline(1.0, color="black", lw=0.8)
        ax.axvline(0.97, color="gray", lw=0.8, ls="--")
        ax.set_xlabel("speedup of enn over inductor (step time ratio, >1 = enn faster)")
        ax.set_title(f"enn vs inductor step time ({title_dev})")
        ax.invert_yaxis()
        finish(fig, ax, "speedup", "speedup of enn over inductor per workload")
    comp = [b for b in result.get("config", {}).get("backends", []) if b != "eager"]
    if comp and any(backend_of(w, comp[0]).get("compile_cold_s") for w in wls):
        fig, ax = plt.subplots(figsize=(10, 0.35 * len(wls) * max(1, len(comp)) / 2 + 1.5))
        h = 0.8 / len(comp)
        for i, b in enumerate(comp):
            ys = [j + i * h for j in range(len(wls))]
            ax.barh(ys, [backend_of(w, b).get("compile_cold_s") or 0 for w in wls], height=h, label=f"{b} cold")
            ax.barh(ys, [backend_of(w, b).get("compile_warm_s") or 0 for w in wls], height=h * 0.4, color="black", alpha=0.5)
        ax.set_yticks([j + 0.4 - h / 2 for j in range(len(wls))], labels)
        ax.set_xlabel("compile time (s); thin dark bar = warm compile")
        ax.set_title(f"compile time ({title_dev})")
        ax.invert_yaxis()
        ax.legend()
        finish(fig, ax, "compile", "compile time per workload and backend")
    split = [w for w in wls if any((x or {}).get("kernel_ms") for x in (w.get("host_vs_kernel") or {}).values()
                                   if isinstance(x, dict))]
    if split:
        names = [b for b in result.get("config", {}).get("backends", []) if any(b in w["host_vs_kernel"] for w in split)]
        fig, ax = plt.subplots(figsize=(10, 0.35 * len(split) * len(names) / 2 + 1.5))
        h = 0.8 / len(names)
        for i, b in enumerate(names):
            ys = [j + i * h for j in range(len(split))]
            cells = [w["host_vs_kernel"].get(b) or {} for w in split]
            ax.barh(ys, [c.get("wall_ms") or 0 for c in cells], height=h, alpha=0.35, color=f"C{i}")
            ax.barh(ys, [c.get("kernel_ms") or 0 for c in cells], height=h, color=f"C{i}", label=b)
        ax.set_yticks([j + 0.4 - h / 2 for j in range(len(split))], [label(w) for w in split])
        ax.set_xlabel("ms per step: solid = device kernel time, pale = wall time (the gap: device idle, host-bound)")
        ax.set_title(f"kernel vs wall time per step ({title_dev})")
        ax.invert_yaxis()
        ax.legend()
        finish(fig, ax, "host_kernel", "kernel vs wall time per step and backend")
    note = ""
    mem_backends = [b for b in result.get("config", {}).get("backends", []) if any(backend_of(w, b).get("peak_mem_mb") for w in wls)]
    if mem_backends:
        fig, ax = plt.subplots(figsize=(10, 0.35 * len(wls) * len(mem_backends) / 2 + 1.5))
        h = 0.8 / len(mem_backends)
        for i, b in enumerate(mem_backends):
            ax.barh([j + i * h for j in range(len(wls))], [backend_of(w, b).get("peak_mem_mb") or 0 for w in wls], height=h, label=b)
        ax.set_yticks([j + 0.4 - h / 2 for j in range(len(wls))], labels)
        ax.set_xlabel("peak memory of one step above the resident tensors (MiB)")
        ax.set_title(f"peak memory ({title_dev})")
        ax.invert_yaxis()
        ax.legend()
        finish(fig, ax, "memory", "peak memory per workload and backend")
    else:
        note = "no peak-memory plot: memory is measured on CUDA only"
    return files, note


def device_folder(result: dict[str, Any]) -> str:
    dev = result.get("device", {})
    if dev.get("gpu"):
        return re.sub(r"[^a-z0-9]+", "-", dev["gpu"].lower()).strip("-")
    return "cpu"


def write_outputs(result: dict[str, Any], out_dir: str, stem: str | None = None, plots: bool = True) -> dict[str, str]:
    """``<stem>.json``, ``<stem>.md`` and (``plots``) PNG plots under ``out_dir``; returns what was written."""
    os.makedirs(out_dir, exist_ok=True)
    stem = stem or result.get("preset", "custom")
    files, note = write_plots(result, out_dir, stem) if plots else ({}, "")
    result["plot_note"] = note or None  # replaced, not added to, when a saved result is re-rendered
    if note:
        print(f"enn bench: {note}")
    json_path = os.path.join(out_dir, f"{stem}.json")
    atomic_write_text(json_path, json.dumps(clean_json(result), indent=1, allow_nan=False))
    files = {"raw results (JSON)": json_path, **files}
    md_path = os.path.join(out_dir, f"{stem}.md")
    md = render_markdown(result, files)
    notes = list(result.get("notes") or []) + ([result["plot_note"]] if result.get("plot_note") else [])
    if notes:
        md += "\nNotes: " + "; ".join(notes) + "\n"
    atomic_write_text(md_path, md)
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
