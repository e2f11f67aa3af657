"""How SDPA's CUDA kernels treat a *saturated* row: every key of a query at ``finfo.min``
(HF's padding mask on a left-padded query). Eager's softmax is uniform there. Prints, per
kernel and dtype, the largest error of the forward and of dq / dk / dv against eager (fp32
math on the same inputs), split into saturated and ordinary rows, with the incoming gradient
as is and divided by the key count (enn's fix-up, custom_ops.attention.saturated_counts).

Run:  python bench/gpu_saturated_rows.py
"""

from __future__ import annotations

import torch

from enn_backend.custom_ops import attention as A

aten = torch.ops.aten


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    torch.manual_seed(0)
    b, h, t, d, pad = 2, 4, 64, 64, 20
    print(f"{'kernel':<10} {'dtype':<9} {'g':<8} {'out sat':>9} {'out rest':>9} {'dq sat':>9} {'dk':>9} {'dv':>9}")
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=dtype) for _ in range(3))
        keep = torch.ones(b, 1, t, t, dtype=torch.bool, device="cuda").tril()
        keep[1, :, :, :pad] = False  # batch 1 left-padded: its first `pad` query rows see only padding
        bias = torch.zeros(b, 1, t, t, device="cuda").masked_fill(~keep, torch.finfo(torch.float32).min)
        kbias = bias.clamp_min(torch.finfo(dtype).min).to(dtype).expand(b, h, t, t)
        g = torch.randn(b, h, t, d, device="cuda", dtype=dtype)
        qq, kk, vv = (x.float().requires_grad_() for x in (q, k, v))
        want = torch.softmax(qq @ kk.transpose(-1, -2) * d ** -0.5 + bias, -1) @ vv
        wq, wk, wv = torch.autograd.grad(want, (qq, kk, vv), g.float())
        counts = A.saturated_counts(A.full_bias(q, k, kbias, None, None, False, 0))
        sat = torch.zeros(b, 1, t, 1, dtype=torch.bool, device="cuda")
        sat[1, :, :pad] = True
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, kbias, True, 0.0, False,
                                                                              scale=d ** -0.5)
        err = (out.float() - want).abs()
        for scaled in (False, True):
            gg = (g.float() / counts).to(dtype) if scaled else g
            dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                gg, q, k, v, kbias, out, lse, seed, offset, 0.0, [True, True, True, False], False, scale=d ** -0.5)
            e = [(x.float() - w).abs() for x, w in zip((dq, dk, dv), (wq, wk, wv))]
            print(f"{'efficient':<10} {str(dtype)[6:]:<9} {'/count' if scaled else 'as is':<8} "
                  f"{err.masked_select(sat).max().item():9.2e} {err.masked_select(~sat).max().item():9.2e} "
                  f"{e[0].masked_select(sat).max().item():9.2e} {e[1].max().item():9.2e} {e[2].max().item():9.2e}")
        print("  lse on saturated rows:", lse[1, 0, :3].tolist(), " counts:", counts[1, 0, :3, 0].tolist())


if __name__ == "__main__":
    main()
