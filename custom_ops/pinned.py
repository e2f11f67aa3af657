"""``enn::pinned``: run one ATen op eagerly from inside a compiled graph.

When the guard blames a node, enn recompiles the graph with that node replaced by
``enn::pinned(spec, tensors, ints)``. Inductor cannot see into a custom op, so it
calls it as an extern kernel: the node runs on the eager ATen kernel (its safe
path) while every other node stays compiled and fused.

``spec`` is self-describing JSON (the op's name and a template of its arguments),
so a graph with pinned nodes survives the FX graph cache and a new process. A spec may name a
profiler range (``range``, :func:`make_spec`'s ``range_name``; option ``nvtx``): the op then
runs inside it (enn_backend.nvtx), and a spec without one adds nothing.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Callable, Optional

import torch

from enn_backend.nvtx import named_range

_TENSOR, _SYMINT, _LIST, _DTYPE, _DEVICE, _LAYOUT, _MEMFMT = "t", "s", "l", "dtype", "device", "layout", "mf"


def encode_args(args: Any, kwargs: dict[str, Any], is_tensor, is_symint) -> tuple[str, list, list]:
    """Split (args, kwargs) into a JSON template plus the tensor and SymInt leaves.

    ``is_tensor`` / ``is_symint`` classify leaves (FX nodes at graph-rewrite time).
    """
    tensors: list[Any] = []
    ints: list[Any] = []

    def enc(x: Any) -> Any:
        if is_tensor(x):
            tensors.append(x)
            return {_TENSOR: len(tensors) - 1}
        if is_symint(x):
            ints.append(x)
            return {_SYMINT: len(ints) - 1}
        if isinstance(x, (list, tuple)):
            return {_LIST: [enc(v) for v in x]}
        if isinstance(x, torch.dtype):
            return {_DTYPE: str(x).removeprefix("torch.")}
        if isinstance(x, torch.device):
            return {_DEVICE: str(x)}
        if isinstance(x, torch.layout):
            return {_LAYOUT: str(x).removeprefix("torch.")}
        if isinstance(x, torch.memory_format):
            return {_MEMFMT: str(x).removeprefix("torch.")}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise TypeError(f"enn::pinned cannot encode argument of type {type(x).__name__}")

    template = {"args": enc(list(args)), "kwargs": {k: enc(v) for k, v in kwargs.items()}}
    return template, tensors, ints


def make_spec(op: torch._ops.OpOverload, template: dict, range_name: str = "", reference: bool = False) -> str:
    """The spec of ``op`` called as ``template`` says; ``range_name``: the profiler range it runs in;
    ``reference``: the op runs its reference path (:data:`REFERENCE_PATHS`), not its safe path."""
    extra = {"range": range_name} if range_name else {}
    if reference:
        extra["reference"] = True
    return json.dumps({"op": op_name(op), **template, **extra}, sort_keys=True)


def op_name(op: torch._ops.OpOverload) -> str:
    """'aten.mm.default' for torch.ops.aten.mm.default."""
    return f"{op.namespace}.{op._schema.name.split('::')[1]}.{op._overloadname}"


def resolve_op(name: str) -> torch._ops.OpOverload:
    ns, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), packet), overload)


@functools.lru_cache(maxsize=4096)
def _decode(spec: str) -> tuple[torch._ops.OpOverload, dict]:
    data = json.loads(spec)
    return resolve_op(data["op"]), data


def _fill(x: Any, tensors: list, ints: list) -> Any:
    if isinstance(x, dict):
        if _TENSOR in x:
            return tensors[x[_TENSOR]]
        if _SYMINT in x:
            return ints[x[_SYMINT]]
        if _LIST in x:
            return [_fill(v, tensors, ints) for v in x[_LIST]]
        if _DTYPE in x:
            return getattr(torch, x[_DTYPE])
        if _DEVICE in x:
            return torch.device(x[_DEVICE])
        if _LAYOUT in x:
            return getattr(torch, x[_LAYOUT])
        if _MEMFMT in x:
            return getattr(torch, x[_MEMFMT])
    return x


# The FX meta key marking a node that an enn pass emitted (a fused kernel enn chose). The guard's
# eager reference runs the safe path of these nodes only: an op the user wrote runs as ATen.
EMITTED = "enn_emitted"

# enn op name -> its safe path. An enn op's own eager kernel may be the fast kernel
# that failed (e.g. a fused cuBLASLt GEMM), so pinning it runs this instead: the
# plain-ATen / math implementation with the same signature and results.
SAFE_PATHS: dict[str, Callable[..., Any]] = {}


def register_safe_path(op_name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``fn(*args, **kwargs)`` is the safe path of enn op ``op_name`` ('enn.x.default')."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        SAFE_PATHS[op_name] = fn
        return fn

    return deco


# enn op name -> its reference path: what the guard's eager reference (GraphCompiler.safe_gm)
# runs for the op, where that differs from its safe path. An op whose correct results differ
# from its safe path's by design (an FP8 GEMM rounds its operands to FP8; its safe path is the
# GEMM in its own dtype) is judged against an emulation of its own arithmetic, so that its
# rounding is not a fault, while pinning it still runs the safe path. An op with no entry here is
# judged against its safe path.
REFERENCE_PATHS: dict[str, Callable[..., Any]] = {}


def register_reference_path(op_name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``fn(*args, **kwargs)`` is the reference path of enn op ``op_name`` ('enn.x.default')."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        REFERENCE_PATHS[op_name] = fn
        return fn

    return deco


def reference_path(op_name: str) -> Optional[Callable[..., Any]]:
    """What the guard's reference runs for ``op_name``: its reference path, else its safe path
    (None: neither is registered, the op itself runs)."""
    return REFERENCE_PATHS.get(op_name, SAFE_PATHS.get(op_name))


def _eager_layout(t: Any) -> Any:
    """``t`` with no zero stride on a size-1 dimension: there it takes the stride a contiguous
    tensor has (1 for the last dimension). Such a stride addresses nothing, so Inductor may give
    a broadcast mask's size-1 dimensions stride 0, but some eager kernels check it: SDPA's
    memory-efficient kernel refuses a bias whose last stride is not 1, even of size 1. A view:
    nothing is copied."""
    if not isinstance(t, torch.Tensor) or all(n != 1 or s != 0 for n, s in zip(t.shape, t.stride())):
        return t
    strides = list(t.stride())
    inner = 1  # the stride a contiguous tensor has at dimension i
    for i in reversed(range(t.dim())):
        if t.shape[i] == 1 and strides[i] == 0:
            strides[i] = inner
        inner = strides[i] * t.shape[i] if strides[i] else inner * t.shape[i]
    return t.as_strided(t.shape, strides, t.storage_offset())


def call_spec(spec: str, tensors: list, ints: list, safe: bool = True) -> Any:
    """The op ``spec`` names called on ``tensors`` / ``ints``: when ``safe``, its reference path
    if the spec says ``reference`` (:func:`reference_path`), else its safe path; else the op."""
    op, data = _decode(spec)
    tensors = [_eager_layout(t) for t in tensors]
    args = _fill(data["args"], tensors, ints)
    kwargs = {k: _fill(v, tensors, ints) for k, v in data["kwargs"].items()}
    if not safe:
        return op(*args, **kwargs)
    path = reference_path(data["op"]) if data.get("reference") else SAFE_PATHS.get(data["op"])
    return (path or op)(*args, **kwargs)


def _run(spec: str, tensors: list, ints: list, fake: bool = False) -> list[torch.Tensor]:
    op, data = _decode(spec)
    if data.get("range") and not fake:
        with named_range(data["range"]):
            out = call_spec(spec, tensors, ints)
    else:
        out = call_spec(spec, tensors, ints)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    # A custom op may not return an alias of its inputs: views are materialized. Nor an
    # undefined tensor (SDPA's memory-efficient backward gives no bias gradient without a
    # bias): an empty one stands in, in a result no node reads (graph_edit.is_pinnable).
    aliasing = [r.alias_info is not None for r in op._schema.returns]
    if any(o is None for o in outs):
        like = next(t for t in tensors if t is not None)
        outs = [like.new_empty(0) if o is None else o for o in outs]
    return [o.clone() if (i < len(aliasing) and aliasing[i]) else o for i, o in enumerate(outs)]


# Inductor hands the op its inputs with the strides they had when the graph was traced: the
# eager kernel it runs may require them (SDPA's memory-efficient kernel refuses a bias whose last
# dimension is not contiguous, which Inductor's own layout for the same tensor may give).
@torch.library.custom_op("enn::pinned", mutates_args=(), tags=(torch.Tag.needs_exact_strides,))
def pinned(spec: str, tensors: list[Optional[torch.Tensor]], ints: list[int]) -> list[torch.Tensor]:
    """Run the ATen op described by ``spec`` eagerly on ``tensors`` / ``ints``."""
    return _run(spec, tensors, ints)


@pinned.register_fake
def _pinned_fake(spec: str, tensors: list, ints: list) -> list[torch.Tensor]:
    return _run(spec, tensors, ints, fake=True)

