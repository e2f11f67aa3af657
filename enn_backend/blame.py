"""Where a graph's op comes from, in the user's terms: the module that ran it and its source line.

Every name enn shows a user for an op of a graph (the report, the logs, repro scripts, the
minifier) is a *site*: the module path first, then the file and line, then the FX node name
(what the report's JSON and the repro's ``EXPECT`` key by)::

    transformer.h.0.mlp.act (activations.py:52, in forward) [tanh]

Dynamo records on each node the modules it ran in (``meta['nn_module_stack']``, outermost
first) and the user's frames (``meta['stack_trace']``, innermost last). AOT Autograd gives a
backward node the module stack of the forward node it differentiates
(``meta['fwd_nn_module_stack']``) and that node's stack trace. A node a pass made without
that metadata has no site beyond its name.

A site is plain data (JSON-ready): ``node``, ``op``, ``module`` (dotted path from the compiled
module; ``""`` is the compiled module itself; absent when unknown), ``module_type``, ``file``,
``line``, ``function``, ``code``.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable, Sequence

import torch
import torch.fx as fx

Site = dict[str, Any]
# the keys a site may have and the type of each value
SITE_FIELDS = {"node": str, "op": str, "module": str, "module_type": str, "file": str, "line": int, "function": str,
               "code": str}

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)\n(?P<code>[^\n]*)')
_ROOT = re.compile(r"^L\['(?P<name>[^']+)'\]")
_ITEM = re.compile(r"""\._modules\[['"]([^'"]+)['"]\]|\[['"]?([^'"\]]+)['"]?\]""")


# Dynamo's name for the compiled module: ``self`` in its forward, ``fn`` when it is a torch.nn
# module compiled directly (torch._dynamo.external_utils.wrap_inline calls it as ``fn``)
_COMPILED_ROOTS = ("self", "fn")


def module_path(dynamo_path: str) -> str:
    """``L['self'].transformer._modules['h']['0']`` -> ``transformer.h.0``: the dotted path a
    user writes (``model.get_submodule(path)``). A root other than the compiled module (a
    module the compiled function took as argument ``m``) keeps its name: ``m.layer``."""
    m = _ROOT.match(dynamo_path)
    if m is None:
        return dynamo_path
    rest = _ITEM.sub(lambda x: "." + (x.group(1) or x.group(2)), dynamo_path[m.end():])
    root = "" if m.group("name") in _COMPILED_ROOTS else m.group("name")
    return (root + rest).lstrip(".")


def site(n: fx.Node) -> Site:
    """The site of node ``n``."""
    out: Site = {"node": n.name, "op": _op_name(n)}
    stack = n.meta.get("nn_module_stack") or n.meta.get("fwd_nn_module_stack")
    if stack:
        path, cls = list(stack.values())[-1]
        out["module"] = module_path(str(path))
        out["module_type"] = getattr(cls, "__name__", str(cls))
    frames = list(_FRAME.finditer(n.meta.get("stack_trace") or ""))
    if frames:
        f = frames[-1]
        out.update(file=f["file"], line=int(f["line"]), function=f["function"], code=f["code"].strip())
    return out


def module_of(n: fx.Node) -> str:
    """The user's module that ``n`` runs for: its own, else the nearest input's that has one
    (a node a pass or the partitioner added carries no module of its own)."""
    seen: set[fx.Node] = set()
    queue = [n]
    while queue:
        m = queue.pop(0)
        if m in seen or len(seen) > 64:
            continue
        seen.add(m)
        path = site(m).get("module")
        if path:
            return str(path)
        queue += [a for a in m.all_input_nodes if a.op != "placeholder"]
    return ""


def sites(gm: fx.GraphModule, names: Iterable[str]) -> list[Site]:
    """The sites of the nodes of ``gm`` named ``names`` (in that order); a name that is not
    a node of ``gm`` (``<graph>``) has none."""
    wanted = list(names)
    by_name = {n.name: n for n in gm.graph.nodes if n.name in set(wanted)}
    return [site(by_name[w]) for w in wanted if w in by_name]


def location(s: Site) -> str:
    """``modeling_gpt2.py:312, in forward`` (empty when the site has no source line)."""
    if "file" not in s:
        return ""
    return f"{os.path.basename(s['file'])}:{s['line']}, in {s['function']}"


def describe(group: Sequence[Site]) -> str:
    """Sites at one module and line as one phrase: module (file:line, in fn) [node, ...]."""
    s = group[0]
    names = f"[{', '.join(x['node'] for x in group)}]"
    where = location(s)
    if "module" in s:
        head = s["module"] or f"the compiled {s.get('module_type', 'module')}"
        return f"{head} ({where}) {names}" if where else f"{head} {names}"
    return f"{where} {names}" if where else ", ".join(x["node"] for x in group)


def grouped(all_sites: Sequence[Site]) -> list[list[Site]]:
    """Sites grouped by module and line, in order of first appearance."""
    groups: dict[tuple[Any, ...], list[Site]] = {}
    for s in all_sites:
        groups.setdefault((s.get("module"), s.get("file"), s.get("line")), []).append(s)
    return list(groups.values())


def describe_all(all_sites: Sequence[Site], limit: int = 4) -> str:
    """Several sites, grouped by module and line, the first ``limit`` groups spelled out and
    the rest counted: ``a (f.py:1, in g) [x]; b (f.py:2, in g) [y, z]; and 3 more ops``."""
    shown = grouped(all_sites)[:limit]
    text = "; ".join(describe(g) for g in shown)
    rest = len(all_sites) - sum(len(g) for g in shown)
    return text + (f"; and {rest} more op{'s' if rest != 1 else ''}" if rest else "")


def where(node: str, all_sites: Sequence[Site]) -> str:
    """What a report line names: the sites when there are any, else the recorded ``node``
    (``<graph>``: the whole graph; ``<none>``: nothing)."""
    if all_sites:
        return describe_all(all_sites)
    return {"<graph>": "the whole graph", "<none>": ""}.get(node, node)


def _op_name(n: fx.Node) -> str:
    if isinstance(n.target, torch._ops.OpOverload):
        return str(n.target)  # aten.tanh.default
    return getattr(n.target, "__name__", str(n.target))
