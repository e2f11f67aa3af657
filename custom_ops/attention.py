"""``enn::attention`` and ``enn::attention_backward``: fused attention with what the pattern recognized.

``enn::attention(q, k, v, bias, mask, alibi, scale, causal, window, dropout_p, masked_rows, backend)``
returns ``(out, lse)``:

- ``q`` ``[B, Hq, Tq, D]``, ``k`` ``[B, Hkv, Tk, D]``, ``v`` ``[B, Hkv, Tk, Dv]``; ``Hq`` a multiple of
  ``Hkv`` (grouped-query attention: query head ``h`` reads key/value head ``h // (Hq // Hkv)``).
- ``bias``: optional additive float mask/bias, broadcastable to ``[B, Hq, Tq, Tk]``.
- ``mask``: optional boolean keep-mask (True = attend), broadcastable to ``[B, Hq, Tq, Tk]``.
- ``alibi``: optional per-head slopes ``[Hq]``; adds ``slopes[h] * (j - i)`` to the scores.
- ``causal``: key ``j`` is kept for query ``i`` only if ``j <= i`` (top-left aligned, like SDPA).
- ``window``: if > 0, also only keys with ``i - j < window`` (a sliding-window band).
- ``dropout_p``: must be 0.0 (enn does not fuse attention with dropout yet; see the pass).
- ``masked_rows``: ``"eager"`` gives NaN for a query row whose keys are all masked (what the
  hand-written ``softmax(masked_fill(-inf))`` gives in eager), ``"zero"`` gives 0 there.
- ``backend``: the kernel the policy chose (enn_backend/passes/attention/policy.py), one of
  :class:`Backend`: ``explicit`` (enn's own fp32 math), ``cpu_flash`` (ATen's CPU flash kernel),
  ``flash`` / ``efficient`` / ``cudnn`` / ``math`` (SDPA on CUDA with that backend forced), ``flex``
  (FlexAttention, compiled).

``lse`` is the log-sum-exp of each query row in fp32 ``[B, Hq, Tq]`` where the backend gives it
(``explicit``, ``cpu_flash``), else an empty tensor; the backward uses it to avoid a recompute.
The CUDA backends recompute the forward inside the backward (one extra forward pass): it is
correct by construction on every torch version, at the cost of that recompute.
"""

from __future__ import annotations

import collections
import enum
import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F

from .pinned import register_safe_path



class Backend(str, enum.Enum):
    """Every attention kernel enn knows, by the name options, reports and ``enn::attention`` use."""

    EXPLICIT = "explicit"  # enn's own fp32 math: any device, dtype and mask
    CPU_FLASH = "cpu_flash"  # ATen's CPU flash kernel
    FLASH = "flash"  # SDPA on CUDA, this backend forced
    EFFICIENT = "efficient"  # SDPA memory-efficient
    CUDNN = "cudnn"  # SDPA cuDNN
    MATH = "math"  # SDPA math
    FLEX = "flex"  # FlexAttention, compiled
    INDUCTOR = "inductor"  # not a kernel: the attention stays as written and Inductor compiles it

    def __str__(self) -> str:
        return self.value


BACKENDS = tuple(b.value for b in Backend if b is not Backend.INDUCTOR)  # what enn::attention runs
MASKED_ROWS = ("eager", "zero")


# ----------------------------------------------------------------------------- helpers
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
_MASK_CACHE: "collections.OrderedDict[tuple, tuple[torch.Tensor, str]]" = collections.OrderedDict()
_MASK_CACHE_SIZE = 16


def _square_mask_structure(mask: torch.Tensor, t: int) -> str:
    """'causal', 'all' (keeps every key) or 'other' for a bool [.., t, t] mask of leading 1-dims."""
    key = (mask.device, mask.data_ptr(), tuple(mask.shape), mask.stride(), mask._version)
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


def _keep_all(q, k, mask, causal, window) -> Optional[torch.Tensor]:
    """Every reason a key is dropped, as one broadcastable boolean keep-mask (or None)."""
    keep = structural_keep(q.shape[-2], k.shape[-2], causal, window, q.device)
    if mask is not None:
        keep = mask if keep is None else (mask & keep)
    return keep


