"""Standalone repro folders for faults the guard blames.

On every blamed fault the guard calls ``GraphCompiler.write_repro(...)``, which calls
:func:`write_repro` here. It writes, under ``opts.resolved_repro_dir()`` (option ``repro_dir``
or ``ENN_REPRO_DIR``; by default ``repros/`` in enn's cache folder, never the working
directory), one folder per fault::

    ~/.cache/enn/repros/g0-forward-nonfinite-addmm/
        repro.py     the ATen graph as inline Python, the options, and a __main__ that
                     runs enn's fast path (guard off) against eager and an fp64 run;
                     exit 3 when the fault reproduces, 0 when not, 4 undecided, 1 when
                     the script itself failed (EXIT_CODES_DOC)
        inputs.pt    the real inputs of the faulting call (torch.save; loaded with
                     weights_only=True). Left out above MAX_SAVED_BYTES: the script
                     then regenerates inputs from the metadata it carries.
        constants.pt the graph's tensor constants (get_attr), when it has any
        fault.json   what happened: graph, phase, kind, message, blamed nodes, versions

Nothing here or in the script uses pickle beyond ``torch.save``/``torch.load(weights_only=True)``.
The script's data (``OPTIONS``, ``EXPECT``, ``INPUTS``, ``CONSTANTS``) are Python literals
(:func:`py_literal`): JSON's ``true``/``false``/``null`` are not Python.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
from dataclasses import fields
from typing import Any, Sequence

import torch
import torch.fx as fx

from .. import __version__, blame
from ..fx_utils import mutated_input_indices
from ..report import atomic_write_text
from .inputs import clone_input, input_meta, regenerate

# The exit codes of a repro script (enn_backend.debug.replay.run_repro returns them).
EXIT_OK, EXIT_SCRIPT_ERROR, EXIT_FAULT, EXIT_UNDECIDED = 0, 1, 3, 4
EXIT_CODES_DOC = """\
3  the fault reproduces
0  it does not: enn's fast path agrees with eager
4  undecided: eager itself fails on these inputs
1  the script itself failed (an exception in its own machinery: loading the inputs,
   tracing the graph; Python exits 1 on any uncaught exception, so an error before
   the check starts reads the same)"""

MAX_SAVED_BYTES = 256 * 2**20  # inputs larger than this are regenerated from metadata
INLINE_LITERAL_NUMEL = 64  # inline (corpus) repros spell out tensors up to this many elements

# Names FX-generated code may use without defining them (torch.fx.graph._custom_builtins).
_PREAMBLE_NAMES = {"torch", "inf", "nan", "NoneType", "device", "fx_pytree", "pytree"}
PREAMBLE = """\
import os
import sys
from math import inf, nan

import torch
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree
from torch import device

import enn_backend.custom_ops  # noqa: F401  enn's ops (enn::attention, ...) may appear in the graph
from enn_backend.debug.replay import load_constants, load_inputs, regenerate, run_repro

