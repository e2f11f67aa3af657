"""Which attention patterns enn fuses on CUDA, and why not: prints the report per case."""
import sys

import torch

import enn_backend

sys.path.insert(0, "bench")
import gpu_attention as G  # noqa: E402

for T in (1024,):
    q, k, v = (torch.randn(4, 16, T, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    slopes = torch.tensor([2 ** (-8 * (h + 1) / 16) for h in range(16)], device="cuda", dtype=torch.bfloat16)
    for name, fn, extra in (("causal", G.causal, ()), ("alibi", G.alibi, (slopes,))):
        enn_backend.reset()
        torch._dynamo.reset()
        with torch.no_grad():
            out = torch.compile(fn, backend="enn")(q, k, v, *extra)
            ref = fn(q, k, v, *extra)
        print(name, T, "max diff", (out.float() - ref.float()).abs().max().item())
        print(enn_backend.report())
