"""``python -m enn_backend minify REPRO``: shrink a repro to the smallest graph that still fails.

The predicate is the repro's own check (:func:`enn_backend.debug.replay.check`): enn's
fast path (with the repro's options, fault injection included) against eager and fp64.
A smaller graph counts as failing only if it fails the same way as the original
(``compile``, ``exception``, ``nonfinite`` or ``accuracy``; ``--any`` accepts any), so the
minifier cannot wander off to an unrelated failure.

Two steps:

1. the blamed nodes alone: the guard already bisected the fault to a few nodes
   (``EXPECT['nodes']``); each is cut out with its real input values as placeholders
   and checked. A single failing node is as small as a graph gets.
2. otherwise torch's delta-debugging FX minifier
   (``torch._functorch.fx_minifier.minifier``) on the whole graph.

The result is written as ``<repro folder>/minified/repro.py`` (+ inputs), itself a repro
script with the same exit codes and the same Python literals for its data.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx

from .. import blame, compat
from ..guard import graph_edit as E
from ..report import atomic_write_text
from . import replay
from .repro import blame_lines, script_source, write_repro_dir


class MinifyError(RuntimeError):
    """The repro cannot be minified (it does not fail, or eager fails too)."""


@dataclass
class Minified:
    path: str  # the minimized repro script
    ops_before: int  # ops, as enn_backend.report counts them
    ops_after: int
    kind: str
    checks: int
    seconds: float


def load_script(path: str) -> Any:
    """Import a repro script as a module (its ``__main__`` block does not run)."""
    if os.path.isdir(path):
        path = os.path.join(path, "repro.py")
    if not os.path.exists(path):
        raise MinifyError(f"no repro script at {path}")
    name = f"enn_repro_{abs(hash(os.path.abspath(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise MinifyError(f"{path} is not a Python script: give a repro folder written by enn, or its repro.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - any error in the script's own code: say which and where
        del sys.modules[name]
        raise MinifyError(f"cannot load {path}: {type(exc).__name__}: {exc} (the script itself is broken; "
                          f"`python {path}` shows the traceback)") from exc
    for attr in ("PHASE", "OPTIONS", "make_module", "make_inputs"):
        if not hasattr(module, attr):
            raise MinifyError(f"{path} is not an enn repro script (no {attr})")
    return module


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's ops: what the report counts and the guard can pin (no views, no tuple items)."""
    return E.candidate_nodes(gm)


def _op_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]