def _float_bias(q, k, bias, alibi) -> Optional[torch.Tensor]:
    out = None
    if alibi is not None:
        out = alibi_bias(alibi, q.shape[-2], k.shape[-2], torch.float32)
    if bias is not None:
        out = bias.float() if out is None else out + bias.float()
    return out


def dead_rows(q, k, bias, mask, causal, window) -> Optional[torch.Tensor]:
    """Bool [B|1, H|1, Tq, 1]: rows whose every key is masked (None if that cannot happen)."""
    if mask is None and (bias is None or not bias.is_floating_point()):
        return None  # causal / window keep key 0..i (or i) for every row: never empty
    keep = _keep_all(q, k, mask, causal, window)
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
# in bf16 and fp32 on every shape tried (bench/gpu_saturated_rows.py,
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
    fb = _float_bias(q, k, bias if bias is not None and bias.is_floating_point() else None, alibi)
    if fb is None:
        return None
    keep = _keep_all(q, k, mask, causal, window)
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


# Backends whose backward recomputes P from the saved log-sum-exp (see saturated_counts).
LSE_BACKWARD = frozenset({Backend.CPU_FLASH, Backend.FLASH, Backend.EFFICIENT, Backend.CUDNN, Backend.FLEX})


def _repeat_kv(x: torch.Tensor, hq: int) -> torch.Tensor:
    if x.shape[1] == hq:
        return x
    return x.repeat_interleave(hq // x.shape[1], dim=1)


def _fold_kv(g: torch.Tensor, hkv: int) -> torch.Tensor:
    """Sum the gradient of repeated key/value heads back onto their ``hkv`` heads."""
    b, hq = g.shape[0], g.shape[1]
    if hq == hkv:
        return g
    return g.view(b, hkv, hq // hkv, *g.shape[2:]).sum(dim=2)


def _fix_rows(out: torch.Tensor, dead: Optional[torch.Tensor], masked_rows: str) -> torch.Tensor:
    if dead is None:
        return out
    fill = 0.0 if masked_rows == "zero" else float("nan")
    return torch.where(dead, torch.full((), fill, dtype=out.dtype, device=out.device), out)


def _bias_grad(dscores: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Reduce a [B, H, Tq, Tk] gradient to ``bias``'s broadcast shape."""
    g = dscores
    while g.dim() > bias.dim():
        g = g.sum(0)
    dims = [d for d in range(g.dim()) if bias.shape[d] == 1 and g.shape[d] != 1]
    if dims:
        g = g.sum(dim=dims, keepdim=True)
    return g.to(bias.dtype)


# ----------------------------------------------------------------------------- explicit math
def _scores(q, k, bias, mask, alibi, scale, causal, window) -> torch.Tensor:
    kk = _repeat_kv(k, q.shape[1])
    s = torch.matmul(q.float(), kk.float().transpose(-2, -1)) * scale
    fb = _float_bias(q, k, bias, alibi)
    if fb is not None:
        s = s + fb
    keep = _keep_all(q, k, mask, causal, window)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _probs(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax over keys, log-sum-exp) computed as eager's softmax computes it: ``exp(s - max) /
    sum``. Not ``exp(s - lse)``: in a saturated row (see :func:`saturated_counts`) lse rounds to
    the row's bias and that would give every key probability 1. Rows whose keys are all -inf
    (dead rows) get probability 0 and lse -inf."""
    top = s.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(s - top)
    total = e.sum(-1, keepdim=True)
    p = e / torch.where(total > 0, total, torch.ones_like(total))
    return p, (top + torch.log(total)).squeeze(-1)


def _explicit_fwd(q, k, v, bias, mask, alibi, scale, causal, window):
    p, lse = _probs(_scores(q, k, bias, mask, alibi, scale, causal, window))
    out = torch.matmul(p, _repeat_kv(v, q.shape[1]).float()).to(q.dtype)
    return out, lse


def _explicit_bwd(g, q, k, v, bias, mask, alibi, out, lse, scale, causal, window):
    hkv = k.shape[1]
    p, _ = _probs(_scores(q, k, bias, mask, alibi, scale, causal, window))  # dead rows: 0
    vv = _repeat_kv(v, q.shape[1]).float()
    kk = _repeat_kv(k, q.shape[1]).float()
    gf = g.float()
    dv = torch.matmul(p.transpose(-2, -1), gf)
    dp = torch.matmul(gf, vv.transpose(-2, -1))
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq = torch.matmul(ds, kk) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q.float()) * scale
    dbias = _bias_grad(ds, bias) if bias is not None else None
    return dq.to(q.dtype), _fold_kv(dk, hkv).to(k.dtype), _fold_kv(dv, hkv).to(v.dtype), dbias


# ----------------------------------------------------------------------------- CPU flash (ATen)
def _cpu_flash_mask(q, k, bias, mask, alibi, causal, window):
    """The additive mask ATen's CPU flash kernel takes, plus whether is_causal can stay on."""
    use_causal = causal and window <= 0 and mask is None
    keep = None if use_causal else _keep_all(q, k, mask, causal, window)
    fb = _float_bias(q, k, bias, alibi)
    if keep is None and fb is None:
        return None, use_causal
    m = fb if fb is not None else torch.zeros((), dtype=torch.float32, device=q.device)
    if keep is not None:
        m = m.masked_fill(~keep, float("-inf"))
    while m.dim() < 4:  # the kernel takes 2-D or 4-D masks
        m = m.unsqueeze(0)
    return kernel_bias(m, q.dtype), use_causal


def _cpu_flash_fwd(q, k, v, bias, mask, alibi, scale, causal, window):
    m, is_causal = _cpu_flash_mask(q, k, bias, mask, alibi, causal, window)
    kk, vv = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
        q, kk, vv, 0.0, is_causal, attn_mask=m, scale=scale)
    return out, lse.float()


def _cpu_flash_bwd(g, q, k, v, bias, mask, alibi, out, lse, scale, causal, window):
    m, is_causal = _cpu_flash_mask(q, k, bias, mask, alibi, causal, window)
    hkv = k.shape[1]
    kk, vv = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # dead rows: P = exp(-inf) = 0
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        g.contiguous(), q, kk, vv, out, lse, 0.0, is_causal, attn_mask=m, scale=scale)
    return dq, _fold_kv(dk, hkv), _fold_kv(dv, hkv), None


# ----------------------------------------------------------------------------- CUDA SDPA / flex
def _sdpa_call(q, k, v, bias, mask, alibi, scale, causal, window, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kinds = {Backend.FLASH: SDPBackend.FLASH_ATTENTION, Backend.EFFICIENT: SDPBackend.EFFICIENT_ATTENTION,
             Backend.CUDNN: SDPBackend.CUDNN_ATTENTION, Backend.MATH: SDPBackend.MATH}
    is_causal = causal and window <= 0 and mask is None and bias is None and alibi is None
    attn_mask = None
    if not is_causal:
        keep = _keep_all(q, k, mask, causal, window)
        fb = _float_bias(q, k, bias, alibi)
        if fb is not None:
            attn_mask = kernel_bias(fb if keep is None else fb.masked_fill(~keep, float("-inf")), q.dtype)
        else:
            attn_mask = keep
    gqa = q.shape[1] != k.shape[1]
    with sdpa_kernel([kinds[backend]]):
        if gqa:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                                  scale=scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=64)
def _block_mask(causal: bool, window: int, tq: int, tk: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(band_mask_mod(causal, window), None, None, tq, tk, device=device)


def _flex_call(q, k, v, bias, mask, alibi, scale, causal, window):
    if mask is not None or bias is not None:
        raise ValueError("enn::attention: flex backend takes causal/window/ALiBi structure only")
    block_mask = _block_mask(causal, window, q.shape[-2], k.shape[-2], str(q.device)) if (causal or window > 0) else None
    score_mod = None
    if alibi is not None:
        slopes = alibi.float()

        def score_mod(score, b, h, qi, kj):
            return score + slopes[h] * (kj - qi)

    return _compiled_flex()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                            enable_gqa=q.shape[1] != k.shape[1])


def _recompute_fwd(q, k, v, bias, mask, alibi, scale, causal, window, backend):
    if backend == Backend.FLEX:
        out = _flex_call(q, k, v, bias, mask, alibi, scale, causal, window)
    else:
        out = _sdpa_call(q, k, v, bias, mask, alibi, scale, causal, window, backend)
    return out, q.new_empty((0,), dtype=torch.float32)


def _recompute_bwd(g, q, k, v, bias, mask, alibi, out, lse, scale, causal, window, backend):
    """Gradients by recomputing the forward under ``torch.func.vjp``.

    A custom op's kernel runs below the autograd dispatch key, where ``torch.enable_grad()``
    records nothing (``torch.autograd.grad`` would see an output without grad_fn); functorch's
    vjp brings its own autograd layer, so it works here.
    """
    with_bias = bias is not None and bias.is_floating_point()

    def f(qq, kk, vv, bb):
        return _recompute_fwd(qq, kk, vv, bb if with_bias else bias, mask, alibi, scale, causal, window, backend)[0]

    _, pullback = torch.func.vjp(f, q, k, v, bias if with_bias else q.new_zeros(()))
    dq, dk, dv, db = pullback(g.to(out.dtype))
    return dq, dk, dv, (db if with_bias else None)


# ----------------------------------------------------------------------------- dispatch
_FWD = {Backend.EXPLICIT: _explicit_fwd, Backend.CPU_FLASH: _cpu_flash_fwd}
_BWD = {Backend.EXPLICIT: _explicit_bwd, Backend.CPU_FLASH: _cpu_flash_bwd}


def _check(q, k, v, backend, masked_rows, dropout_p):
    if backend not in BACKENDS:
        raise ValueError(f"enn::attention: unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if masked_rows not in MASKED_ROWS:
        raise ValueError(f"enn::attention: masked_rows must be one of {MASKED_ROWS}, got {masked_rows!r}")
    if dropout_p != 0.0:
        raise ValueError("enn::attention: dropout_p must be 0.0 (attention with dropout is not fused by enn)")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[1] % k.shape[1]:
        raise ValueError(f"enn::attention: want 4-D q/k/v with Hq % Hkv == 0, got {tuple(q.shape)}, {tuple(k.shape)}")


@torch.library.custom_op("enn::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
              mask: Optional[torch.Tensor], alibi: Optional[torch.Tensor], scale: float, causal: bool,
              window: int, dropout_p: float, masked_rows: str, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ · scale + bias + alibi, masked) v on the chosen backend; returns (out, lse)."""
    _check(q, k, v, backend, masked_rows, dropout_p)
    mask, causal = normalize_mask(q, k, mask, causal, window)
    fwd = _FWD.get(backend)
    if fwd is not None:
        out, lse = fwd(q, k, v, bias, mask, alibi, scale, causal, window)
    else:
        out, lse = _recompute_fwd(q, k, v, bias, mask, alibi, scale, causal, window, backend)
    out = _fix_rows(out, dead_rows(q, k, bias, mask, causal, window), masked_rows)
    return out.contiguous(), lse.contiguous()


@attention.register_fake
def _attention_fake(q, k, v, bias, mask, alibi, scale, causal, window, dropout_p, masked_rows, backend):
    b, hq, tq, _ = q.shape
    out = q.new_empty((b, hq, tq, v.shape[-1]))
    if backend in _FWD:
        return out, q.new_empty((b, hq, tq), dtype=torch.float32)
    return out, q.new_empty((0,), dtype=torch.float32)


@torch.library.custom_op("enn::attention_backward", mutates_args=())
def attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       bias: Optional[torch.Tensor], mask: Optional[torch.Tensor], alibi: Optional[torch.Tensor],
                       out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool, window: int,
                       masked_rows: str, backend: str, bias_grad: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv, dbias) of :func:`attention`; dbias is empty unless ``bias_grad``.

    Rows whose keys are all masked: with ``masked_rows="eager"`` the forward gave NaN there and
    eager autograd gives NaN for the whole ``dv`` of that (batch, kv-head) while those rows add
    nothing to ``dq`` / ``dk``; enn reproduces exactly that. With ``"zero"`` they add nothing.
    """
    mask, causal = normalize_mask(q, k, mask, causal, window)
    dead = dead_rows(q, k, bias, mask, causal, window)
    g = grad_out if dead is None else grad_out.masked_fill(dead, 0.0)
    fb = full_bias(q, k, bias, mask, alibi, causal, window) if backend in LSE_BACKWARD and bias is not None else None
    if fb is not None:
        g = (g.float() / saturated_counts(fb)).to(g.dtype)
    if dead is not None:
        out = out.masked_fill(dead, 0.0)  # the forward's NaN fix-up must not leak into the kernels
    if backend in _BWD and not (bias_grad and backend == Backend.CPU_FLASH):
        dq, dk, dv, db = _BWD[backend](g, q, k, v, bias, mask, alibi, out, lse, scale, causal, window)
        if bias_grad and db is None:  # pragma: no cover - cpu_flash with bias grad is routed to explicit
            raise RuntimeError("enn::attention_backward: backend gave no bias gradient")
    elif backend in _BWD:
        dq, dk, dv, db = _explicit_bwd(g, q, k, v, bias, mask, alibi, out,
                                       _explicit_fwd(q, k, v, bias, mask, alibi, scale, causal, window)[1],
                                       scale, causal, window)
    else:
        dq, dk, dv, db = _recompute_bwd(g, q, k, v, bias, mask, alibi, out, lse, scale, causal, window, backend)
    if dead is not None and masked_rows == "eager":
        hkv = k.shape[1]
        bad = dead.expand(q.shape[0], q.shape[1], *dead.shape[2:]).flatten(2).any(-1)  # [B, Hq]
        bad = bad.view(q.shape[0], hkv, -1).any(-1).view(q.shape[0], hkv, 1, 1)
        dv = dv.masked_fill(bad, float("nan"))
    if bias_grad and bias is not None:
        dbias = (db if db is not None else torch.zeros_like(bias)).to(bias.dtype).contiguous()
    else:
        dbias = q.new_empty((0,))
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dbias


@attention_backward.register_fake
def _attention_backward_fake(grad_out, q, k, v, bias, mask, alibi, out, lse, scale, causal, window,
                             masked_rows, backend, bias_grad):
    dbias = torch.empty_like(bias, memory_format=torch.contiguous_format) if (bias_grad and bias is not None) else q.new_empty((0,))
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format), dbias)