NoneType = type(None)
"""


# ----------------------------------------------------------------------------- graph -> source
def _import_line(name: str, obj: Any) -> str:
    import types

    if isinstance(obj, types.ModuleType):
        return f"import {obj.__name__} as {name}"
    mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if mod and qual and "." not in qual and "<" not in qual:
        return f"from {mod} import {qual} as {name}"
    if mod and qual and "<" not in qual:
        return f"import {mod}\n{name} = {mod}.{qual}"
    raise TypeError(f"enn repro: cannot name global {name!r} ({obj!r}) of the graph's code")


def graph_source(gm: fx.GraphModule, class_name: str = "Repro") -> tuple[str, dict[str, torch.Tensor]]:
    """Python source of ``gm`` as ``class <class_name>(torch.nn.Module)`` (subgraphs as
    further classes) and the tensor constants it reads with ``get_attr`` (by dotted name)."""
    classes: list[str] = []
    imports: set[str] = set()
    constants: dict[str, torch.Tensor] = {}

    def emit(mod: fx.GraphModule, cls: str, prefix: str) -> None:
        code = mod.graph.python_code(root_module="self")
        for name, obj in code.globals.items():
            if name not in _PREAMBLE_NAMES:
                imports.add(_import_line(name, obj))
        init = ["        super().__init__()"]
        seen: set[str] = set()
        for n in mod.graph.nodes:
            if n.op not in ("get_attr", "call_module") or n.target in seen:
                continue
            seen.add(n.target)
            obj = mod.get_submodule(n.target) if n.op == "call_module" else _getattr(mod, n.target)
            if isinstance(obj, fx.GraphModule):
                sub = f"{cls}_{re.sub(r'[^0-9A-Za-z_]', '_', n.target)}"
                emit(obj, sub, f"{prefix}{n.target}.")
                init.append(f"        self.{n.target} = {sub}()")
            elif isinstance(obj, torch.Tensor):
                constants[prefix + n.target] = obj.detach()
            else:
                raise TypeError(f"enn repro: cannot write {n.op} {n.target!r} of type {type(obj).__name__}")
        body = "\n".join("    " + ln if ln.strip() else "" for ln in code.src.strip("\n").splitlines())
        classes.append(f"class {cls}(torch.nn.Module):\n    def __init__(self):\n" + "\n".join(init) + "\n\n" + body + "\n")

    emit(gm, class_name, "")
    head = "\n".join(sorted(imports))
    return (head + "\n\n\n" if head else "") + "\n\n".join(classes), constants


def _getattr(mod: torch.nn.Module, target: str) -> Any:
    obj: Any = mod
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


# ----------------------------------------------------------------------------- data -> source
_PLAIN = (str, int, float, bool, type(None))


def py_literal(value: Any) -> str:
    """``value`` as Python source: plain data only (dicts with string keys, lists, tuples,
    str, int, float, bool, None), written with ``repr``, so ``False`` stays ``False``
    (``json.dumps`` writes ``false``, a NameError in a script). Non-finite floats are
    written ``nan`` / ``inf``: the script imports both from ``math``."""

    def check(v: Any, where: str) -> None:
        if isinstance(v, dict):
            for k, item in v.items():
                if not isinstance(k, str):
                    raise TypeError(f"enn repro: {where} has a key {k!r} that is not a string")
                check(item, f"{where}[{k!r}]")
        elif isinstance(v, (list, tuple)):
            for i, item in enumerate(v):
                check(item, f"{where}[{i}]")
        elif not isinstance(v, _PLAIN):
            raise TypeError(f"enn repro: {where} is a {type(v).__name__}, not plain data a script can spell")

    check(value, "the value")
    return repr(value)


def _literal(t: torch.Tensor) -> str:
    dtype = str(t.dtype)
    values = t.detach().cpu().reshape(-1).tolist()
    text = repr(values) if t.dtype != torch.bool else repr([bool(v) for v in values])
    return f"torch.tensor({text}, dtype={dtype}).reshape({list(t.shape)})"


def inline_inputs_source(inputs: Sequence[Any]) -> str:
    """``make_inputs()`` that builds the inputs in the script itself: small tensors spelled
    out value by value, larger ones regenerated (seeded) from their metadata."""
    lines = ["def make_inputs():", "    generated = regenerate(INPUTS, seed=0)", "    return ["]
    for i, x in enumerate(inputs):
        if isinstance(x, torch.Tensor) and x.numel() <= INLINE_LITERAL_NUMEL and x.is_contiguous():
            lines.append(f"        {_literal(x)}.to({str(x.device)!r}),")
        else:
            lines.append(f"        generated[{i}],")
    lines.append("    ]")
    return "\n".join(lines) + "\n"


def _as_saved(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return clone_input(x.detach())
    if isinstance(x, torch.SymInt):
        return int(x)
    return x


# ----------------------------------------------------------------------------- the script
def script_source(gm: fx.GraphModule, inputs: Sequence[Any], *, phase: str, options: dict[str, Any],
                  expect: dict[str, Any], title: str, inline: bool = False,
                  corpus_test: str | None = None, corpus_doc: str = "") -> tuple[str, dict[str, torch.Tensor]]:
    """The full text of a repro script, and the constants to save next to it.

    ``inline``: inputs are built in the script (no inputs.pt). ``corpus_test``: write a
    ``minifier_repros/`` file instead, with a pytest function of that name asserting that
    enn's guard handles the fault (``corpus_doc`` says what the fault is and where it came from).
    """
    classes, constants = graph_source(gm)
    title = title.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')  # it goes into the docstring
    metas = [input_meta(x) for x in inputs]
    const_meta = {k: input_meta(v) for k, v in constants.items()}
    if inline and constants:
        raise ValueError("enn repro: an inline repro cannot carry tensor constants")
    now = datetime.datetime.now().isoformat(timespec="seconds")
    codes = "Exit codes:\n" + "\n".join("    " + ln for ln in EXIT_CODES_DOC.splitlines())
    if corpus_test:
        inline = True
        doc = f'''#!/usr/bin/env python
"""{title}

