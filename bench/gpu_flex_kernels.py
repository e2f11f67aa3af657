"""How many FlexAttention template kernels one cold compile builds, and how many distinct ones.

Compiles a zoo workload (default: ALiBi training, gpu-real) under enn into an empty Inductor
cache, then reads the generated wrapper code: each `triton_tem_*` kernel definition is one
Triton template compile. Kernels whose sources differ only in Inductor's buffer numbering
(`out_ptr8` vs `out_ptr28`) are counted as one "distinct" kernel: the gap between the two
counts is compile work that layer-identical attention repeats.

    python bench/gpu_flex_kernels.py [model] [train|infer]
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import sys
import tempfile
import time

import torch

from enn_backend import models
from enn_backend.bench.backends import cache_dir


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "alibi"
    mode = sys.argv[2] if len(sys.argv) > 2 else "train"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = "gpu-real" if device == "cuda" else "cpu-small"
    ent = models.build(name, size, device=device)
    batch = ent.make_inputs()
    cache = tempfile.mkdtemp()
    with cache_dir(cache):
        fn = torch.compile(ent.model, backend="enn")
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            out = fn(*batch.args)
            loss = ent.loss_fn(out, batch.target)
        if mode == "train":
            loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        print(f"{name} {mode} on {device}: cold compile + first step {time.perf_counter() - t0:.2f} s")
    pattern = re.compile(r"^(triton_tem_\w+|cpp_fused_\w+) = async_compile\.\w+\(", re.M)
    for path in sorted(glob.glob(os.path.join(cache, "**", "*.py"), recursive=True)):
        src = open(path).read()
        if "def call(" not in src:
            continue
        starts = [(m.start(), m.group(1)) for m in pattern.finditer(src)]
        templates = []
        for i, (pos, kname) in enumerate(starts):
            end = starts[i + 1][0] if i + 1 < len(starts) else len(src)
            body = src[pos:end].replace(kname, "KERNEL")
            if kname.startswith("triton_tem") or "flex_attention" in body or "cur_kvSplitSize" in body:
                templates.append(hashlib.sha256(re.sub(r"(out_ptr|in_ptr|buf)\d+", r"\1N", body).encode()).hexdigest())
        if templates:
            print(f"{os.path.basename(path)}: {len(templates)} template kernel(s), {len(set(templates))} distinct "
                  f"once buffer numbering is ignored")


if __name__ == "__main__":
    main()