def _setup_context(ctx, inputs, output):
    q, k, v, bias, mask, alibi, scale, causal, window, dropout_p, masked_rows, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, bias, mask, alibi, out, lse)
    ctx.args = (scale, causal, window, masked_rows, backend)
    ctx.bias_grad = bias is not None and bias.is_floating_point() and bias.requires_grad


def _backward(ctx, grad_out, grad_lse):
    q, k, v, bias, mask, alibi, out, lse = ctx.saved_tensors
    scale, causal, window, masked_rows, backend = ctx.args
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, dbias = attention_backward(grad_out, q, k, v, bias, mask, alibi, out, lse, scale, causal,
                                           window, masked_rows, backend, ctx.bias_grad)
    return dq, dk, dv, (dbias if ctx.bias_grad else None), None, None, None, None, None, None, None, None


attention.register_autograd(_backward, setup_context=_setup_context)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def OPCHECK_SAMPLES() -> dict:
    """Samples for tests/test_opcheck.py: both ops, fp32 and bf16, optional tensors present and
    absent, grouped-query K/V, and inputs that require grad (the op has an autograd formula)."""
    g = torch.Generator().manual_seed(0)

    def t(*shape, dtype=torch.float32, grad=False):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad)

    b, h, hkv, tt, d = 2, 4, 2, 6, 8
    keep = torch.rand(b, 1, 1, tt, generator=g) > 0.3
    slopes = torch.rand(h, generator=g)
    fwd = []
    for dtype in (torch.float32, torch.bfloat16):
        for backend in ("explicit", "cpu_flash"):
            grad = dtype == torch.float32
            q, k, v = t(b, h, tt, d, dtype=dtype, grad=grad), t(b, hkv, tt, d, dtype=dtype, grad=grad), t(b, hkv, tt, d, dtype=dtype, grad=grad)
            fwd.append(((q, k, v, None, None, None, 0.35, True, 0, 0.0, "eager", backend), {}))
            fwd.append(((q, k, v, t(1, h, tt, tt, dtype=dtype, grad=grad), keep, None, 0.35, False, 0, 0.0, "zero", backend), {}))
            fwd.append(((q, k, v, None, None, slopes, 0.35, True, 3, 0.0, "eager", backend), {}))
    q, k, v = t(b, h, tt, d), t(b, hkv, tt, d), t(b, hkv, tt, d)
    bias = t(1, h, tt, tt)
    out, lse = attention(q, k, v, bias, keep, None, 0.35, False, 0, 0.0, "eager", "explicit")
    bwd = [((t(b, h, tt, d), q, k, v, bias, keep, None, out, lse, 0.35, False, 0, "eager", "explicit", True), {}),
           ((t(b, h, tt, d), q, k, v, None, None, None, out, lse, 0.35, True, 0, "eager", "cpu_flash", False), {})]
    return {"enn::attention": fwd, "enn::attention_backward": bwd}


