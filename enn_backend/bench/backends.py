"""The backends the benchmark compares, and how each compiles: its own cache folder, enn's
backend by its entry point, and what enn's report says about the graphs it compiled."""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections import Counter
from importlib.metadata import entry_points
from typing import Any, Callable, Iterator

import torch

from .. import compat
from ..backend import enn
from ..report import report

# backend name -> torch.compile keyword arguments (None: eager, no compile)
BACKENDS: dict[str, dict[str, Any] | None] = {
    "eager": None,
    "inductor": {"backend": "inductor"},
    "enn": {"backend": "enn"},
    "enn-guard-off": {"backend": "enn", "options": {"guard": "off"}},  # the guard's cost: enn / enn-guard-off
    "inductor-max-autotune": {"backend": "inductor", "mode": "max-autotune-no-cudagraphs"},
    "enn-max-autotune": {"backend": "enn", "options": {"mode": "max-autotune-no-cudagraphs"}},
    # CUDA graphs: Inductor's as users ask for it, enn's through its mode option (the guard kept on)
    "inductor-reduce-overhead": {"backend": "inductor", "mode": "reduce-overhead"},
    "enn-reduce-overhead": {"backend": "enn", "options": {"mode": "reduce-overhead"}},
}

# (slower, faster): the pairs of backends whose step-time ratio a workload reports when both ran,
# as ``speedup_<faster>_vs_<slower>`` (enn against Inductor, each in the same mode)
PAIRS: tuple[tuple[str, str], ...] = (("inductor", "enn"), ("inductor-max-autotune", "enn-max-autotune"),
                                      ("inductor-reduce-overhead", "enn-reduce-overhead"))


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """Set environment variables for the block; afterwards each is as it was (or unset)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def cache_dir(path: str) -> Iterator[None]:
    """Compile into Inductor/Triton cache folder ``path`` with empty in-memory caches."""
    os.makedirs(path, exist_ok=True)
    compat.clear_inductor_memory_caches()
    try:
        with environ(TORCHINDUCTOR_CACHE_DIR=path, TRITON_CACHE_DIR=os.path.join(path, "triton")):
            yield
    finally:
        compat.clear_inductor_memory_caches()


@functools.cache
def enn_entry_point_installed() -> bool:
    """Is ``backend="enn"`` resolvable through the installed entry point (``pip install -e .``)?"""
    return any(ep.name == "enn" for ep in entry_points(group="torch_dynamo_backends"))


def compile_with(model: torch.nn.Module, kwargs: dict[str, Any]) -> Callable:
    """``torch.compile`` with a backend of :data:`BACKENDS`.

    enn goes through its entry point (``backend="enn"``, what users write); in a source
    tree that was never pip-installed the same function is passed directly.
    """
    kwargs = dict(kwargs)
    if kwargs["backend"] == "enn" and not enn_entry_point_installed():
        kwargs["backend"] = enn
    return torch.compile(model, **kwargs)


def warm_up_compiler(device: str, cache_root: str, backends: list[str]) -> dict[str, float]:
    """One throwaway training step per compiled backend before any timed compile, so that no
    workload's cold compile pays a once-per-process (or once-per-machine) cost: Inductor's compile
    workers, and for a backend that gives CUDA graphs Inductor's C++ wrapper (enn) the wrapper's
    precompiled header, which Inductor builds once per machine and torch version into its default
    cache folder. Returns each backend's seconds, which the results report on their own line."""
    seconds: dict[str, float] = {}
    for b in backends:
        kwargs = BACKENDS.get(b)
        if kwargs is None:
            continue
        with cache_dir(os.path.join(cache_root, f"_warmup-{b}")):
            f = compile_with(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).to(device), kwargs)
            t0 = time.perf_counter()
            f(torch.randn(8, 8, device=device)).sum().backward()
            if device == "cuda":
                torch.cuda.synchronize()
            seconds[b] = time.perf_counter() - t0
        torch.compiler.reset()
    return seconds


def graph_count() -> int:
    """Dynamo graphs compiled so far in this process (graph breaks show up as more than one)."""
    return int(compat.dynamo_counters["stats"].get("unique_graphs", 0))


def enn_units() -> set[str]:
    """Every unit (Dynamo graph) enn's report knows of: from its graphs and from its fallbacks
    (a unit that fell back to plain Inductor as a whole has a fallback but no graph record)."""
    rep = report()
    return {g.unit for g in rep.graphs} | {f.graph.split("/")[0] for f in rep.fallbacks if f.graph}


def enn_summary(units: set[str]) -> dict[str, Any]:
    """What enn's report says about the graphs of ``units`` (one backend's compiles)."""
    rep = report()
    graphs = [g for g in rep.graphs if g.unit in units]
    fallbacks = [f for f in rep.fallbacks if f.graph.split("/")[0] in units]
    fusions: dict[str, int] = {}
    kinds: dict[str, int] = {}
    paths: dict[str, int] = {}
    for g in graphs:
        for k, v in g.fusions.items():
            fusions[k] = fusions.get(k, 0) + v
        paths[g.path] = paths.get(g.path, 0) + 1
    for fb in fallbacks:
        kinds[fb.kind] = kinds.get(fb.kind, 0) + 1
    return {
        "fusions": fusions,
        "fallbacks": kinds,
        "fallback_details": [f"[{f.kind}] {f.phase} {f.node}: {f.reason[:160]} -> {f.action}" for f in fallbacks][:10],
        "graph_paths": paths,
        "graphs": [g.id for g in graphs],
        "pinned": sum(len(g.pinned) for g in graphs),
        "kernel_choices": [c for g in graphs for c in g.kernel_choices][:20],
        "kernel_choice_counts": dict(Counter(str(c.get("choice", "?")) for g in graphs for c in g.kernel_choices)),
    }