{corpus_doc.strip()}

    python <this file>      enn's fast path (guard off) vs eager vs fp64: exit 3 while the
                            fault still reproduces (exit codes below)
    pytest <this file>      enn's guard must handle it: eager's result, the report names it

{codes}
"""
'''
    else:
        doc = f'''#!/usr/bin/env python
"""{title}

Written by enn {__version__} (torch {torch.__version__}) on {now}.

    python repro.py                       enn's fast path (guard off) vs eager vs fp64 on the
                                          saved inputs (exit codes below)
    python repro.py --regenerate          same, with inputs regenerated from INPUTS (seed 0)
    python -m enn_backend minify <folder> shrink to the smallest graph that still fails

ENN_* environment variables override OPTIONS (e.g. ENN_EPILOGUE=0 python repro.py).

{codes}
"""
'''
    parts = [doc, PREAMBLE, ""]
    parts.append(f"PHASE = {phase!r}")
    parts.append(f"OPTIONS = {py_literal(dict(sorted(options.items())))}")
    parts.append(f"EXPECT = {py_literal(dict(sorted(expect.items())))}")
    parts.append("INPUTS = [\n" + "".join(f"    {py_literal(m)},\n" for m in metas) + "]")
    parts.append(f"CONSTANTS = {py_literal(const_meta)}")
    parts.append("HERE = os.path.dirname(os.path.abspath(__file__))\n\n")
    parts.append(classes + "\n")
    parts.append("def make_module():\n"
                 "    return load_constants(Repro(), os.path.join(HERE, 'constants.pt'), CONSTANTS)\n\n")
    if inline:
        parts.append(inline_inputs_source(inputs) + "\n")
    else:
        parts.append("def make_inputs():\n    return load_inputs(os.path.join(HERE, 'inputs.pt'), INPUTS)\n\n")
    if corpus_test:
        parts[1] = parts[1].replace("regenerate, run_repro", "guarded_problems, regenerate, run_repro")
        parts.append(f"def {corpus_test}():\n"
                     "    problems = guarded_problems(make_module(), make_inputs(), phase=PHASE, options=OPTIONS, expect=EXPECT)\n"
                     "    assert not problems, problems\n\n")
    parts.append('\nif __name__ == "__main__":\n'
                 "    sys.exit(run_repro(make_module, make_inputs, phase=PHASE, options=OPTIONS, expect=EXPECT))\n")
    return "\n".join(parts), constants


def write_repro_dir(folder: str, gm: fx.GraphModule, inputs: Sequence[Any], *, phase: str,
                    options: dict[str, Any], expect: dict[str, Any], title: str,
                    info: dict[str, Any] | None = None) -> str:
    """Write ``repro.py`` (+ ``inputs.pt``, ``fault.json``) into ``folder``; return the script's path."""
    inputs = [_as_saved(x) for x in inputs]
    source, constants = script_source(gm, inputs, phase=phase, options=options, expect=expect, title=title)
    os.makedirs(folder, exist_ok=True)
    nbytes = sum(t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor))
    saved = nbytes <= MAX_SAVED_BYTES
    if saved:
        _save(os.path.join(folder, "inputs.pt"), {"inputs": inputs})
    if constants:  # part of the graph itself: always saved
        _save(os.path.join(folder, "constants.pt"), {"constants": constants})
    record = {
        "format": "enn-repro", "version": 1, "phase": phase, "options": options, **expect,
        "inputs": "inputs.pt" if saved else f"regenerated from metadata ({nbytes} bytes is over {MAX_SAVED_BYTES})",
        "torch": torch.__version__, "python": sys.version.split()[0], **(info or {}),
    }
    atomic_write_text(os.path.join(folder, "fault.json"), json.dumps(record, indent=2, default=str))
    path = os.path.join(folder, "repro.py")
    atomic_write_text(path, source)
    return path


