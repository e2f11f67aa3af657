"""The softmax of an attention, as it reaches the joint graph: :func:`softmax_of`, :func:`softmax_input`.

``_softmax`` or Inductor's decomposition ``exp(x - amax(x)) / sum(exp(x - amax(x)))``, and the
*safe* softmax of SDPA's math path (what a model's ``scaled_dot_product_attention`` decomposes to
where no kernel takes it, e.g. with dropout on CPU)::

    where(logical_not(any(logical_not(x == -inf), -1, keepdim)), 0, softmax(x))

which gives 0, not NaN, in a row whose every score is -inf (``enn::attention``'s
``masked_rows="zero"``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

from ...fx_utils import is_call, shape, val

aten = torch.ops.aten


def softmax_of(n: Any) -> Optional[tuple[fx.Node, int]]:
    """(x, axis) if ``n`` is softmax(x) (ATen or Inductor's decomposition), the axis non-negative."""
    if is_call(n, aten._softmax.default):
        x = n.args[0]
        return x, n.args[1] % len(shape(x))
    if not is_call(n, aten.div.Tensor):
        return None
    e, s = n.args
    if not (is_call(e, aten.exp.default) and is_call(s, aten.sum.dim_IntList) and s.args[0] is e):
        return None
    sub = e.args[0]
    if not is_call(sub, aten.sub.Tensor):
        return None
    x, amax = sub.args
    if not (is_call(amax, aten.amax.default) and amax.args[0] is x):
        return None
    nd = len(shape(x))
    axes = {tuple(d % nd for d in r.args[1]) for r in (amax, s)}
    if len(axes) != 1 or len(next(iter(axes))) != 1 or not all(len(r.args) > 2 and r.args[2] for r in (amax, s)):
        return None
    return x, next(iter(axes))[0]


def _last_axis(n: Any) -> Optional[fx.Node]:
    got = softmax_of(n)
    return got[0] if got is not None and got[1] == len(shape(got[0])) - 1 else None


def _all_neg_inf_rows(cond: Any, x: fx.Node) -> bool:
    """``cond`` is ``logical_not(any(logical_not(x == -inf), -1, keepdim=True))``."""
    if not is_call(cond, aten.logical_not.default) or not is_call(cond.args[0], aten.any.dim):
        return False
    anyd = cond.args[0]
    if anyd.args[1] not in (-1, len(shape(x)) - 1) or not (len(anyd.args) > 2 and anyd.args[2]):
        return False
    inner = anyd.args[0]
    if not is_call(inner, aten.logical_not.default) or not is_call(inner.args[0], aten.eq.Scalar):
        return False
    eq = inner.args[0]
    return eq.args[0] is x and eq.args[1] == float("-inf")


def _zero(n: Any) -> bool:
    if isinstance(n, (int, float)) and not isinstance(n, bool):
        return n == 0
    return is_call(n, aten.full.default) and n.args[1] == 0 and isinstance(val(n), torch.Tensor)


def softmax_input(n: Any) -> tuple[Optional[fx.Node], bool]:
    """(x, zero_rows) if ``n`` is a softmax of x over the last axis, ``zero_rows`` when it is the
    safe softmax; (None, False) otherwise."""
    x = _last_axis(n)
    if x is not None:
        return x, False
    if is_call(n, aten.where.self) and _zero(n.args[1]):
        x = _last_axis(n.args[2])
        if x is not None and _all_neg_inf_rows(n.args[0], x):
            return x, True
    return None, False
