"""HF LLaMA eager (the tiny config of tests/test_hf_masks.py), left padding or none, bf16 autocast,
one training step on CUDA: enn's logits and every parameter gradient against eager bf16 and an fp32
run of the same model (no autocast), per attention kernel order (cuDNN, memory-efficient). Prints
the largest absolute differences; enn is as exact as eager when enn-fp32 is about eager-fp32.

    python bench/gpu_key_padding_accuracy.py     (bench/results/gpu-h100/key_padding_accuracy.log)
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import test_hf_masks as T
from pass_harness import run_passes
torch.manual_seed(0)
def grads(model, ids, mask, fn):
    model.zero_grad(set_to_none=True)
    out = fn(ids, mask); g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    out.backward(g)
    return out.detach().float(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
for order in ["cudnn,explicit", "efficient,explicit"]:
    for padded in (True, False):
        os.environ["ENN_ATTENTION_ORDER"] = order
        import enn_backend; enn_backend.reset(); torch._dynamo.reset()
        base = T._model("llama", "eager").cuda()
        model = T._AutocastLogits(base)
        seq = 24
        mask = torch.ones(T.B, seq, dtype=torch.long, device="cuda")
        if padded: mask[1, :T.PADDED] = 0
        ids = torch.randint(3, 128, (T.B, seq), device="cuda").masked_fill(mask == 0, 0)
        comp = torch.compile(model, backend="enn")
        o_c, g_c = grads(base, ids, mask, comp)
        o_e, g_e = grads(base, ids, mask, model)
        o_r, g_r = grads(base, ids, mask, lambda i, m: base(input_ids=i, attention_mask=m).logits.float())  # fp32 reference
        rep = enn_backend.report().to_dict()
        ch = [c["choice"] for g in rep["graphs"] for c in g.get("kernel_choices", []) if "causal" in c]
        worst = lambda a, b: max((a[k] - b[k]).abs().max().item() for k in a)
        print(f"{order:20s} padded={padded} choices={ch} logits enn-eager {(o_c-o_e).abs().max():.3g} "
              f"eager-fp32 {(o_e-o_r).abs().max():.3g} enn-fp32 {(o_c-o_r).abs().max():.3g} | grads enn-eager {worst(g_c,g_e):.3g} "
              f"eager-fp32 {worst(g_e,g_r):.3g} enn-fp32 {worst(g_c,g_r):.3g}", flush=True)
