"""``enn::attention`` and the helpers its kernels share (custom_ops/attention/): opcheck, the
reference math, saturated rows, the kernel bias, runtime mask structure, and the safe paths the
guard runs for the SDPA ops the pass emits. CPU, tiny shapes (one CUDA kernel check)."""

from __future__ import annotations

import pytest
import torch

import enn_backend.custom_ops  # noqa: F401  (registers the enn ops)
from enn_backend.custom_ops import attention as A
from enn_backend.custom_ops.pinned import SAFE_PATHS

B, H, T, D = 2, 4, 8, 8


def qkv(hkv=H, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, D, generator=g), torch.randn(B, hkv, T, D, generator=g), torch.randn(B, hkv, T, D, generator=g)


def test_opcheck():
    q, k, v = (t.requires_grad_() for t in qkv(hkv=2))
    bias = torch.randn(1, H, T, T, requires_grad=True)
    mask = torch.rand(B, 1, 1, T, generator=torch.Generator().manual_seed(0)) > 0.3
    mask[..., ::2] = True  # every 3-key window keeps a key: no all-masked (NaN) row, which opcheck cannot compare
    for backend in ("explicit", "cpu_flash"):
        for b, m, causal, window in ((None, None, True, 0), (bias, None, False, 0), (None, mask, False, 3)):
            torch.library.opcheck(torch.ops.enn.attention.default,
                                  (q, k, v, b, m, None, 0.3, causal, window, 0.0, "eager", backend))


def test_op_alibi_and_window_match_reference():
    q, k, v = qkv()
    slopes = torch.rand(H)
    out, _ = torch.ops.enn.attention(q, k, v, None, None, slopes, 0.25, True, 3, 0.0, "eager", "cpu_flash")
    i, j = torch.arange(T).view(T, 1), torch.arange(T).view(1, T)
    s = q @ k.transpose(-1, -2) * 0.25 + slopes.view(H, 1, 1) * (j - i)
    s = s.masked_fill(~((j <= i) & (i - j < 3)), float("-inf"))
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v, atol=1e-5, rtol=1e-5)


def test_op_rejects_unknown_backends():
    q, k, v = qkv()
    for bad in ("inductor", "fast"):  # "inductor" names the policy's "leave it unfused", not a kernel
        with pytest.raises(ValueError, match="unknown backend"):
            torch.ops.enn.attention(q, k, v, None, None, None, 0.25, True, 0, 0.0, "eager", bad)


def test_band_mask_mod_is_the_structural_keep_mask():
    i, j = torch.arange(6).view(6, 1), torch.arange(6).view(1, 6)
    for causal, window in ((True, 0), (True, 2), (False, 3)):
        want = torch.ones(6, 6, dtype=torch.bool)
        if causal:
            want &= j <= i
        if window:
            want &= i - j < window
        assert torch.equal(A.structural_keep(6, 6, causal, window, torch.device("cpu")), want)
        assert torch.equal(A.band_mask_mod(causal, window)(0, 0, i, j).expand(6, 6), want)
    assert A.structural_keep(6, 6, False, 0, torch.device("cpu")) is None


def test_saturated_counts():
    fb = torch.tensor([[0.0, -3e38, 0.0], [-3e38, -3e38, -3e38], [-3e38, -3e38, float("-inf")],
                       [float("-inf")] * 3, [-1.0, -2e30, -5.0], [-3e38, -2e30, -3e38]])
    # the last row: every key is at or below SATURATED, which kernel_bias gives one value
    assert A.saturated_counts(fb).flatten().tolist() == [1.0, 3.0, 2.0, 1.0, 1.0, 3.0]


def test_kernel_bias_floors_saturating_values():
    """What a kernel receives: -inf stays, values at or below SATURATED become SATURATED_FLOOR
    (bf16 / fp32), fp16 clamps to its range; ordinary values pass unchanged."""
    fb = torch.tensor([0.0, -5.0, -2e30, torch.finfo(torch.float32).min, float("-inf")])
    for dtype in (torch.float32, torch.bfloat16):
        got = A.kernel_bias(fb, dtype)
        assert got.dtype == dtype
        assert got.float().tolist() == [0.0, -5.0, A.SATURATED_FLOOR, A.SATURATED_FLOOR, float("-inf")]
    half = A.kernel_bias(fb, torch.float16).float().tolist()
    assert half == [0.0, -5.0, -65504.0, -65504.0, float("-inf")]


