"""``enn::ranged``: run one op of a compiled graph inside a named profiler range (option ``nvtx``).

``enn::ranged(name, spec, tensors, ints)`` runs the op ``spec`` describes (``enn::pinned``'s
spec: the op's name and a template of its arguments) inside ``enn_backend.nvtx.named_range(name)``
and returns the outputs the spec's ``keep`` lists (its tensor outputs; the pass that wraps a node
puts its int and undefined outputs in the graph as constants). Inductor calls it as an extern
kernel, so the range covers exactly that op's kernel launches.

It runs the op itself, not its safe path; pinned (by the guard) or run by the guard's eager
reference it runs the op's safe path, as the op would.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import torch

from enn_backend.nvtx import named_range

from .pinned import _decode, call_spec, make_spec, register_safe_path


def _outputs(spec: str, out: Any) -> list[torch.Tensor]:
    op, data = _decode(spec)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    returns = op._schema.returns
    # a custom op may not return an alias of its inputs (views are materialized)
    return [outs[i].clone() if i < len(returns) and returns[i].alias_info is not None else outs[i]
            for i in data["keep"]]


@torch.library.custom_op("enn::ranged", mutates_args=(), tags=(torch.Tag.needs_exact_strides,))
def ranged(name: str, spec: str, tensors: list[Optional[torch.Tensor]], ints: list[int]) -> list[torch.Tensor]:
    """Run the op described by ``spec`` inside the range ``name``."""
    with named_range(name):
        return _outputs(spec, call_spec(spec, tensors, ints, safe=False))


@ranged.register_fake
def _ranged_fake(name: str, spec: str, tensors: list, ints: list) -> list[torch.Tensor]:
    return _outputs(spec, call_spec(spec, tensors, ints, safe=False))


@register_safe_path("enn.ranged.default")
def _safe_path(name: str, spec: str, tensors: list, ints: list) -> list[torch.Tensor]:
    """What a pinned enn::ranged runs: the wrapped op's safe path."""
    return _outputs(spec, call_spec(spec, tensors, ints, safe=True))


def OPCHECK_SAMPLES() -> dict:
    """Samples for tests/test_opcheck.py: a matmul and a two-output op, ranged."""
    mm = json.loads(make_spec(torch.ops.aten.mm.default, {"args": {"l": [{"t": 0}, {"t": 1}]}, "kwargs": {}}))
    mm["keep"] = [0]
    mx = json.loads(make_spec(torch.ops.aten.max.dim, {"args": {"l": [{"t": 0}, 1]}, "kwargs": {}}))
    mx["keep"] = [0, 1]
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 4, generator=g), torch.randn(4, 5, generator=g)
    return {"enn::ranged": [(("enn/epilogue/test", json.dumps(mm, sort_keys=True), [a, b], []), {}),
                            (("enn/attention/test", json.dumps(mx, sort_keys=True), [a], []), {})]}
