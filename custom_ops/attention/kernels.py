"""The forward and backward of each ``enn::attention`` backend: enn's explicit fp32 math, ATen's
CPU flash kernel, SDPA on CUDA with one backend forced, FlexAttention; the CUDA backends'
backward recomputes their forward."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .backends import Backend
from .masks import band_mask_mod, float_bias, keep_all, kernel_bias, math_dtype

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
    dt = math_dtype(q)
    s = torch.matmul(q.to(dt), kk.to(dt).transpose(-2, -1)) * scale
    fb = float_bias(q, k, bias, alibi)
    if fb is not None:
        s = s + fb
    keep = keep_all(q, k, mask, causal, window)
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


def explicit_fwd(q, k, v, bias, mask, alibi, scale, causal, window, dropout=None):
    """``dropout``: each probability's dropout factor (masks.dropout_scale), or None."""
    p, lse = _probs(_scores(q, k, bias, mask, alibi, scale, causal, window))
    pd = p if dropout is None else p * dropout
    out = torch.matmul(pd, _repeat_kv(v, q.shape[1]).to(pd.dtype)).to(q.dtype)
    return out, lse


def explicit_bwd(g, q, k, v, bias, mask, alibi, out, lse, scale, causal, window, dropout=None):
    hkv = k.shape[1]
    p, _ = _probs(_scores(q, k, bias, mask, alibi, scale, causal, window))  # dead rows: 0
    dt = math_dtype(q)
    vv = _repeat_kv(v, q.shape[1]).to(dt)
    kk = _repeat_kv(k, q.shape[1]).to(dt)
    gf = g.to(dt)
    dv = torch.matmul((p if dropout is None else p * dropout).transpose(-2, -1), gf)
    dp = torch.matmul(gf, vv.transpose(-2, -1))
    if dropout is not None:  # the gradient of P through P * dropout
        dp = dp * dropout
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq = torch.matmul(ds, kk) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q.to(dt)) * scale
    dbias = _bias_grad(ds, bias) if bias is not None else None
    return dq.to(q.dtype), _fold_kv(dk, hkv).to(k.dtype), _fold_kv(dv, hkv).to(v.dtype), dbias


# ----------------------------------------------------------------------------- CPU flash (ATen)
def _cpu_flash_mask(q, k, bias, mask, alibi, causal, window):
    """The additive mask ATen's CPU flash kernel takes, plus whether is_causal can stay on."""
    use_causal = causal and window <= 0 and mask is None
    keep = None if use_causal else keep_all(q, k, mask, causal, window)
    fb = float_bias(q, k, bias, alibi)
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
        keep = keep_all(q, k, mask, causal, window)
        fb = float_bias(q, k, bias, alibi)
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


def recompute_fwd(q, k, v, bias, mask, alibi, scale, causal, window, backend):
    if backend == Backend.FLEX:
        out = _flex_call(q, k, v, bias, mask, alibi, scale, causal, window)
    else:
        out = _sdpa_call(q, k, v, bias, mask, alibi, scale, causal, window, backend)
    return out, q.new_empty((0,), dtype=torch.float32)


def recompute_bwd(g, q, k, v, bias, mask, alibi, out, lse, scale, causal, window, backend):
    """Gradients by recomputing the forward under ``torch.func.vjp``.

    A custom op's kernel runs below the autograd dispatch key, where ``torch.enable_grad()``
    records nothing (``torch.autograd.grad`` would see an output without grad_fn); functorch's
    vjp brings its own autograd layer, so it works here.
    """
    with_bias = bias is not None and bias.is_floating_point()

    def f(qq, kk, vv, bb):
        return recompute_fwd(qq, kk, vv, bb if with_bias else bias, mask, alibi, scale, causal, window, backend)[0]

    _, pullback = torch.func.vjp(f, q, k, v, bias if with_bias else q.new_zeros(()))
    dq, dk, dv, db = pullback(g.to(out.dtype))
    return dq, dk, dv, (db if with_bias else None)


# Backends enn runs in Python with their log-sum-exp; the others recompute (recompute_fwd / _bwd).
FWD = {Backend.EXPLICIT: explicit_fwd, Backend.CPU_FLASH: _cpu_flash_fwd}
BWD = {Backend.EXPLICIT: explicit_bwd, Backend.CPU_FLASH: _cpu_flash_bwd}