# ----------------------------------------------------------------------------- safe paths
# What a pinned enn::attention node (and the guard's eager re-run) runs: enn's explicit fp32
# math, whatever kernel the policy chose. The outputs keep the chosen backend's layout (a
# recompute backend saves an empty lse), so the graphs around the node are unchanged.
@register_safe_path("enn.attention.default")
def _attention_safe(q, k, v, bias, mask, alibi, scale, causal, window, dropout_p, masked_rows, backend):
    out, lse = attention(q, k, v, bias, mask, alibi, scale, causal, window, dropout_p, masked_rows, "explicit")
    if backend not in _FWD:
        lse = q.new_empty((0,), dtype=torch.float32)
    return out, lse


@register_safe_path("enn.attention_backward.default")
def _attention_backward_safe(grad_out, q, k, v, bias, mask, alibi, out, lse, scale, causal, window, masked_rows,
                             backend, bias_grad):
    if lse.numel() == 0:  # saved by a recompute backend: rebuild it with the explicit forward
        m, c = normalize_mask(q, k, mask, causal, window)
        lse = _explicit_fwd(q, k, v, bias, m, alibi, scale, c, window)[1]
    return attention_backward(grad_out, q, k, v, bias, mask, alibi, out, lse, scale, causal, window, masked_rows,
                              "explicit", bias_grad)


