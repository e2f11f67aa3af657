"""The guard on Hugging Face models on a GPU: one training step of each model (tiny random
configs from tests/_hf.py, a padded batch) under backend="enn" with default options, against eager
with the same weights, in fp32 and under bf16 autocast. Prints per model the largest relative
gradient error, non-finite counts and enn's fallback lines (a healthy model has none).

    python bench/gpu_hf_guard.py [--models llama,mistral,qwen2,gpt2,bert,t5] [--impls sdpa,eager]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import _hf  # noqa: E402  (the sweep's models and comparison, shared with tests/test_hf_sweep.py)

import enn_backend  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama,mistral,qwen2,gpt2,bert,t5")
    ap.add_argument("--impls", default="sdpa,eager")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| model | attention | dtype | loss err | max grad err | non-finite | fallbacks |")
    print("|---|---|---|---|---|---|---|")
    bad = 0
    for name in args.models.split(","):
        for impl in args.impls.split(","):
            for autocast in (False, True):
                torch._dynamo.reset()
                enn_backend.reset()
                try:
                    d = _hf.differences(*_hf.compiled_and_eager(name, impl, device="cuda", autocast=autocast))
                except Exception as e:  # noqa: BLE001 - a row, not a crash
                    print(f"| {name} | {impl} | {'bf16' if autocast else 'fp32'} | raised {type(e).__name__}: {e} |")
                    bad += 1
                    continue
                fallbacks = [f"{f['kind']}:{f['node']}" for f in enn_backend.report().to_dict()["fallbacks"]]
                worst = max((e[0] for e in d["grads"].values()), default=0.0)
                nonfinite = sum(d["nonfinite"].values())
                bad += bool(fallbacks or nonfinite)
                print(f"| {name} | {impl} | {'bf16' if autocast else 'fp32'} | {d['loss'][0]:.2e} | {worst:.2e} | "
                      f"{nonfinite} | {', '.join(fallbacks) or '-'} |")
    print(f"{bad} row(s) with a fallback line, a non-finite value or an error")
    return 0


if __name__ == "__main__":
    sys.exit(main())
