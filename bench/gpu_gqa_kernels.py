"""Grouped-query K/V straight into SDPA's ATen kernels: which of cuDNN, flash and memory-efficient
take K/V with fewer heads than Q (forward and backward), whether their results equal the same
kernel on HF's ``repeat_kv`` copy, and what the copy costs.

    python bench/gpu_gqa_kernels.py [--b 2] [--hq 16] [--hkv 4] [--t 2048] [--d 128] [--out DIR]

Per kernel, causal, bf16: ``takes GQA`` (the call on un-repeated K/V ran and gave [B, Hkv, T, D]
gradients), the largest difference from the repeated call (output, dq, and dk/dv summed over each
group), and fwd+bwd time on repeated K/V (repeat included) and on the un-repeated K/V.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

aten = torch.ops.aten
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    """transformers' repeat_kv: expand a new head axis, then reshape (a copy)."""
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, rep, t, d).reshape(b, h * rep, t, d)


def fwd_bwd(kernel: str, q, k, v, g, gqa: bool):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    kk, vv = (k, v) if gqa else (repeat_kv(k, rep), repeat_kv(v, rep))
    with sdpa_kernel([BACKENDS[kernel]]):
        out = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
    out.backward(g)
    return out, q.grad, k.grad, v.grad


def aten_direct(kernel: str, q, k, v, g):
    """The private ATen op enn emits, called on un-repeated K/V (bypasses SDPA's own checks)."""
    if kernel == "flash":
        out, lse, cq, ck, mq, mk, seed, off, _ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(g, q, k, v, out, lse, cq, ck, mq, mk, 0.0,
                                                                       True, seed, off)
    elif kernel == "cudnn":
        out, lse, cq, ck, mq, mk, seed, off, _ = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True)
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(g, q, k, v, out, lse, seed, off, None, cq, ck,
                                                                       mq, mk, 0.0, True)
    else:
        out, lse, seed, off = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(g, q, k, v, None, out, lse, seed, off,
                                                                              0.0, [True, True, True, False], True)
    return out, dq, dk, dv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("b", 2), ("hq", 16), ("hkv", 4), ("t", 2048), ("d", 128)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(a.b, a.hq, a.t, a.d, device=dev, dtype=dt)
    k, v = (torch.randn(a.b, a.hkv, a.t, a.d, device=dev, dtype=dt) for _ in range(2))
    g = torch.randn_like(q)
    rows = []
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, B{a.b} Hq{a.hq} Hkv{a.hkv} T{a.t} D{a.d} "
          "bf16 causal, fwd+bwd")
    print(f"{'kernel':10} {'path':10} {'takes GQA':10} {'max diff':>10} {'repeated ms':>12} {'gqa ms':>8}")
    for kernel in BACKENDS:
        ref = fwd_bwd(kernel, q, k, v, g, gqa=False)
        t_rep = do_bench(lambda: fwd_bwd(kernel, q, k, v, g, gqa=False), warmup=10, rep=100)
        for path in ("sdpa", "aten"):
            row = dict(kernel=kernel, path=path, takes_gqa=False, max_diff=None, repeated_ms=t_rep, gqa_ms=None)
            try:
                if path == "sdpa":
                    got = fwd_bwd(kernel, q, k, v, g, gqa=True)
                    fn = lambda: fwd_bwd(kernel, q, k, v, g, gqa=True)  # noqa: E731
                else:
                    got = aten_direct(kernel, q, k, v, g)
                    fn = lambda: aten_direct(kernel, q, k, v, g)  # noqa: E731
                torch.cuda.synchronize()
                ok_shapes = got[2].shape == k.shape and got[3].shape == v.shape
                row["takes_gqa"] = ok_shapes
                row["max_diff"] = max((x.float() - y.float()).abs().max().item() for x, y in zip(got, ref))
                row["gqa_ms"] = do_bench(fn, warmup=10, rep=100)
            except Exception as e:  # noqa: BLE001 -- the probe records what the kernel refuses
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
            print(f"{kernel:10} {path:10} {str(row['takes_gqa']):10} "
                  f"{row['max_diff'] if row['max_diff'] is not None else '-':>10} {t_rep:12.3f} "
                  f"{row['gqa_ms'] if row['gqa_ms'] is not None else float('nan'):8.3f} {row.get('error', '')}")
    with open(os.path.join(a.out, "gqa_kernels.json"), "w") as f:
        json.dump(dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(), shape=vars(a), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