# ----------------------------------------------------------------------------- safe paths of emitted kernels
# Where no row can be fully masked the attention pass emits SDPA's ATen kernels themselves
# (enn_backend/passes/attention/kernels/sdpa.py). The guard's eager reference and a pinned node then run
# these instead: enn's explicit fp32 math, laid out exactly as the kernel lays out its outputs
# (sizes, strides, dtypes from the op's meta function), so the compiled code around a pinned
# node, and a backward graph fed by a pinned forward, see the kernel's metadata.
# Not covered: the CUDA forward kernels (flash / cuDNN return SymInt outputs a pinned op cannot
# return, and their RNG outputs have no device-independent layout): for those the reference is
# the kernel itself.
aten = torch.ops.aten


def _kernel_layout(op, args, kwargs, values):
    """``values`` copied into tensors with the metadata ``op`` gives its outputs for ``args``."""
    to_meta = lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x  # noqa: E731
    metas = op(*[to_meta(a) for a in args], **{k: to_meta(v) for k, v in kwargs.items()})
    metas = metas if isinstance(metas, (tuple, list)) else (metas,)
    out = []
    for m, val in zip(metas, values):
        if val is None or not isinstance(m, torch.Tensor):
            out.append(val)
            continue
        t = torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=val.device)
        t.copy_(val)
        out.append(t)
    return tuple(out)


