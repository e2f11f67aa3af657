"""enn's precision decompositions: fp32 accumulation for fp16/bf16 reductions.

:data:`ENTRIES` are enn's entries of the decomposition table:
:func:`enn_backend.decompositions.decomposition_table` layers them over Inductor's table
when the ``precision`` option is on (``ENN_PRECISION=0`` drops every entry).

Each entry only changes fp16/bf16 inputs: it casts them to fp32 once, runs Inductor's
own decomposition (or ATen reference) in fp32, and casts the result back once. Other
dtypes get Inductor's entry unchanged.

What Inductor (torch 2.11-2.13) already does, checked in ``torch/_decomp/decompositions.py``,
``torch/_refs`` and ``torch/_inductor/lowering.py`` and measured against fp64
(tests/test_precision.py), so enn adds NO entry for it:

====================================  ============================================================
op                                    Inductor already
====================================  ============================================================
_softmax, _log_softmax (+ backward)   upcast to fp32 (``get_computation_dtype``), cast back once
native_layer_norm (+ backward)        upcast to fp32 for mean/rstd and the normalization
_fused_rms_norm (+ backward)          upcast to fp32 (``rms_norm`` reaches it on 2.8+)
native_group_norm (+ backward)        upcast to fp32
var / var_mean (lowering), std (ref)  ``var_mean_helper_`` computes in fp32; ``std`` ref upcasts
mean (lowering)                       sums in fp32, divides, casts back
sum (lowering)                        accumulates in fp32 (Triton ``upcast_acc_dtype``, C++ acc
                                      type; split reductions keep fp32 partials); output stays
                                      fp16/bf16 - an fp16 output that overflows is the precision
                                      pass's job (it keeps the result in fp32 downstream)
cumsum (lowering)                     Triton scan upcasts its combine to fp32; CPU falls back
                                      to ATen, which accumulates in float
====================================  ============================================================

Entries enn adds (why, and what they cost):

==================  ====================================================  ==========================
op                  why                                                   cost
==================  ====================================================  ==========================
logsumexp           ``torch._refs.logsumexp`` computes exp/sum/log in     none when fused (the casts
                    the input dtype: each intermediate Inductor           happen in registers); an
                    materializes (e.g. a reduction it does not fuse)      unfused intermediate is
                    is rounded to fp16/bf16. The entry also leaves the    stored in fp32 (per-row
                    fp32 result visible as ``convert(lse32)``, which      sized, so small)
                    the precision pass hands to the backward
                    (``exp(x - lse)`` with a bf16 ``lse`` of 1e5 is off
                    by e^256).
nll_loss_forward    the reference gathers and sums/means the picked       none: one fp32 gather and
                    log-probabilities in the input dtype; with a bf16     a per-batch sum
                    mean over a batch each partial is rounded. In fp32
                    the loss is rounded once (this is cross-entropy's
                    reduction; its log_softmax is already fp32).
==================  ====================================================  ==========================

Backward: the backward of these ops is built by autograd from the rounded forward
output, *above* the decompositions, so no decomposition can fix it. The precision pass
(``enn_backend.passes.precision``) does, by handing the fp32 result to the backward; the
``enn::softmax`` / ``enn::rms_norm`` ops save fp32 statistics for theirs.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .. import compat

aten = torch.ops.aten
LOW_PRECISION = (torch.float16, torch.bfloat16)

_INDUCTOR = compat.select_decomp_table()


def _fallback(op: Any) -> Callable[..., Any]:
    """Inductor's entry for ``op`` (or the op itself when Inductor lowers it directly)."""
    return _INDUCTOR.get(op, op)


def _up(t: Any) -> Any:
    return t.to(torch.float32) if isinstance(t, torch.Tensor) and t.dtype in LOW_PRECISION else t


def _logsumexp(self: torch.Tensor, dim: Any, keepdim: bool = False) -> torch.Tensor:
    inner = _fallback(aten.logsumexp.default)
    if self.dtype not in LOW_PRECISION:
        return inner(self, dim, keepdim)
    return inner(_up(self), dim, keepdim).to(self.dtype)


def _nll_loss_forward(self: torch.Tensor, target: torch.Tensor, weight: Any, reduction: int,
                      ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    inner = _fallback(aten.nll_loss_forward.default)
    if self.dtype not in LOW_PRECISION:
        return inner(self, target, weight, reduction, ignore_index)
    out, total = inner(_up(self), target, _up(weight), reduction, ignore_index)
    return out.to(self.dtype), total.to(self.dtype)


ENTRIES: dict[Any, Callable[..., Any]] = {
    aten.logsumexp.default: _logsumexp,
    aten.nll_loss_forward.default: _nll_loss_forward,
}
