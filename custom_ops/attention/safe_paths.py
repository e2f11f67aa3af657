"""The safe paths of the attention ops and of the SDPA kernels the attention pass emits: what a
pinned node (and the guard's eager re-run) runs instead."""

from __future__ import annotations

import torch

from ..pinned import register_safe_path
from .kernels import FWD, explicit_bwd, explicit_fwd
from .masks import full_bias, math_dtype, normalize_mask, saturated_counts
from .op import attention, attention_backward, default_scale

# ----------------------------------------------------------------------------- safe paths
# What a pinned enn::attention node (and the guard's eager re-run) runs: enn's explicit fp32
# math, whatever kernel the policy chose. The outputs keep the chosen backend's layout (a
# recompute backend saves an empty lse), so the graphs around the node are unchanged.
@register_safe_path("enn.attention.default")
def _attention_safe(q, k, v, bias, mask, alibi, scale, causal, window, dropout_p, masked_rows, backend, seed=None):
    out, lse = attention(q, k, v, bias, mask, alibi, scale, causal, window, dropout_p, masked_rows, "explicit", seed)
    if backend not in FWD:
        lse = q.new_empty((0,), dtype=torch.float32)
    return out, lse


@register_safe_path("enn.attention_backward.default")
def _attention_backward_safe(grad_out, q, k, v, bias, mask, alibi, out, lse, scale, causal, window, masked_rows,
                             backend, bias_grad, dropout_p=0.0, seed=None):
    if lse.numel() == 0:  # saved by a recompute backend: rebuild it with the explicit forward
        m, c = normalize_mask(q, k, mask, causal, window)
        lse = explicit_fwd(q, k, v, bias, m, alibi, scale, c, window)[1]
    return attention_backward(grad_out, q, k, v, bias, mask, alibi, out, lse, scale, causal, window, masked_rows,
                              "explicit", bias_grad, dropout_p, seed)


# ----------------------------------------------------------------------------- safe paths of emitted kernels
# Where no row can be fully masked the attention pass emits SDPA's ATen kernels themselves
# (enn_backend/passes/attention/kernels/sdpa.py). The guard's eager reference and a pinned node then run
# these instead: enn's explicit math (fp32; fp64 for fp64 inputs), laid out exactly as the kernel lays out its outputs
# (sizes, strides, dtypes from the op's meta function), so the compiled code around a pinned
# node, and a backward graph fed by a pinned forward, see the kernel's metadata.
# The CUDA forward kernels have safe paths too: the math gives the output and its log-sum-exp,
# the rest (RNG seeds, flash / cuDNN's sequence bookkeeping) is laid out as the kernel's meta
# function says and is not read without dropout. Flash and cuDNN return SymInts, so a pinned op
# cannot run them; the guard's fp64 run calls them directly (graph_edit.on_safe_paths): CUDA's
# kernels have no fp64 version. With dropout, the kernel itself runs (only it can draw its mask).
aten = torch.ops.aten


def _kernel_layout(op, args, kwargs, values):
    """``values`` copied into tensors with the metadata ``op`` gives its outputs for ``args``.
    A log-sum-exp fills the leading part of the kernel's (memory-efficient pads Tq to a multiple
    of 32 with +inf, as its kernel does; cuDNN adds a trailing 1). Outputs past ``values`` (RNG
    seeds, flash / cuDNN's sequence bookkeeping, read only with dropout) are zeros, or the meta
    function's value if not tensors."""
    to_meta = lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x  # noqa: E731
    metas = op(*[to_meta(a) for a in args], **{k: to_meta(v) for k, v in kwargs.items()})
    metas = metas if isinstance(metas, (tuple, list)) else (metas,)
    device = values[0].device
    out = []
    for i, m in enumerate(metas):
        val = values[i] if i < len(values) else None
        if not isinstance(m, torch.Tensor) or (val is None and i < len(values)):
            out.append(val if i < len(values) else m)
            continue
        t = torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device)
        if val is None:
            t.zero_()
        elif val.shape == m.shape:
            t.copy_(val)
        else:
            t.fill_(float("inf")).view(*val.shape[:-1], -1)[..., :val.shape[-1]].copy_(val)
        out.append(t)
    return tuple(out)


def _mask_args(attn_mask):
    """An SDPA ``attn_mask`` as enn's (bias, mask): float masks add, boolean masks keep."""
    if attn_mask is None:
        return None, None
    return (None, attn_mask) if attn_mask.dtype == torch.bool else (attn_mask, None)


def _scale(q, scale):
    return default_scale(q.shape[-1]) if scale is None else scale


def _kernel_drew(op, args, kwargs, dropout_p):
    """With dropout the kernel's backward redraws its mask from the philox seed / offset its
    forward saved; no other code can: the reference is the kernel itself (None: no dropout)."""
    return op(*args, **kwargs) if dropout_p else None


