"""Rewrites the guard applies to a post-AOT (ATen-level) graph before compiling it.

- :func:`pin_nodes`      replace nodes by ``enn::pinned`` (run eagerly inside compiled code)
- :func:`plant_faults`   insert ``enn::fault`` after nodes matching ENN_FAULT_INJECT
- :func:`promote_to_fp32` run every fp16/bf16 computation of the graph in fp32, cast outputs back

All three work on a copy and keep ``meta['val']`` current (Inductor lowers from it). The
generic FX helpers they use (values, outputs, copies, dtype retargeting) are ``enn_backend.fx_utils``.
"""

from __future__ import annotations

import operator
from typing import Any, Iterable

import torch
import torch.fx as fx

from .. import blame, nvtx
from ..custom_ops import pinned as P
from ..fault_spec import FaultSpec, target_names
from ..fx_utils import CONVERT, copy_gm, fake_mode, refresh_all, retarget_dtypes, tensors_in, val, writes

# not kernels: a tuple's item, and the copy of a constant the graph holds (pinning it would hand
# Inductor a real tensor where it traces with fake ones)
_SKIP_TARGETS = {operator.getitem, torch.ops.aten.lift_fresh_copy.default}
# Not kernels whose values the guard judges: collectives, FSDP's copy-in / copy-out, stream and
# event bookkeeping. They stay where they are: every rank must issue the same collectives in the
# same order, and their order on the device is theirs.
_NOT_KERNELS = frozenset({"_c10d_functional", "c10d_functional", "c10d", "_dtensor", "fsdp", "streams", "profiler"})


def is_pinnable(n: fx.Node) -> bool:
    """A node that runs a kernel: an ATen/enn op with tensor outputs that is not a view."""
    if n.op != "call_function" or n.target in _SKIP_TARGETS:
        return False
    target = n.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace in _NOT_KERNELS:
        return False
    if target.namespace == "enn" and target._schema.name in ("enn::fault", "enn::pinned"):
        return False
    if getattr(target, "is_view", False):
        return False
    if any(r.alias_info is not None for r in target._schema.returns):
        return False  # in-place / out= / view ops
    if not all(_is_tensors(r.type) for r in target._schema.returns):
        return False  # enn::pinned returns tensors only: not the SymInts of CUDA flash / cuDNN SDPA
    v = val(n)
    if isinstance(v, (list, tuple)) and any(x is None for x in v):
        # an undefined tensor among the results (SDPA's memory-efficient backward without a
        # bias): enn::pinned returns an empty one in its place, so no node may read it
        undefined = {i for i, x in enumerate(v) if x is None}
        if any(u.target is not operator.getitem or (u.args[1] in undefined and u.users) for u in n.users):
            return False
    return bool(tensors_in(v))


def _is_tensors(t: Any) -> bool:
    """A schema return type that is ``Tensor`` or ``Tensor[]`` (not ``Tensor?``, ``SymInt``, ...)."""
    if isinstance(t, torch.ListType):
        t = t.getElementType()
    return isinstance(t, torch.TensorType)


def candidate_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if is_pinnable(n)]