def _mask_args(attn_mask):
    """An SDPA ``attn_mask`` as enn's (bias, mask): float masks add, boolean masks keep."""
    if attn_mask is None:
        return None, None
    return (None, attn_mask) if attn_mask.dtype == torch.bool else (attn_mask, None)


def _scale(q, scale):
    return default_scale(q.shape[-1]) if scale is None else scale


def _math_grads(g, q, k, v, attn_mask, is_causal, scale):
    """The kernel's gradients by enn's math: eager's, times the count of a saturated row (the
    kernel's own factor there, see saturated_counts), so a pinned backward node computes what
    the kernel computes."""
    bias, mask = _mask_args(attn_mask)
    fb = full_bias(q, k, bias, mask, None, is_causal, 0)
    if fb is not None:
        g = (g.float() * saturated_counts(fb)).to(g.dtype)
    s = _scale(q, scale)
    out, lse = _explicit_fwd(q, k, v, bias, mask, None, s, is_causal, 0)
    return _explicit_bwd(g, q, k, v, bias, mask, None, out, lse, s, is_causal, 0)


@register_safe_path("aten._scaled_dot_product_flash_attention_for_cpu.default")
def _cpu_flash_safe(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    bias, mask = _mask_args(attn_mask)
    out, lse = _explicit_fwd(q, k, v, bias, mask, None, _scale(q, scale), is_causal, 0)
    lse = lse.masked_fill(torch.isneginf(lse), 0.0)  # a row with every key masked: the kernel saves 0
    return _kernel_layout(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v, dropout_p, is_causal),
                          {"attn_mask": attn_mask, "scale": scale}, (out, lse))