def _math_grads(g, q, k, v, attn_mask, is_causal, scale):
    """The kernel's gradients by enn's math: eager's, times the count of a saturated row (the
    kernel's own factor there, see saturated_counts), so a pinned backward node computes what
    the kernel computes."""
    bias, mask = _mask_args(attn_mask)
    fb = full_bias(q, k, bias, mask, None, is_causal, 0)
    if fb is not None:
        g = (g.to(math_dtype(g)) * saturated_counts(fb)).to(g.dtype)
    s = _scale(q, scale)
    out, lse = explicit_fwd(q, k, v, bias, mask, None, s, is_causal, 0)
    return explicit_bwd(g, q, k, v, bias, mask, None, out, lse, s, is_causal, 0)


def _math_forward(op, args, kwargs, attn_mask, dropout_p, is_causal, scale):
    """A CUDA SDPA forward kernel's results by enn's math, in the kernel's layout."""
    drew = _kernel_drew(op, args, kwargs, dropout_p)
    if drew is not None:
        return drew
    q, k, v = args[:3]
    bias, mask = _mask_args(attn_mask)
    out, lse = explicit_fwd(q, k, v, bias, mask, None, _scale(q, scale), is_causal, 0)
    return _kernel_layout(op, args, kwargs, (out, lse))


@register_safe_path("aten._scaled_dot_product_efficient_attention.default")
def _efficient_safe(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    return _math_forward(aten._scaled_dot_product_efficient_attention.default,
                         (q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal), {"scale": scale},
                         attn_bias, dropout_p, is_causal, scale)


@register_safe_path("aten._scaled_dot_product_flash_attention.default")
def _flash_safe(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    return _math_forward(aten._scaled_dot_product_flash_attention.default,
                         (q, k, v, dropout_p, is_causal, return_debug_mask), {"scale": scale},
                         None, dropout_p, is_causal, scale)


@register_safe_path("aten._scaled_dot_product_cudnn_attention.default")
def _cudnn_safe(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                scale=None):
    return _math_forward(aten._scaled_dot_product_cudnn_attention.default,
                         (q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask),
                         {"scale": scale}, attn_bias, dropout_p, is_causal, scale)


@register_safe_path("aten._scaled_dot_product_flash_attention_for_cpu.default")
def _cpu_flash_safe(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    bias, mask = _mask_args(attn_mask)
    out, lse = explicit_fwd(q, k, v, bias, mask, None, _scale(q, scale), is_causal, 0)
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
    op = aten._scaled_dot_product_flash_attention_backward.default
    drew = _kernel_drew(op, (g, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset),
                        {"scale": scale}, dropout_p)
    if drew is not None:
        return drew
    dq, dk, dv, _ = _math_grads(g, q, k, v, None, is_causal, scale)
    return _kernel_layout(aten._scaled_dot_product_flash_attention_backward.default,
                          (g, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset),
                          {"scale": scale}, (dq, dk, dv))


@register_safe_path("aten._scaled_dot_product_cudnn_attention_backward.default")
def _cudnn_backward_safe(g, q, k, v, out, lse, seed, offset, attn_bias, cum_q, cum_k, max_q, max_k, dropout_p,
                         is_causal, *, scale=None):
    op = aten._scaled_dot_product_cudnn_attention_backward.default
    drew = _kernel_drew(op, (g, q, k, v, out, lse, seed, offset, attn_bias, cum_q, cum_k, max_q, max_k, dropout_p,
                             is_causal), {"scale": scale}, dropout_p)
    if drew is not None:
        return drew
    dq, dk, dv, _ = _math_grads(g, q, k, v, attn_bias, is_causal, scale)
    return _kernel_layout(aten._scaled_dot_product_cudnn_attention_backward.default,
                          (g, q, k, v, out, lse, seed, offset, attn_bias, cum_q, cum_k, max_q, max_k, dropout_p,
                           is_causal), {"scale": scale}, (dq, dk, dv))


@register_safe_path("aten._scaled_dot_product_efficient_attention_backward.default")
def _efficient_backward_safe(g, q, k, v, attn_bias, out, lse, seed, offset, dropout_p, grad_input_mask,
                             is_causal=False, *, scale=None):
    op = aten._scaled_dot_product_efficient_attention_backward.default
    drew = _kernel_drew(op, (g, q, k, v, attn_bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal),
                        {"scale": scale}, dropout_p)
    if drew is not None:
        return drew
    dq, dk, dv, db = _math_grads(g, q, k, v, attn_bias, is_causal, scale)
    dbias = db if (grad_input_mask[3] and attn_bias is not None) else None
    return _kernel_layout(aten._scaled_dot_product_efficient_attention_backward.default,
                          (g, q, k, v, attn_bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal),
                          {"scale": scale}, (dq, dk, dv, dbias))
