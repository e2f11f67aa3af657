"""The model's own SDPA calls, re-planned from the provenance of their mask: :func:`replan_sdpa_calls`.

transformers (``attn_implementation="sdpa"``) calls ``F.scaled_dot_product_attention`` itself, and
under ``torch.compile`` always with a materialized ``[B, 1, Tq, Tk]`` boolean mask built by
``masking_utils`` (causal or sliding-window ``arange`` compares, ``and``-ed with the ``[B, T]``
padding vector), which SDPA turns into an additive ``where(mask, 0, fill)`` for its kernel (``fill``
is -inf for the CPU flash and memory-efficient kernels, a large finite negative for cuDNN). When
that mask is a causal band or key padding (:func:`~.provenance.keep_structure`), the kernel gets
``is_causal`` and, for padding, a ``[B, 1, 1, Tk]`` mask with the same fill, broadcast as a view
(no T x T tensor), built once per mask and shared by every layer that reads it.

What the kernel computes is unchanged wherever a query row keeps a key: a dropped key weighs
``exp(fill) = 0`` either way. A row that keeps no key is what the kernel makes of a row masked
whole, so the two must agree on it:

- key padding alone: the new mask holds the same fill at the same keys, so such a row is the same;
- a causal band alone: every row keeps its own key;
- a causal band with key padding (left padding): the rows before a sequence's first kept key keep
  none. The CPU flash kernel gives such a row zeros whether its keys are dropped by the causal
  flag or by -inf (bit-identical); so does CUDA's memory-efficient kernel (its outputs equal, its
  gradients equal within bf16 rounding: tests/test_hf_masks.py::test_cuda_sdpa_kernels_on_rows_that_keep_no_key). cuDNN weighs a
  row masked whole by its raw scores over every key, which the causal flag would change: in
  inference such a call becomes FlexAttention with a block mask built from the padding vector
  (kernels/flex_padding.py), which computes that row as cuDNN does; in training the mask stays.

A re-planned call is enn's choice: it is tagged as emitted, so the guard's eager reference runs
the op's safe path (enn's math) where it has one (custom_ops/attention/safe_paths.py). Anything
else keeps the mask as written, with the reason in the report.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple, Optional

import torch
import torch.fx as fx

from ...custom_ops.attention import Backend
from ...custom_ops.pinned import EMITTED
from ...fx_utils import is_call, shape
from ..manager import PassContext, current_module_state
from .emitter import Emitter
from .constants import Dims
from .kernels.flex_padding import PaddedCausalFlex
from .provenance import KeepStructure, keep_structure
from .match import scalar

aten = torch.ops.aten


class Arg(NamedTuple):
    """One argument of an op: its position (None: keyword-only) and name."""

    pos: Optional[int]
    name: str

    def get(self, n: fx.Node, default: Any = None) -> Any:
        if self.pos is not None and len(n.args) > self.pos:
            return n.args[self.pos]
        return n.kwargs.get(self.name, default)

    def set(self, n: fx.Node, value: Any) -> None:
        if self.pos is not None and len(n.args) > self.pos:
            n.update_arg(self.pos, value)
        else:
            n.update_kwarg(self.name, value)


class SdpaOp(NamedTuple):
    backend: Backend
    backward: Any
    mask: Arg  # the forward's additive mask, dropout and causal flag
    dropout: Arg
    causal: Arg
    backward_mask: Arg
    backward_causal: Arg
    zero_dead_rows: bool  # a row whose every key is masked comes out as zeros, however they are masked


# The SDPA ops whose mask and causal flag are arguments, as the dispatcher picked them when the
# graph was traced. Flash on CUDA takes no mask: a call with one never reaches it.
_MASK, _DROPOUT, _CAUSAL = Arg(3, "attn_bias"), Arg(5, "dropout_p"), Arg(6, "is_causal")
SDPA_OPS: dict[Any, SdpaOp] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: SdpaOp(
        Backend.CPU_FLASH, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        Arg(None, "attn_mask"), Arg(3, "dropout_p"), Arg(4, "is_causal"), Arg(None, "attn_mask"), Arg(7, "is_causal"),
        zero_dead_rows=True),
    aten._scaled_dot_product_cudnn_attention.default: SdpaOp(
        Backend.CUDNN, aten._scaled_dot_product_cudnn_attention_backward.default,
        _MASK, _DROPOUT, _CAUSAL, Arg(8, "attn_bias"), Arg(14, "is_causal"), zero_dead_rows=False),
    aten._scaled_dot_product_efficient_attention.default: SdpaOp(
        Backend.EFFICIENT, aten._scaled_dot_product_efficient_attention_backward.default,
        _MASK, _DROPOUT, _CAUSAL, Arg(4, "attn_bias"), Arg(11, "is_causal"), zero_dead_rows=True),
}


def _number(n: Any) -> Optional[float]:
    if is_call(n, aten.scalar_tensor.default):
        return _number(n.args[0])
    return scalar(n)


# The fills SDPA's boolean-mask conversion uses: -inf, or (cuDNN) fp16's lowest, which drops a
# key as surely: exp(scores - 65504) is 0 in the kernels' fp32.
_DROPS_KEY = -65504.0


def _keep_of(mask: Any) -> tuple[Optional[fx.Node], float]:
    """The boolean keep-mask of SDPA's additive ``where(keep, 0, fill)`` (what it makes of a bool
    mask) and its fill; (None, nan) for any other mask. A broadcast of that mask (SDPA's
    memory-efficient path expands it over the heads before the kernel) is the same mask."""
    while is_call(mask, aten.expand.default):
        mask = mask.args[0]
    if not is_call(mask, aten.where.self):
        return None, float("nan")
    cond, a, b = mask.args
    fill = _number(b)
    if _number(a) == 0.0 and fill is not None and fill <= _DROPS_KEY:
        return cond, fill
    return None, float("nan")


def _padding_mask(em: Emitter, ks: KeepStructure, like: fx.Node, fill: float) -> fx.Node:
    """``where(vector[:, None, None, :], 0, fill)`` as ``like``'s dtype, broadcast to its shape."""
    v = em.call(aten.unsqueeze.default, (em.call(aten.unsqueeze.default, (ks.key_padding, 1)), 1))
    like_val = like.meta["val"]
    zero = em.call(aten.scalar_tensor.default, (0.0,), {"dtype": like_val.dtype, "device": like_val.device})
    low = em.call(aten.scalar_tensor.default, (fill,), {"dtype": like_val.dtype, "device": like_val.device})
    small = em.call(aten.where.self, (v, zero, low))
    return em.call(aten.expand.default, (small, list(shape(like))))


