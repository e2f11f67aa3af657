"""Stress cases where fp16/bf16 overflow or lose accuracy: enn vs eager vs Inductor vs fp64.

Each case prints what eager, ``backend="inductor"`` and ``backend="enn"`` give (relative
error vs the fp64 reference on the same rounded inputs, forward and backward; inf = non-finite)
and asserts that enn's result is finite and within tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from enn_backend.custom_ops import precision as P


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a = a.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _ce(x, t):
    return F.cross_entropy(x, t)


CASES = {
    # name: (fn, make input, dtype, extra args, forward tol, backward tol or None)
    "softmax_large_logits": (lambda x: P.softmax(x, -1), lambda: torch.randn(64, 256) * 50, torch.bfloat16, 1e-2, 3e-3),
    "layer_norm_large_activations": (lambda x: F.layer_norm(x, (1024,)), lambda: torch.randn(16, 1024) * 500 + 2000,
                                     torch.float16, 2e-3, 2e-3),
    "fp16_sum_100k_ones": (lambda x: x.sum() * 1e-3, lambda: torch.ones(100_000), torch.float16, 1e-3, 1e-3),
    "logsumexp_large": (lambda x: torch.logsumexp(x, -1), lambda: torch.randn(16, 1024) * 10 + 1e5, torch.bfloat16, 1e-3, 1e-2),
    "cross_entropy_32k": (_ce, lambda: torch.randn(8, 32768) * 4, torch.bfloat16, 4e-3, 1e-2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_stress(name):
    fn, mk, dtype, ftol, btol = CASES[name]
    torch.manual_seed(0)
    x0 = mk().to(dtype)
    extra = (torch.randint(0, x0.shape[-1], (x0.shape[0],)),) if name.startswith("cross") else ()
    xr = x0.double().requires_grad_()
    ref_fn = (lambda x: torch.softmax(x, -1)) if name.startswith("softmax") else fn
    ref = ref_fn(xr, *extra)
    g = torch.randn_like(ref)
    ref.backward(g)
    res = {}
    for be in ("eager", "inductor", "enn"):
        torch._dynamo.reset()
        f = ref_fn if be == "eager" else torch.compile(ref_fn if be == "inductor" else fn, backend=be, dynamic=False)
        x = x0.clone().requires_grad_()
        y = f(x, *extra)
        y.backward(g.to(y.dtype))
        res[be] = (rel(y, ref), rel(x.grad, xr.grad))
    print(f"\n{name} ({str(dtype).removeprefix('torch.')}): " + ", ".join(
        f"{k} fwd {v[0]:.3g} bwd {v[1]:.3g}" for k, v in res.items()))
    fwd, bwd = res["enn"]
    assert fwd < ftol, (name, res)
    assert bwd < btol, (name, res)