@register_safe_path("aten._scaled_dot_product_flash_attention_for_cpu_backward.default")
def _cpu_flash_backward_safe(g, q, k, v, out, lse, dropout_p, is_causal, *, attn_mask=None, scale=None):
    dq, dk, dv, _ = _math_grads(g, q, k, v, attn_mask, is_causal, scale)
    return _kernel_layout(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                          (g, q, k, v, out, lse, dropout_p, is_causal), {"attn_mask": attn_mask, "scale": scale},
                          (dq, dk, dv))


@register_safe_path("aten._scaled_dot_product_flash_attention_backward.default")
def _flash_backward_safe(g, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *,
                         scale=None):
    dq, dk, dv, _ = _math_grads(g, q, k, v, None, is_causal, scale)
    return _kernel_layout(aten._scaled_dot_product_flash_attention_backward.default,
                          (g, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset),
                          {"scale": scale}, (dq, dk, dv))


@register_safe_path("aten._scaled_dot_product_cudnn_attention_backward.default")
def _cudnn_backward_safe(g, q, k, v, out, lse, seed, offset, attn_bias, cum_q, cum_k, max_q, max_k, dropout_p,
                         is_causal, *, scale=None):
    dq, dk, dv, _ = _math_grads(g, q, k, v, attn_bias, is_causal, scale)
    return _kernel_layout(aten._scaled_dot_product_cudnn_attention_backward.default,
                          (g, q, k, v, out, lse, seed, offset, attn_bias, cum_q, cum_k, max_q, max_k, dropout_p,
                           is_causal), {"scale": scale}, (dq, dk, dv))


@register_safe_path("aten._scaled_dot_product_efficient_attention_backward.default")
def _efficient_backward_safe(g, q, k, v, attn_bias, out, lse, seed, offset, dropout_p, grad_input_mask,
                             is_causal=False, *, scale=None):
    dq, dk, dv, db = _math_grads(g, q, k, v, attn_bias, is_causal, scale)
    dbias = db if (grad_input_mask[3] and attn_bias is not None) else None
    return _kernel_layout(aten._scaled_dot_product_efficient_attention_backward.default,
                          (g, q, k, v, attn_bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal),
                          {"scale": scale}, (dq, dk, dv, dbias))