def _plan(n: fx.Node, op: SdpaOp, training: bool) -> tuple[Optional[KeepStructure], str]:
    """The call's mask structure and how it is computed: ``(structure, "")`` for SDPA's flags,
    ``(structure, "flex")`` for FlexAttention, ``(None, why)`` to keep the mask."""
    if scalar(op.dropout.get(n, 0.0)) != 0.0:
        return None, "attention dropout"
    keep, _ = _keep_of(op.mask.get(n))
    if keep is None:
        return None, "a float mask that is not SDPA's where(mask, 0, fill) of a boolean mask"
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
    if kind == "causal" and ks.key_padding is not None and not op.zero_dead_rows:
        ok, why = PaddedCausalFlex.check(q.meta["val"], k.meta["val"], training)
        if ok and any(u.target is not operator.getitem or (u.args[1] != 0 and u.users) for u in n.users):
            ok, why = False, ("flex computes no output of the call but the attention result, which is not all "
                              "that is read")
        if not ok:
            return None, (f"{ks.describe()}: a query row that keeps no key (left padding) is weighed by its raw "
                          f"scores over every key in this kernel, which a causal flag would change, and {why}")
        return ks, "flex"
    return ks, ""


def _to_flex(n: fx.Node, mask: fx.Node, ks: KeepStructure, flex: PaddedCausalFlex) -> None:
    """Replace the forward call ``n`` by flex (_plan checked that only its attention result is read)."""
    q, k, v = n.args[0:3]
    scale = n.kwargs.get("scale")
    scale = float(scale) if scale is not None else shape(q)[-1] ** -0.5
    # A dead row weighs every key, its scores offset by the mask's fill as the kernel reads it.
    fill = float(torch.tensor(_keep_of(mask)[1], dtype=mask.meta["val"].dtype))
    out = flex.attend(n, q, k, v, ks.key_padding, fill, scale)
    for u in list(n.users):
        if u.args[1] == 0:
            u.replace_all_uses_with(out)
        n.graph.erase_node(u)
    n.graph.erase_node(n)


def replan_sdpa_calls(graph: fx.Graph, mode: Any, ctx: PassContext) -> int:
    """Give each SDPA call of the graph the structure of its mask; the count of calls re-planned."""
    count = 0
    made: dict[tuple, fx.Node] = {}  # (padding vector, shape, dtype) -> the mask every call reading it gets
    flex = PaddedCausalFlex(graph, mode)
    for n in list(graph.nodes):
        op = SDPA_OPS.get(n.target) if n.op == "call_function" else None
        if op is None or n.meta.get(EMITTED) or op.mask.get(n) is None or op.causal.get(n, False):
            continue  # enn's own kernel, nothing materialized, or a mask already re-planned (structure in the flag)
        mask = op.mask.get(n)
        backward = [u for u in graph.nodes if u.target is op.backward and u.args[1:4] == n.args[0:3]
                    and op.backward_mask.get(u) is mask]
        ks, how = _plan(n, op, training=bool(backward))
        if ks is None:
            ctx.kernel_choice(n, op.backend.value, f"model's SDPA call keeps its materialized mask: {how}",
                              fused=False, sdpa_call=True)
            continue
        if how == "flex":
            _to_flex(n, mask, ks, flex)
            ctx.kernel_choice(n, "flex", f"model's SDPA call re-planned from its mask's provenance ({ks.describe()}): "
                              "FlexAttention with a block mask built from the padding vector per call, rows that "
                              f"keep no key as {op.backend.value} weighs them (every key)",
                              fused=False, sdpa_call=True, causal=True, key_padding=True, training=False)
            count += 1
            continue
        new_mask, causal = None, ks.band[0] == "causal"
        if ks.key_padding is not None:
            fill = _keep_of(mask)[1]
            key = (ks.key_padding, shape(mask), mask.meta["val"].dtype, fill)
            if key not in made:
                made[key] = _padding_mask(Emitter(graph, mode, n), ks, mask, fill)
            new_mask = made[key]
        edits = [(n, op.causal, op.mask)] + [(b, op.backward_causal, op.backward_mask) for b in backward]
        for node, causal_arg, mask_arg in edits:
            causal_arg.set(node, causal)
            mask_arg.set(node, new_mask)
            node.meta[EMITTED] = True  # enn's choice now: the guard's reference runs the op's safe path
        ctx.kernel_choice(n, op.backend.value,
                          f"model's SDPA call re-planned from its mask's provenance ({ks.describe()}): "
                          f"is_causal={causal}, " + ("a [B, 1, 1, Tk] padding mask" if new_mask is not None
                                                     else "no mask tensor"),
                          fused=False, sdpa_call=True, causal=causal, key_padding=new_mask is not None,
                          training=bool(backward))
        count += 1
    return count