def for_eager_runs(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` as the guard runs it eagerly: every ``prims.convert_element_type`` inside a
    higher-order op's subgraph (a flex score_mod, its joint) written as ``aten._to_copy``, the same
    cast (a copy of ``gm`` when there is one; ``gm`` itself otherwise).

    Eagerly, the flex op evaluates its score_mod under ``vmap`` over (batch, head, query, key).
    vmap has no batching rule for the prim, and its per-element fallback turns one call at T=1024
    into minutes. Only the compiled graph keeps the prim: Inductor lowers no ``_to_copy`` there.
    """
    def casts(m: fx.GraphModule) -> list[fx.Node]:
        return [n for sub in m.modules() if sub is not m and isinstance(sub, fx.GraphModule)
                for n in sub.graph.find_nodes(op="call_function", target=CONVERT)]

    if not casts(gm):
        return gm
    gm = copy_gm(gm)
    for n in casts(gm):
        with n.graph.inserting_before(n):
            cast = n.graph.call_function(torch.ops.aten._to_copy.default, (n.args[0],), {"dtype": n.args[1]})
        cast.meta.update(n.meta)
        n.replace_all_uses_with(cast)
        n.graph.erase_node(n)
    for sub in gm.modules():
        if isinstance(sub, fx.GraphModule):
            sub.recompile()
    return gm


def on_safe_paths(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` (changed in place) with every ATen op that has a registered safe path calling it
    directly: for the guard's fp64 run, where CUDA's SDPA kernels have no fp64 version and their
    safe paths (enn's attention math) compute in fp64. Not for compiling: a plain function node."""
    changed = False
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(getattr(n.target, "_schema", None), torch.FunctionSchema):
            path = P.SAFE_PATHS.get(P.op_name(n.target))
            if path is not None:
                n.target, changed = path, True
    if changed:
        gm.recompile()
    return gm


def pin_nodes(gm: fx.GraphModule, names: Iterable[str], reference: Iterable[str] = (),
              ranges: bool = False) -> fx.GraphModule:
    """Copy of ``gm`` with the named nodes replaced by ``enn::pinned`` calls, each running its
    op's safe path, those also named in ``reference`` its reference path
    (``custom_ops.pinned.reference_path``: what the guard's eager reference runs). With ``ranges``
    (option ``nvtx``) each runs inside its profiler range, ``enn/pinned/<op> <module path>``."""
    reference = set(reference)
    names = set(names)
    gm = copy_gm(gm)
    if not names:
        return gm
    graph = gm.graph
    mode = fake_mode(gm.graph)
    for n in list(graph.nodes):
        if n.name not in names or not is_pinnable(n):
            continue

        def is_tensor(x: Any) -> bool:
            return isinstance(x, fx.Node) and isinstance(val(x), torch.Tensor)

        def is_symint(x: Any) -> bool:
            return isinstance(x, fx.Node) and isinstance(val(x), torch.SymInt)

        template, tensors, ints = P.encode_args(n.args, dict(n.kwargs), is_tensor, is_symint)
        name = nvtx.range_name("pinned", P.op_name(n.target).rsplit(".", 1)[0], blame.module_of(n)) if ranges else ""
        spec = P.make_spec(n.target, template, range_name=name, reference=n.name in reference)
        with graph.inserting_before(n):
            p = graph.call_function(torch.ops.enn.pinned.default, (spec, tensors, ints))
        fake_args = ([val(t) for t in tensors], [val(i) for i in ints])
        try:
            with mode:
                p.meta["val"] = torch.ops.enn.pinned.default(spec, *fake_args)
        except Exception as exc:  # noqa: BLE001 -- name the node: the op's own error rarely does
            raise RuntimeError(f"enn: cannot pin {n.name} ({n.target}, args {n.args}): {type(exc).__name__}: {exc}") \
                from exc
        p.meta["enn_pinned_from"] = n.name
        if isinstance(val(n), torch.Tensor):
            with graph.inserting_after(p):
                g = graph.call_function(operator.getitem, (p, 0))
            g.meta["val"] = p.meta["val"][0]
            n.replace_all_uses_with(g)
        else:
            n.replace_all_uses_with(p)
        graph.erase_node(n)
    graph.lint()
    gm.recompile()
    return gm


def plant_faults(
    gm: fx.GraphModule, specs: Iterable[FaultSpec], phase: str, skip: Iterable[str] = ()
) -> tuple[fx.GraphModule, list[str]]:
    """Copy of ``gm`` with ``enn::fault`` planted after each matching node (not after ``skip``):
    a node of a spec's op, in a module its ``/<module>`` glob matches (the node's site's module).

    Returns the new graph and the names of the nodes that got a fault.
    """
    specs = [s for s in specs if s.phase == "compile" or s.applies_to(phase)]
    skip = set(skip)
    if not specs:
        return gm, []
    gm = copy_gm(gm)
    graph = gm.graph
    planted: list[str] = []
    for n in list(graph.nodes):
        if n.op != "call_function" or n.name in skip or not is_pinnable(n):
            continue
        ops = [s for s in specs if s.matches_target(n.target)]
        module = blame.site(n).get("module", "") if ops else ""
        spec = next((s for s in ops if s.matches_module(module)), None)
        if spec is None:
            continue
        out = n if isinstance(val(n), torch.Tensor) else next(
            (u for u in n.users if u.target is operator.getitem and u.args[1] == 0), None
        )
        if out is None or not val(out).is_floating_point():
            continue
        with graph.inserting_after(out):
            f = graph.call_function(torch.ops.enn.fault.default, (out, spec.planted_kind(f"{phase}/{n.name}")))
        f.meta["val"] = val(out)
        out.replace_all_uses_with(f, delete_user_cb=lambda u: u is not f)
        planted.append(n.name)
    graph.lint()
    gm.recompile()
    return gm, planted


def promote_to_fp32(gm: fx.GraphModule) -> fx.GraphModule:
    """Copy of ``gm`` that computes in fp32 whatever it computed in fp16/bf16."""
    return promote(gm, torch.float32)


def promote(gm: fx.GraphModule, target: torch.dtype) -> fx.GraphModule:
    """Copy of ``gm`` that computes in ``target`` whatever it computed in a narrower float dtype.

    Narrower inputs are cast up on entry, every dtype argument naming a narrower float dtype
    becomes ``target`` (for fp32 this undoes autocast's casts), and outputs are cast back to
    their original dtype so the graph's callers see no change of contract. What the graph
    writes into a narrower input (a running statistic, an optimizer state) it writes into the
    cast copy, which is copied back into the input at the end: the caller sees the write.
    """
    narrower = tuple(d for d in (torch.float16, torch.bfloat16, torch.float32) if d.itemsize < target.itemsize)
    gm = copy_gm(gm)
    graph = gm.graph
    up = CONVERT

    out_node = next(n for n in graph.nodes if n.op == "output")
    copies: dict[fx.Node, fx.Node] = {}  # narrower placeholder -> its cast copy
    for n in list(graph.nodes):
        if n.op == "placeholder":
            v = val(n)
            if isinstance(v, torch.Tensor) and v.dtype in narrower:
                with graph.inserting_after(n):
                    c = graph.call_function(up, (n, target))
                n.replace_all_uses_with(c, delete_user_cb=lambda u: u is not c)
                copies[n] = c
        elif n.op == "call_function" and n is not out_node:
            if getattr(n.target, "_schema", None) is not None and n.target._schema.name == "aten::view" and len(n.args) == 2 and isinstance(n.args[1], torch.dtype):
                continue  # a bitcast: its dtype is not a precision choice
            retarget_dtypes(n, narrower, target)

    # what the graph wrote into a cast copy goes back into the input, rounded to its dtype
    for placeholder, c in copies.items():
        if any(writes(u, c) for u in c.users):
            with graph.inserting_before(out_node):
                graph.call_function(torch.ops.aten.copy_.default, (placeholder, c))

    outs = out_node.args[0]
    new_outs = []
    for o in outs:
        v = val(o)
        if isinstance(v, torch.Tensor) and v.dtype in narrower:
            with graph.inserting_before(out_node):
                o = graph.call_function(up, (o, v.dtype))
        new_outs.append(o)
    out_node.args = (type(outs)(new_outs),)
    graph.lint()
    gm.recompile()
    refresh_all(gm)
    return gm


def has_random_ops(gm: fx.GraphModule) -> bool:
    """Does the graph draw random numbers? The guard re-runs such a graph with the RNG restored,
    and does not compare its values with eager's (the draws differ by design)."""
    for n in gm.graph.nodes:
        tags = getattr(n.target, "tags", ())
        if torch.Tag.nondeterministic_seeded in tags and not _no_dropout(n):
            return True
        if "seed" in str(n.target) or "rand" in str(n.target):
            return True
    return False


def _no_dropout(n: fx.Node) -> bool:
    """An op tagged random only for an optional dropout, called with ``dropout_p`` 0: SDPA and its
    kernels, as every model calls them in eval mode and HF's attention with dropout off. They draw
    nothing then (the kernels take the RNG only when dropout_p > 0)."""
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return False
    for i, arg in enumerate(schema.arguments):
        if arg.name == "dropout_p":
            p = n.args[i] if i < len(n.args) else n.kwargs.get("dropout_p", arg.default_value)
            return isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0
    return False


def node_op_name(n: fx.Node) -> str:
    names = target_names(n.target)
    return names[1] if names else str(n.target)
