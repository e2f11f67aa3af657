"""How SDPA's CUDA memory-efficient kernel treats a *saturated* row: every key of a query at a
huge negative bias (HF's ``finfo.min`` padding mask on a left-padded query). Eager's softmax is
uniform there: the bias absorbs the scores.

The bias handed to the kernel is first clamped at a *floor* (the kernel dtype's ``finfo.min``,
or a smaller magnitude that still absorbs every score). Prints, per dtype and floor, the largest
error over several shapes and seeds of the forward and of dq / dk / dv against eager (fp32 math
on the same inputs), saturated and ordinary rows apart. The incoming gradient is divided by the
row's key count (enn's fix-up, custom_ops.attention.saturated_counts) where the row saturates.

Run:  python bench/gpu_saturated_rows.py
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

FLOORS = ("finfo", "-1e30", "-2**100", "-2**80", "-1e24", "-1e20")
# (batch, heads, T, head dim, left padding of batch 1)
SHAPES = ((2, 4, 64, 64, 20), (2, 2, 128, 64, 100), (2, 2, 256, 128, 3))


def _case(dtype, floor, shape, seed):
    """Max errors (out sat, out rest, dq sat, dk, dv) of one kernel call and its backward."""
    b, h, t, d, pad = shape
    g0 = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, g = (torch.randn(b, h, t, d, device="cuda", dtype=dtype, generator=g0) for _ in range(4))
    keep = torch.ones(b, 1, t, t, dtype=torch.bool, device="cuda").tril()
    keep[1, :, :, :pad] = False  # batch 1 left-padded: its first `pad` query rows see only padding
    bias = torch.zeros(b, 1, t, t, device="cuda").masked_fill(~keep, torch.finfo(torch.float32).min)
    qq, kk, vv = (x.float().requires_grad_() for x in (q, k, v))
    want = torch.softmax(qq @ kk.transpose(-1, -2) * d ** -0.5 + bias, -1) @ vv
    wgrads = torch.autograd.grad(want, (qq, kk, vv), g.float())
    kbias = bias.clamp_min(floor).to(dtype).expand(b, h, t, t)
    fb = kbias.float()
    top = fb.amax(-1, keepdim=True)
    counts = torch.where(top <= -1e15, (fb == top).sum(-1, keepdim=True, dtype=torch.float32), 1.0)
    sat = torch.zeros(b, 1, t, 1, dtype=torch.bool, device="cuda")
    sat[1, :, :pad] = True
    out, lse, seed_, offset = aten._scaled_dot_product_efficient_attention(q, k, v, kbias, True, 0.0, False,
                                                                           scale=d ** -0.5)
    err = (out.float() - want).abs()
    gg = (g.float() / counts).to(dtype)
    grads = aten._scaled_dot_product_efficient_attention_backward(
        gg, q, k, v, kbias, out, lse, seed_, offset, 0.0, [True, True, True, False], False, scale=d ** -0.5)[:3]
    e = [(x.float() - w).abs() for x, w in zip(grads, wgrads)]
    return [err.masked_select(sat).max().item(), err.masked_select(~sat).max().item(),
            e[0].masked_select(sat).max().item(), e[1].max().item(), e[2].max().item()]


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    cols = ("out sat", "out rest", "dq sat", "dk", "dv")
    print(f"{'dtype':<9} {'floor':<8} " + " ".join(f"{c:>9}" for c in cols) + "  (max over shapes x 3 seeds)")
    for dtype in (torch.bfloat16, torch.float32):
        for name in FLOORS:
            floor = torch.finfo(dtype).min if name == "finfo" else float(eval(name))  # noqa: S307 (a literal)
            worst = [0.0] * len(cols)
            for shape in SHAPES:
                for seed in range(3):
                    worst = [max(w, x) if x == x and w == w else float("nan")
                             for w, x in zip(worst, _case(dtype, floor, shape, seed))]
            print(f"{str(dtype)[6:]:<9} {name:<8} " + " ".join(f"{x:9.2e}" for x in worst))


if __name__ == "__main__":
    main()
