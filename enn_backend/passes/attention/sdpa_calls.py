"""The model's own SDPA calls, re-planned from the provenance of their mask: :func:`replan_sdpa_calls`.

transformers (``attn_implementation="sdpa"``) calls ``F.scaled_dot_product_attention`` itself, and
under ``torch.compile`` always with a materialized ``[B, 1, Tq, Tk]`` boolean mask built by
``masking_utils`` (causal or sliding-window ``arange`` compares, ``and``-ed with the ``[B, T]``
padding vector), which SDPA turns into ``where(mask, 0, -inf)``. When that mask is causal, with
or without key padding (:func:`~.provenance.keep_structure`), the kernel gets ``is_causal`` and, for
padding, a ``[B, 1, 1, Tk]`` mask broadcast as a view (no T x T tensor), built once per mask and
shared by every layer that reads it. The kernel drops the same keys; on the CPU flash kernel
the values and gradients are bit-identical, rows whose keys are all masked included (both give
them zeros). A re-planned call is enn's choice: it is tagged as emitted, so the guard's eager
reference runs the op's safe path (enn's math), not the re-planned kernel. Anything else keeps
the mask as written, with the reason in the report.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
import torch.fx as fx

from ...custom_ops.attention import Backend
from ...custom_ops.pinned import EMITTED
from ..fx_utils import is_call, shape
from ..manager import PassContext, current_module_state
from .emitter import Emitter
from .constants import Dims
from .provenance import KeepStructure, keep_structure
from .match import scalar

aten = torch.ops.aten


class SdpaOp(NamedTuple):
    backend: Backend
    backward: Any
    dropout_arg: int  # positions of dropout_p / is_causal in the forward's and backward's args
    causal_arg: int
    backward_causal_arg: int


# The SDPA ops whose mask and causal flag are arguments (CPU flash: ``attn_mask`` keyword).
SDPA_OPS: dict[Any, SdpaOp] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: SdpaOp(
        Backend.CPU_FLASH, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, 3, 4, 7),
}


def _arg(n: fx.Node, pos: int, name: str, default: Any) -> Any:
    return n.args[pos] if len(n.args) > pos else n.kwargs.get(name, default)


def _number(n: Any) -> Optional[float]:
    if is_call(n, aten.scalar_tensor.default):
        return _number(n.args[0])
    return scalar(n)


def _keep_of(mask: Any) -> Optional[fx.Node]:
    """The boolean keep-mask of SDPA's additive ``where(keep, 0, -inf)`` (what it makes of a bool mask)."""
    if not is_call(mask, aten.where.self):
        return None
    cond, a, b = mask.args
    if _number(a) == 0.0 and _number(b) == float("-inf"):
        return cond
    return None


def _padding_mask(em: Emitter, ks: KeepStructure, like: fx.Node) -> fx.Node:
    """``where(vector[:, None, None, :], 0, -inf)`` as ``like``'s dtype, broadcast to its shape."""
    v = em.call(aten.unsqueeze.default, (em.call(aten.unsqueeze.default, (ks.key_padding, 1)), 1))
    dtype = like.meta["val"].dtype
    zero = em.call(aten.scalar_tensor.default, (0.0,), {"dtype": dtype, "device": like.meta["val"].device})
    ninf = em.call(aten.scalar_tensor.default, (float("-inf"),), {"dtype": dtype, "device": like.meta["val"].device})
    small = em.call(aten.where.self, (v, zero, ninf))
    return em.call(aten.expand.default, (small, list(shape(like))))


def _plan(n: fx.Node, op: SdpaOp) -> tuple[Optional[KeepStructure], str]:
    mask = n.kwargs.get("attn_mask")
    if scalar(_arg(n, op.dropout_arg, "dropout_p", 0.0)) != 0.0:
        return None, "attention dropout"
    keep = _keep_of(mask)
    if keep is None:
        return None, "a float mask that is not SDPA's where(mask, 0, -inf) of a boolean mask"
    q, k = n.args[0], n.args[1]
    tq, tk = shape(q)[-2], shape(k)[-2]
    ks, why = keep_structure(keep, Dims(tq, tk, shape(q)[1]), shape(q)[0], current_module_state())
    if ks is None:
        return None, why
    kind = ks.band[0]
    if kind == "window":
        return None, f"{ks.describe()}: the kernel has no sliding-window flag"
    if kind == "causal" and tq != tk:
        return None, "causal mask with Tq != Tk (SDPA's causal is top-left aligned)"
    return ks, ""


def replan_sdpa_calls(graph: fx.Graph, mode: Any, ctx: PassContext) -> int:
    """Give each SDPA call of the graph the structure of its mask; the count of calls re-planned."""
    count = 0
    made: dict[tuple, fx.Node] = {}  # (padding vector, shape, dtype) -> the mask every call reading it gets
    for n in list(graph.nodes):
        op = SDPA_OPS.get(n.target) if n.op == "call_function" else None
        if op is None or n.meta.get(EMITTED) or n.kwargs.get("attn_mask") is None or _arg(
                n, op.causal_arg, "is_causal", False):
            continue  # enn's own kernel, nothing materialized, or a mask already re-planned (structure in the flag)
        ks, why = _plan(n, op)
        if ks is None:
            ctx.kernel_choice(n, op.backend.value, f"model's SDPA call keeps its materialized mask: {why}",
                              fused=False, sdpa_call=True)
            continue
        mask = n.kwargs["attn_mask"]
        new_mask, causal = None, ks.band[0] == "causal"
        if ks.key_padding is not None:
            key = (ks.key_padding, shape(mask), mask.meta["val"].dtype)
            if key not in made:
                made[key] = _padding_mask(Emitter(graph, mode, n), ks, mask)
            new_mask = made[key]
        backward = [u for u in graph.nodes if u.target is op.backward and u.args[1:4] == n.args[0:3]
                    and u.kwargs.get("attn_mask") is mask]
        for node, pos in [(n, op.causal_arg)] + [(b, op.backward_causal_arg) for b in backward]:
            if len(node.args) > pos:
                node.update_arg(pos, causal)
            else:
                node.update_kwarg("is_causal", causal)
            node.update_kwarg("attn_mask", new_mask)
            node.meta[EMITTED] = True  # enn's choice now: the guard's reference runs the op's safe path
        ctx.kernel_choice(n, op.backend.value,
                          f"model's SDPA call re-planned from its mask's provenance ({ks.describe()}): "
                          f"is_causal={causal}, " + ("a [B, 1, 1, Tk] padding mask" if new_mask is not None
                                                     else "no mask tensor"),
                          fused=False, sdpa_call=True, causal=causal, key_padding=new_mask is not None,
                          training=bool(backward))
        count += 1
    return count
