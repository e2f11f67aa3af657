"""The masks and biases every attention kernel shares: structural keep-masks (causal, window),
ALiBi, the keep-mask and float bias of an ``enn::attention`` call, dead rows (every key masked)
and saturated rows (every key at ``finfo.min``)."""

from __future__ import annotations

import collections
import threading
from typing import Optional

import torch

def _positions(tq: int, tk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    i = torch.arange(tq, device=device).view(tq, 1)
    j = torch.arange(tk, device=device).view(1, tk)
    return i, j


def band_mask_mod(causal: bool, window: int):
    """FlexAttention's ``mask_mod`` of the causal / sliding-window band: key ``kv_idx`` is kept for
    query ``q_idx`` when ``kv_idx <= q_idx`` (causal) and ``q_idx - kv_idx < window`` (window > 0)."""

    def keep(b, h, q_idx, kv_idx):
        ok = q_idx >= kv_idx if causal else q_idx >= 0
        if window > 0:
            ok = ok & (q_idx - kv_idx < window)
        return ok

    return keep


def structural_keep(tq: int, tk: int, causal: bool, window: int, device: torch.device) -> Optional[torch.Tensor]:
    """The [Tq, Tk] keep-mask of the causal / window structure, or None if there is none."""
    if not causal and window <= 0:
        return None
    i, j = _positions(tq, tk, device)
    return band_mask_mod(causal, window)(None, None, i, j)


def alibi_bias(slopes: torch.Tensor, tq: int, tk: int, dtype: torch.dtype) -> torch.Tensor:
    i, j = _positions(tq, tk, slopes.device)
    return (slopes.float().view(-1, 1, 1) * (j - i).float()).to(dtype)


# Masks a model keeps as a buffer (nanoGPT's `tril` buffer) reach enn::attention as
# tensors. Checked once, a buffer that IS causal runs as `is_causal` (no T x T mask read,
# half the work skipped). The cache holds the checked tensor itself, so its memory cannot
# be reused by another tensor while cached, and keys on its version counter, which every
# in-place write bumps: a changed mask is checked again.
# Process-wide, read and written by every thread that runs the op: under _MASK_LOCK.
_MASK_CACHE: "collections.OrderedDict[tuple, tuple[torch.Tensor, str]]" = collections.OrderedDict()
_MASK_CACHE_SIZE = 16
_MASK_LOCK = threading.Lock()


def _square_mask_structure(mask: torch.Tensor, t: int) -> str:
    """'causal', 'all' (keeps every key) or 'other' for a bool [.., t, t] mask of leading 1-dims."""
    key = (mask.device, mask.data_ptr(), tuple(mask.shape), mask.stride(), mask._version)
    with _MASK_LOCK:
        hit = _MASK_CACHE.get(key)
        if hit is not None:
            _MASK_CACHE.move_to_end(key)
            return hit[1]
    m2 = mask.reshape(t, t)
    if bool(m2.all()):
        kind = "all"
    elif torch.equal(m2, torch.ones(t, t, dtype=torch.bool, device=mask.device).tril()):
        kind = "causal"
    else:
        kind = "other"
    with _MASK_LOCK:
        _MASK_CACHE[key] = (mask, kind)
        if len(_MASK_CACHE) > _MASK_CACHE_SIZE:
            _MASK_CACHE.popitem(last=False)
    return kind


def normalize_mask(q, k, mask, causal, window):
    """(mask, causal): a runtime bool mask that is exactly causal (or keeps everything) is
    replaced by the causal flag (or dropped), so the fast kernels need no mask tensor."""
    tq, tk = q.shape[-2], k.shape[-2]
    if (mask is None or mask.dtype != torch.bool or causal or window > 0 or tq != tk
            or mask.shape[-2:] != (tq, tk) or any(d != 1 for d in mask.shape[:-2])):
        return mask, causal
    kind = _square_mask_structure(mask, tq)
    if kind == "causal":
        return None, True
    if kind == "all":
        return None, causal
    return mask, causal


def keep_all(q, k, mask, causal, window) -> Optional[torch.Tensor]:
    """Every reason a key is dropped, as one broadcastable boolean keep-mask (or None)."""
    keep = structural_keep(q.shape[-2], k.shape[-2], causal, window, q.device)
    if mask is not None:
        keep = mask if keep is None else (mask & keep)
    return keep


def math_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype enn's attention math computes in for ``t``: fp32, or fp64 for fp64 tensors (the
    guard's fp64 reference runs the same math)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def float_bias(q, k, bias, alibi) -> Optional[torch.Tensor]:
    out, dt = None, math_dtype(q)
    if alibi is not None:
        out = alibi_bias(alibi, q.shape[-2], k.shape[-2], dt)
    if bias is not None:
        out = bias.to(dt) if out is None else out + bias.to(dt)
    return out


def dead_rows(q, k, bias, mask, causal, window) -> Optional[torch.Tensor]:
    """Bool [B|1, H|1, Tq, 1]: rows whose every key is masked (None if that cannot happen)."""
    if mask is None and (bias is None or not bias.is_floating_point()):
        return None  # causal / window keep key 0..i (or i) for every row: never empty
    keep = keep_all(q, k, mask, causal, window)
    if bias is not None:
        finite = bias > float("-inf")
        keep = finite if keep is None else (keep & finite)
    while keep.dim() < 4:
        keep = keep.unsqueeze(0)
    keep = keep.expand(*keep.shape[:-2], q.shape[-2], k.shape[-2])
    return ~keep.any(dim=-1, keepdim=True)


# A bias at or below this absorbs every score: in fp32 (and bf16), s + b == b for |s| < 1e22.
SATURATED = -1e30

# What a kernel receives in place of every finite bias at or below SATURATED (bf16 / fp32
# kernels). HF's fp32 ``finfo.min`` cannot go as is: the CUDA memory-efficient kernel treats a
# saturated row as fully masked (log-sum-exp 0, output not uniform, no gradient; most likely
# its log2(e) scaling overflows to -inf), and -1e30 in bf16 gives NaN gradients from it.
# This power of two gives eager's uniform row and, with saturated_counts, eager's gradients,
# in bf16 and fp32 on every shape tried (tests/test_attention_op.py::test_efficient_kernel_on_saturated_rows,
# bench/results/gpu-h100/saturated_rows.log). fp16 cannot hold it (nor any bias that absorbs
# the scores): there the policy keeps such biases off the kernels.
SATURATED_FLOOR = -(2.0 ** 100)


def floors_saturated(dtype: torch.dtype) -> bool:
    """Whether kernels in ``dtype`` receive SATURATED_FLOOR for saturating biases (bf16, fp32)."""
    return torch.finfo(dtype).min < SATURATED_FLOOR


def kernel_bias(fb: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask a fused kernel receives, in ``dtype``, for the fp32 full bias ``fb``.

    -inf stays -inf (a dropped key). In bf16 / fp32 every other value at or below
    :data:`SATURATED` becomes :data:`SATURATED_FLOOR`; in fp16 finite values are clamped to its
    range. A row whose largest bias is at or below SATURATED is therefore uniform over *all*
    its keys at or below SATURATED; eager is uniform over the keys at exactly its largest value.
    The two agree for masks with one fill value (``finfo.min``, as every HF model writes them).
    """
    info = torch.finfo(dtype)
    if floors_saturated(dtype):
        floor = (fb <= SATURATED) & (fb > float("-inf"))
        fb = torch.where(floor, torch.full((), SATURATED_FLOOR, dtype=fb.dtype, device=fb.device), fb)
        return fb.clamp(max=info.max).to(dtype)
    return torch.where(torch.isfinite(fb), fb.clamp(info.min, info.max), fb).to(dtype)


def full_bias(q, k, bias, mask, alibi, causal, window) -> Optional[torch.Tensor]:
    """Everything added to the scores as one fp32 tensor (-inf where a key is dropped), or None
    when there is no float bias (then every kept key adds 0 and no row can saturate)."""
    fb = float_bias(q, k, bias if bias is not None and bias.is_floating_point() else None, alibi)
    if fb is None:
        return None
    keep = keep_all(q, k, mask, causal, window)
    return fb if keep is None else fb.masked_fill(~keep, float("-inf"))


def saturated_counts(fb: torch.Tensor) -> torch.Tensor:
    """Per query row of the full bias ``fb`` (``[.., Tq, 1]``): when the row's largest bias is
    at or below :data:`SATURATED`, how many of its keys are (finite and) at or below it -- the
    keys :func:`kernel_bias` gives one value --, else 1.

    Such a row -- HF's ``finfo.min`` mask on a query whose keys are all padding (left-padded
    batches) -- has its scores absorbed by the bias, so eager's softmax is uniform over those
    keys. Kernels that save the row's log-sum-exp and recompute ``P = exp(x - lse)`` in their
    backward (CPU flash, SDPA flash / cuDNN / memory-efficient, flex) find ``lse`` equal to the
    bias (``log(count)`` is far below its ulp) and ``P = 1`` on those keys: their gradients are
    ``count`` times eager's. The backward is linear in the row's incoming gradient, so dividing it
    by ``count`` gives eager's gradients; the safe paths that stand in for such a kernel multiply
    by it, as the kernel does. Dead rows (every key -inf) count 1: they are handled apart.
    """
    top = fb.amax(-1, keepdim=True)
    low = (fb <= SATURATED) & (fb > float("-inf"))
    count = low.sum(-1, keepdim=True, dtype=torch.float32)
    saturated = (top <= SATURATED) & (top > float("-inf"))
    return torch.where(saturated, count, torch.ones_like(count))


def dropout_scale(q: torch.Tensor, k: torch.Tensor, dropout_p: float, seed: Optional[torch.Tensor]
                  ) -> Optional[torch.Tensor]:
    """The dropout factor of each probability, ``(u > p) / (1 - p)`` in fp32 ``[B, Hq, Tq, Tk]``,
    with ``u`` uniform from a generator seeded by ``seed`` (an int64 scalar): the forward and
    the backward draw the same mask from it. None without dropout."""
    if dropout_p == 0.0:
        return None
    gen = torch.Generator(device=q.device)
    gen.manual_seed(int(seed))
    u = torch.rand((q.shape[0], q.shape[1], q.shape[2], k.shape[2]), generator=gen, device=q.device)
    return (u > dropout_p).float() / (1.0 - dropout_p)