def test_runtime_causal_buffer_becomes_is_causal_and_a_changed_buffer_is_rechecked():
    q = torch.randn(1, 2, 8, 4)
    buf = torch.ones(8, 8, dtype=torch.bool).tril().view(1, 1, 8, 8)
    assert A.normalize_mask(q, q, buf, False, 0) == (None, True)
    assert A.normalize_mask(q, q, buf, False, 0) == (None, True)  # cached
    buf[0, 0, 0, 5] = True  # an in-place write bumps the version: checked again
    mask, causal = A.normalize_mask(q, q, buf, False, 0)
    assert mask is buf and causal is False
    pad = torch.ones(1, 1, 1, 8, dtype=torch.bool)
    assert A.normalize_mask(q, q, pad, False, 0)[0] is pad  # not a square structural mask: untouched


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("with_bias", [False, True])
def test_emitted_kernel_safe_paths_match_the_kernel(causal, with_bias):
    """What the guard runs for an emitted CPU flash node (its eager reference, or a pinned node):
    enn's fp32 math, with the kernel's values and output strides, forward and backward."""
    aten = torch.ops.aten
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8).transpose(1, 2).contiguous().transpose(1, 2) for _ in range(3))
    kw = {"attn_mask": torch.randn(2, 1, 1, 16)} if with_bias else {}
    fwd, bwd = aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    want = fwd(q, k, v, 0.0, causal, scale=0.3, **kw)
    got = SAFE_PATHS["aten._scaled_dot_product_flash_attention_for_cpu.default"](q, k, v, 0.0, causal, scale=0.3, **kw)
    g = torch.randn_like(want[0])
    want_b = bwd(g, q, k, v, want[0], want[1], 0.0, causal, scale=0.3, **kw)
    got_b = SAFE_PATHS["aten._scaled_dot_product_flash_attention_for_cpu_backward.default"](
        g, q, k, v, want[0], want[1], 0.0, causal, scale=0.3, **kw)
    for a, b in zip(list(got) + list(got_b), list(want) + list(want_b)):
        assert a.stride() == b.stride()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rng", [0, 1, 2])
@pytest.mark.parametrize("shape", [(2, 4, 64, 64, 20), (2, 2, 128, 64, 100), (2, 2, 256, 128, 3)],
                         ids=lambda s: "B{}H{}T{}D{}pad{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_efficient_kernel_on_saturated_rows(dtype, shape, rng):
    """On a row whose every key is at finfo.min eager's softmax is uniform. SDPA's
    memory-efficient kernel given finfo.min is not (it overflows to -inf and reads the row as
    fully masked); given kernel_bias's SATURATED_FLOOR it is, and its backward with the
    incoming gradient divided by saturated_counts gives eager's gradients. If a torch update
    changes either, this fails. The shapes: batch 1 left-padded by ``pad``, a few saturated rows
    or most. The H100's sweep over floors (finfo.min wrong; -1e30 NaN gradients in bf16; -2**100
    down to -1e20 right, bf16 errors <= 1.9e-2): bench/results/gpu-h100/saturated_rows.log."""
    torch.manual_seed(rng)
    b, h, t, d, pad = shape
    q, k, v, g = (torch.randn(b, h, t, d, device="cuda", dtype=dtype) for _ in range(4))
    keep = torch.ones(b, 1, t, t, dtype=torch.bool, device="cuda").tril()
    keep[1, :, :, :pad] = False  # batch 1 is left-padded: its first rows see only padding
    bias = torch.zeros(b, 1, t, t, device="cuda").masked_fill(~keep, torch.finfo(torch.float32).min)
    qq, kk, vv = (x.float().requires_grad_() for x in (q, k, v))
    want = torch.softmax(qq @ kk.transpose(-1, -2) * d ** -0.5 + bias, -1) @ vv
    want_grads = torch.autograd.grad(want, (qq, kk, vv), g.float())
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention
    raw = efficient(q, k, v, bias.clamp_min(torch.finfo(dtype).min).to(dtype).expand(b, h, t, t), False, 0.0,
                    False, scale=d ** -0.5)[0]
    assert (raw[1, :, :pad].float() - want[1, :, :pad]).abs().max() > 1e-2  # finfo.min: wrong rows

    kb = A.kernel_bias(bias, dtype).expand(b, h, t, t)
    out, lse, seed, offset = efficient(q, k, v, kb, True, 0.0, False, scale=d ** -0.5)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.float(), want, **tol)
    gg = (g.float() / A.saturated_counts(kb.float())).to(dtype)
    grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        gg, q, k, v, kb, out, lse, seed, offset, 0.0, [True, True, True, False], False, scale=d ** -0.5)[:3]
    for got, w in zip(grads, want_grads):
        torch.testing.assert_close(got.float(), w, **tol)