def _concrete_values(gm: fx.GraphModule, inputs: Sequence[Any]) -> dict[fx.Node, Any]:
    env: dict[fx.Node, Any] = {}

    class Capture(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            env[n] = out
            return out

    with torch.no_grad():
        Capture(gm).run(*[replay.clone_input(x) for x in inputs])
    return env


def isolate(gm: fx.GraphModule, node: fx.Node, values: dict[fx.Node, Any]) -> tuple[fx.GraphModule, list[Any]]:
    """A graph of ``node`` alone: its input nodes become placeholders fed their real values."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[Any] = []
    for a in node.all_input_nodes:
        env[a] = g.placeholder(a.name)
        inputs.append(replay.clone_input(values[a]))
    new = g.node_copy(node, lambda a: env[a])
    getitems = [u for u in node.users if u.op == "call_function" and u.target.__name__ == "getitem"]
    if isinstance(values.get(node), (tuple, list)):
        outs = [g.node_copy(u, lambda a: new if a is node else env[a]) for u in getitems] or [new]
    else:
        outs = [new]
    g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g), inputs


def minify(repro: str, *, any_failure: bool = False, max_granularity: int | None = None,
           out: str | None = None, verbose: bool = False) -> Minified:
    t0 = time.perf_counter()
    script = load_script(repro)
    folder = os.path.dirname(os.path.abspath(script.__file__))
    phase, options = script.PHASE, dict(script.OPTIONS)
    expect = dict(getattr(script, "EXPECT", {}) or {})
    module, inputs = script.make_module(), list(script.make_inputs())
    gm = replay.trace(module, inputs)
    checks = 0

    def verdict(g: torch.nn.Module, inps: Sequence[Any], traced: fx.GraphModule | None = None) -> replay.Verdict:
        nonlocal checks
        checks += 1
        return replay.check(g, list(inps), phase=phase, options=options, gm=traced)

    kind = expect.get("kind") if expect.get("kind") in replay.FAULT_KINDS else None
    last: dict[int, replay.Verdict] = {}

    established: list[bool] = []

    def establish() -> str:
        established.append(True)
        first = verdict(module, inputs, gm)
        print(f"enn minify: {len(compute_nodes(gm))} ops; original check: {first.kind}: {first.message}",
              file=sys.stderr)
        if first.undecided:
            raise MinifyError(f"eager fails on the repro's inputs ({first.message}); nothing to minify")
        if not first.failed:
            raise MinifyError("the repro does not fail (enn's fast path agrees with eager); nothing to minify")
        return first.kind

    def fails(g: fx.GraphModule, inps: Sequence[Any]) -> bool:
        try:
            v = verdict(g, inps)
        except Exception as exc:  # noqa: BLE001 - a graph we cannot even trace does not count
            print(f"enn minify: a smaller graph could not be checked: {type(exc).__name__}: {exc}", file=sys.stderr)
            return False
        ok = v.failed and (any_failure or v.kind == kind)
        if ok:
            last[id(g)] = v
        return ok

    if kind is None:
        kind = establish()
    best: tuple[fx.GraphModule, list[Any]] | None = None
    final: replay.Verdict | None = None
    # Step 1: the nodes the guard blamed, each alone. A blamed node failing alone the
    # recorded way is the answer; the whole graph need not even be compiled.
    positions = expect.get("node_index") or []
    sites = list(expect.get("sites") or [])  # in the order of node_index
    ops = _op_nodes(gm)
    blamed = [ops[i] for i in positions if i < len(ops)]
    site_of = {ops[i]: s for i, s in zip(positions, sites) if i < len(ops)}
    blamed += [n for n in gm.graph.nodes if n.name in set(expect.get("nodes", [])) and n not in blamed]
    if blamed:
        values = _concrete_values(gm, inputs)
        for n in blamed:
            cand, cand_inputs = isolate(gm, n, values)
            if fails(cand, cand_inputs):
                at = f" at {blame.describe([site_of[n]])}" if n in site_of else ""
                print(f"enn minify: the blamed op {n.target}{at} fails alone", file=sys.stderr)
                best, final = (cand, cand_inputs), last[id(cand)]
                break
    # Step 2: torch's delta-debugging minifier, from a graph known to fail.
    if best is None:
        if not established:  # the whole graph must fail before torch's minifier starts
            kind = establish()
        kwargs: dict[str, Any] = {"skip_sanity": True}
        if max_granularity is not None:
            kwargs["max_granularity"] = max_granularity
        print("enn minify: running torch's FX minifier" + ("" if verbose else " (--verbose shows its progress)"),
              file=sys.stderr)
        with contextlib.nullcontext() if verbose else contextlib.redirect_stderr(io.StringIO()):
            min_gm, min_inputs = compat.fx_minifier(gm, inputs, fails, **kwargs)
        best = (min_gm, list(min_inputs))
    min_gm, min_inputs = best
    min_gm = replay.trace(min_gm, min_inputs)  # clean ATen graph with fresh metadata
    if final is None:
        final = verdict(min_gm, min_inputs, min_gm)
        if not final.failed:
            raise MinifyError(f"the minimized graph does not fail ({final.kind}); please report this as an enn bug")
    names = [n.name for n in compute_nodes(min_gm)]
    out = out or os.path.join(folder, "minified")
    if os.path.isdir(out):
        shutil.rmtree(out)
    new_expect = {"kind": final.kind, "nodes": names, "what": final.message,
                  "minimized_from": os.path.relpath(script.__file__, out), "original_sites": sites}
    title = (f"enn minimized repro: {final.kind} with {len(names)} op(s) "
             f"({', '.join(str(n.target) for n in compute_nodes(min_gm))}), from {len(compute_nodes(gm))}")
    if sites:
        title += "\n\n" + blame_lines(sites, "The guard blamed, in the model (the original repro's graph):")
    path = write_repro_dir(out, min_gm, min_inputs, phase=phase, options=options, expect=new_expect, title=title,
                           info={"original": os.path.abspath(script.__file__)})
    return Minified(path, len(compute_nodes(gm)), len(names), final.kind, checks, time.perf_counter() - t0)


def write_corpus(repro: str, out_path: str, doc: str = "", blame: list[str] | None = None) -> str:
    """Turn a (minimized) repro into a self-contained ``minifier_repros/repro_*.py`` file:
    graph and inputs inline, a pytest function that asserts enn's guard handles the fault,
    and the repro's ``__main__``. ``blame``: the node names the report must name, when they
    differ from the minimized graph's nodes (``["<graph>"]`` for a graph-level fallback)."""
    base = os.path.splitext(os.path.basename(out_path))[0]
    if not base.startswith("repro_"):
        raise MinifyError(f"corpus files are named repro_*.py (pytest collects them); got {out_path}")
    script = load_script(repro)
    module, inputs = script.make_module(), list(script.make_inputs())
    gm = replay.trace(module, inputs)
    expect = {k: v for k, v in dict(getattr(script, "EXPECT", {}) or {}).items() if k in ("kind", "nodes", "what", "original_sites")}
    if blame is not None:
        expect["nodes"] = list(blame)
    title = (script.__doc__ or "enn repro").strip().splitlines()[0]
    source, _ = script_source(gm, inputs, phase=script.PHASE, options=dict(script.OPTIONS), expect=expect,
                              title=title, corpus_test="test_" + base[len("repro_"):], corpus_doc=doc)
    atomic_write_text(out_path, source)
    return out_path
