"""HF's SDPA attention with left padding on CUDA: what the kernels make of a query row that keeps no
key, and whether FlexAttention with a per-call block mask beats the materialized mask.

    python bench/gpu_sdpa_left_padding.py [--shapes 4,16,2,1024,128;1,32,8,4096,128] [--out DIR]

transformers' ``sdpa`` attention (under torch.compile) hands SDPA a ``[B, 1, T, T]`` boolean mask:
causal, and-ed with the ``[B, T]`` padding vector. With left padding the first rows of a padded
sequence keep no key ("dead rows"). Part 1 prints, per SDPA kernel, how far its dead rows are from
(a) zeros, (b) softmax over every key of the raw scores, (c) the mean of V, and its live rows from
an fp64 reference; then the memory-efficient kernel under the mask against ``is_causal`` with the
``[B, 1, 1, Tk]`` padding mask, outputs and gradients. Part 2 times forward and forward + backward (bf16): SDPA with the mask (the
default dispatch, cuDNN and memory-efficient forced), cuDNN ``is_causal`` without a mask (the
floor: it ignores padding), and FlexAttention compiled with a block mask built in closed form from
the padding vector on every call (dead rows keep every key, scored with the kernel's fill), on
repeated and on grouped K/V, built per query head; its values against the default dispatch's.
The SDPA rows include HF's ``repeat_kv`` copy of K/V. ``flex, grouped, one head broadcast`` (one
block-mask head for every query head) gave wrong values and then an illegal memory access on
torch 2.11: run it last, or leave it out with ``--variants``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from enn_backend.passes.attention.kernels import flex_padding as fp
try:
    from triton.testing import do_bench
except ImportError:  # the block-mask builder is importable (and checked) on a CPU machine
    do_bench = None

BLOCK = 128
KERNELS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
           "math": SDPBackend.MATH}


def inputs(b, hq, hkv, t, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, t, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16, generator=g)
    keep = torch.ones(b, t, dtype=torch.bool, device="cuda")
    keep[1::2, : t // 4] = False  # every second row left-padded by a quarter, as the real suite pads
    return q, k, v, keep


def repeat_kv(x, rep):
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, rep, t, d).reshape(b, h * rep, t, d)


def hf_mask(keep):
    t = keep.shape[1]
    i = torch.arange(t, device=keep.device)
    return (i[None, :] <= i[:, None])[None, None] & keep[:, None, None, :]


def sdpa(kernel, q, k, v, mask):
    if KERNELS[kernel] is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with sdpa_kernel([KERNELS[kernel]]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def padding_block_mask(keep, dead, heads: int):
    """enn's block mask for ``(causal & keep[b, kv]) | dead[b, q]`` (kernels/flex_padding.py)."""
    return BlockMask.from_kv_blocks(*fp.block_parts(keep, dead, heads), BLOCK_SIZE=BLOCK,
                                    mask_mod=lambda b, h, q, kv: fp.causal_padding_mask_mod(b, h, q, kv, keep, dead),
                                    seq_lengths=(keep.shape[1], keep.shape[1]))