def _save(path: str, obj: Any) -> None:
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def unique_folder(root: str, name: str) -> str:
    """``root/name``, or ``root/name-2``, ``-3``, ... if taken."""
    name = re.sub(r"[^0-9A-Za-z_.-]+", "-", name).strip("-")[:80]
    path, n = os.path.join(root, name), 2
    while os.path.exists(path):
        path, n = os.path.join(root, f"{name}-{n}"), n + 1
    return path


def saved_options(opts: Any) -> dict[str, Any]:
    """The options a repro needs: every non-default one that changes what is compiled."""
    skip = {"guard", "guard_every", "localize_budget", "cache_dir", "persist", "repro_dir", "repro"}
    return {f.name: getattr(opts, f.name) for f in fields(opts)
            if f.name not in skip and getattr(opts, f.name) != f.default}


def blame_lines(sites: Sequence[dict[str, Any]], header: str = "Blamed op(s), where they are in the model:") -> str:
    """The blamed ops for a repro's docstring: one line per site, with its source line."""
    lines = [header]
    for s in sites:
        lines.append(f"    {blame.describe([s])}: {s['op']}")
        if s.get("code"):
            lines.append(f"        {s['code']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the guard's hook
def write_repro(compiler: Any, *, kind: str, what: str, inputs: Sequence[Any] | None, snapshot: Sequence[Any] | None,
                nodes: str) -> str:
    """Write a repro folder for a fault the guard blamed on ``nodes`` of ``compiler``'s graph.

    ``inputs`` are the real inputs of the faulting call; ``snapshot`` holds the values the
    graph's mutated inputs had before the call (the call may have written into them).
    Without ``inputs`` (a compile-time fault) inputs are regenerated from the graph's metadata.
    """
    gm = compiler.eager_gm
    if inputs is None:
        fake = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
        inputs = regenerate([_fake_meta(v) for v in fake])
    real = list(inputs)
    if snapshot is not None:
        for i, saved in zip(mutated_input_indices(gm), snapshot):
            real[i] = saved
    rec = compiler.record
    node_list = [n for n in nodes.split(",") if n and not n.startswith("<")]
    folder = unique_folder(compiler.opts.resolved_repro_dir(), f"{rec.id.replace('/', '-')}-{kind}-{node_list[0] if node_list else 'graph'}")
    ops = [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
    index = [i for i, n in enumerate(ops) if n.name in node_list]
    blamed = [blame.site(ops[i]) for i in index]  # in the order of node_index (the minifier pairs them)
    expect = {"kind": kind, "nodes": node_list, "node_index": index, "sites": blamed,
              "what": what.strip().splitlines()[0][:300] if what else "", "graph": rec.id}
    title = f"enn repro: {kind} in graph {rec.id} ({compiler.phase}), blamed: {blame.where('<graph>', blamed)}"
    if blamed:
        title += "\n\n" + blame_lines(blamed)
    return write_repro_dir(folder, gm, real, phase=compiler.phase, options=saved_options(compiler.opts),
                           expect=expect, title=title)


def _fake_meta(v: Any) -> dict[str, Any]:
    if isinstance(v, torch.Tensor):
        hint = [int(s) if not isinstance(s, torch.SymInt) else _hint(s) for s in v.shape]
        stride = [int(s) if not isinstance(s, torch.SymInt) else _hint(s) for s in v.stride()]
        return {"kind": "tensor", "shape": hint, "stride": stride, "dtype": str(v.dtype).removeprefix("torch."),
                "device": str(v.device)}
    if isinstance(v, torch.SymInt):
        return {"kind": "scalar", "value": _hint(v)}
    return {"kind": "scalar", "value": v}


def _hint(s: torch.SymInt) -> int:
    node = s.node
    hint = node.hint if getattr(node, "hint", None) is not None else node.shape_env.size_hint(node.expr)
    return int(hint)
