"""A NaN after every ``mm`` of HF LLaMA (SDPA attention), traced through the guard's ladder.

    python bench/gpu_hidden_nan.py fp32|bf16 value [cuda|cpu]   (the second argument is kept for the logged commands)

Prints each localization trial's verdict (outputs off eager's, which hold NaN/Inf, the fp64
judgment), the ladder's INFO lines (a trial that raised, a missing fp64 run), the fallback, and
each step's largest difference from eager. Results: bench/results/gpu-h100/hidden_nan_cuda*.log.
"""
import logging
import sys

import torch
import transformers

import enn_backend
import enn_backend.guard.ladder as L
from enn_backend.guard import screen as S

logging.basicConfig(level=logging.WARNING)
logging.getLogger("enn_backend.guard.ladder").setLevel(logging.INFO)
orig_div = S.diverging
def div(out, ref, lp=False, bk=frozenset(), lo=frozenset()):
    r = orig_div(out, ref, lp, bk, lo)
    nan = [i for i, t in enumerate(out) if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all()]
    d = [(i, (out[i].double() - ref[i].double()).abs().nan_to_num(1e30).max().item()) for i in r if isinstance(out[i], torch.Tensor)]
    print("  diverging", r, "nonfinite", nan, "maxdiff", d[:4], flush=True)
    return r
L.diverging = div
orig_cw = L.FaultLadder._compiled_is_wrong
def cw(self, *a, **k):
    r = orig_cw(self, *a, **k); print("  fp64 judge ->", r, flush=True); return r
L.FaultLadder._compiled_is_wrong = cw
dtype = torch.bfloat16 if sys.argv[1] == "bf16" else torch.float32
torch.manual_seed(0)
cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                               num_key_value_heads=1, vocab_size=128, max_position_embeddings=64, attn_implementation="sdpa")
cfg.use_cache = False
dev = sys.argv[3] if len(sys.argv) > 3 else "cuda"
model = transformers.LlamaForCausalLM(cfg).eval().to(dev)
ids = torch.randint(3, 128, (8, 1), device=dev)
c = torch.compile(model, backend="enn", options={"fault_inject": "aten.mm:nan:fwd", "persist": False, "repro": False, "guard_values": 0})
with torch.no_grad(), torch.autocast(dev, dtype=dtype, enabled=dtype != torch.float32):
    want = model(input_ids=ids).logits
    for step in range(2):
        got = c(input_ids=ids).logits
        print("step", step, "maxdiff", (got.float() - want.float()).abs().max().item(), flush=True)
print(enn_backend.report())