def flex_padded(q, k, v, keep, fill, per_head=True):
    """Flex with the padding block mask: dead rows keep every key, scores offset by ``fill`` (as
    cuDNN computes them)."""
    dead = fp.dead_rows(keep)
    bm = padding_block_mask(keep, dead, q.shape[1] if per_head else 1)
    offset = torch.where(dead, fill, 0.0).float()

    def score_mod(score, bb, h, qi, ki):
        return score + offset[bb, qi]

    return flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=q.shape[1] != k.shape[1])


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def semantics(shape, log):
    b, hq, hkv, t, d = shape
    q, k, v, keep = inputs(b, hq, hkv, t, d, seed=1)
    kr, vr = repeat_kv(k, hq // hkv), repeat_kv(v, hq // hkv)
    mask, dead = hf_mask(keep), fp.dead_rows(keep)
    scale = d ** -0.5
    s = (q.double() @ kr.double().transpose(-1, -2)) * scale
    raw_all = torch.softmax(s, -1) @ vr.double()
    live_ref = torch.softmax(s.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0) @ vr.double()
    mean_v = vr.double().mean(-2, keepdim=True).expand_as(raw_all)
    sel = dead[:, None, :, None].expand_as(raw_all)
    out = {}
    for kernel in KERNELS:
        try:
            o = sdpa(kernel, q, kr, vr, mask).double()
        except RuntimeError as e:
            out[kernel] = f"refused: {str(e).splitlines()[0][:80]}"
            continue
        dead_o = o[sel]
        row = {"nan": bool(torch.isnan(o).any()),
               "dead vs zeros": dead_o.abs().max().item(),
               "dead vs raw over all keys": rel(dead_o, raw_all[sel]),
               "dead vs mean V": rel(dead_o, mean_v[sel]),
               "live vs fp64": rel(o[~sel], live_ref[~sel])}
        out[kernel] = row
    log(f"\n== dead rows (B{b} Hq{hq} T{t} D{d}, {int(dead.sum())} dead rows of {b * t}), bf16 ==")
    for kernel, row in out.items():
        log(f"  {kernel:10s} " + (row if isinstance(row, str) else
                                  "  ".join(f"{k2} {v2:.3g}" if isinstance(v2, float) else f"{k2} {v2}"
                                            for k2, v2 in row.items())))
    return out


VARIANTS = ["sdpa default + mask", "sdpa cudnn + mask", "sdpa efficient + mask", "cudnn is_causal (no padding)",
            "flex, repeated K/V", "flex, grouped K/V", "flex, grouped, one head broadcast"]  # the last: wrong values, then a fault, on torch 2.11


def efficient_with_the_causal_flag(shape, log):
    """The memory-efficient kernel on left padding: the materialized mask (as HF hands it over)
    against ``is_causal`` plus the ``[B, 1, 1, Tk]`` padding mask (-inf), outputs and gradients."""
    b, hq, hkv, t, d = shape
    q, k, v, keep = inputs(b, hq, hkv, t, d, seed=2)
    k, v = repeat_kv(k, hq // hkv), repeat_kv(v, hq // hkv)
    g = torch.randn_like(q)
    pad = torch.where(keep[:, None, None, :], 0.0, float("-inf")).to(q.dtype).expand(b, hq, t, t)
    runs = {}
    for name in ("mask", "flag"):
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        if name == "mask":
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=hf_mask(keep))
        else:
            out = torch.ops.aten._scaled_dot_product_efficient_attention(qq, kk, vv, pad, True, 0.0, True)[0]
        out.backward(g)
        runs[name] = [out.detach(), qq.grad, kk.grad, vv.grad]
    dead = fp.dead_rows(keep)[:, None, :, None].expand_as(q)
    diffs = {n: (a.float() - c.float()).abs().max().item() for n, a, c in zip(("out", "dq", "dk", "dv"), runs["mask"], runs["flag"])}
    nan = {name: any(bool(torch.isnan(x).any()) for x in r) for name, r in runs.items()}
    log(f"\n== memory-efficient, left padding (B{b} H{hq} T{t} D{d}): mask vs is_causal + [B,1,1,Tk] padding mask ==")
    log("  max |difference|: " + "  ".join(f"{n} {v:.3g}" for n, v in diffs.items())
        + f"  dead rows of the flag run all zero: {bool(runs['flag'][0][dead].eq(0).all())}"
        + f"  dq of dead rows zero: {bool(runs['flag'][1][dead].eq(0).all())}  NaN: {nan}")
    return {"diffs": diffs, "nan": nan}


def timing(shape, log, fill, names=None):
    b, hq, hkv, t, d = shape
    q, k, v, keep = inputs(b, hq, hkv, t, d)
    rep = hq // hkv
    g = torch.randn(b, hq, t, d, device="cuda", dtype=torch.bfloat16)
    mask = hf_mask(keep)
    flex_fn = torch.compile(flex_padded, fullgraph=True)

    def variant(name):
        if name.startswith("flex"):
            gqa = "repeated" not in name
            per_head = "one head broadcast" not in name

            def f(q, k, v):
                kk, vv = (k, v) if gqa else (repeat_kv(k, rep), repeat_kv(v, rep))
                return flex_fn(q, kk, vv, keep, fill, per_head)
            return f
        if name == "cudnn is_causal (no padding)":
            def f(q, k, v):
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return F.scaled_dot_product_attention(q, repeat_kv(k, rep), repeat_kv(v, rep), is_causal=True)
            return f
        kernel = name.split()[1]
        return lambda q, k, v: sdpa(kernel, q, repeat_kv(k, rep), repeat_kv(v, rep), mask)

    names = names or VARIANTS
    ref = sdpa("default", q, repeat_kv(k, rep), repeat_kv(v, rep), mask).float()
    dead = fp.dead_rows(keep)[:, None, :, None].expand_as(ref)
    rows = []
    log(f"\n== timing B{b} Hq{hq} Hkv{hkv} T{t} D{d} bf16, left padding T/4 on every second row ==")
    log(f"  {'variant':32s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {'live rel':>9s} {'dead rel':>9s}")
    for name in names:
        f = variant(name)
        try:
            o = f(q, k, v).float()
            fwd = do_bench(lambda: f(q, k, v), warmup=25, rep=200, return_mode="median")
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))

            def step():
                f(qq, kk, vv).backward(g)

            both = do_bench(step, warmup=25, rep=200, return_mode="median", grad_to_none=[qq, kk, vv])
        except Exception as e:  # noqa: BLE001 - a refused variant is a row, not the end of the run
            log(f"  {name:32s} failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            continue
        live, dd = rel(o[~dead], ref[~dead]), rel(o[dead], ref[dead])
        rows.append({"variant": name, "fwd_ms": fwd, "fwd_bwd_ms": both, "live_rel": live, "dead_rel": dd})
        log(f"  {name:32s} {fwd:8.3f} {both:11.3f} {live:9.2e} {dd:9.2e}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4,16,2,1024,128;2,32,8,4096,128")
    ap.add_argument("--fill", type=float, default=None,
                    help="score offset of dead rows in flex (the cuDNN mask fill); default: from part 1")
    ap.add_argument("--variants", default="", help="semicolon-separated subset of the timed variants (default: all)")
    ap.add_argument("--skip-semantics", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    log(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    result = {"semantics": [], "timing": []}
    for shape in shapes if not args.skip_semantics else ():
        result["semantics"].append(semantics(shape, log))
        result["semantics"].append(efficient_with_the_causal_flag(shape, log))
    fill = args.fill if args.fill is not None else -65536.0  # bf16's rounding of fp16's lowest, cuDNN's fill
    log(f"\nflex dead rows: every key, scores offset by {fill}")
    for shape in shapes if not args.skip_timing else ():
        result["timing"].append(timing(shape, log, fill, [v for v in args.variants.split(";") if v]))
    with open(os.path.join(args.out, "sdpa_left_padding.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "sdpa_left_padding.log"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
