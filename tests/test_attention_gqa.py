"""Grouped-query K/V without the copy: where the graph repeats K/V (transformers' ``repeat_kv``:
``expand`` + ``reshape``; ``repeat_interleave`` on the head axis), a kernel that takes grouped K/V
(``NativeKernel.grouped_kv``: CPU flash, CUDA flash and cuDNN) reads the ``Hkv``-head K/V and gives
their gradients itself, and the ``[B, Hq, T, D]`` copy leaves the graph; memory-efficient, which
needs equal heads, reads the copy and its K/V gradients are summed back per group.

Pass harness (tests/pass_harness.py): the emitted ops' K/V shapes, no repeat left, values and
gradients equal to eager's (bf16 judged against fp64). CPU runs ATen's CPU flash kernel (forced:
tiny CPU attention is left to Inductor by default); the GPU tests force cuDNN, flash and
memory-efficient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attention_cases import B, CPU_FLASH, CPU_FLASH_BWD, H, T, aten, gqa_repeat_interleave, qkv
from enn_backend.custom_ops.attention import Backend
from enn_backend.passes.attention.kernels import sdpa
from enn_backend.passes.attention.match import gqa_base
from pass_harness import find_ops, run_passes

HKV = 2
GROUPED = "reads the grouped-query K/V (2 heads) itself"
COPY = "reads the graph's 2x repeated K/V copy"
FLASH = {"attention_backend": "flash"}  # ATen's CPU flash kernel on CPU


def repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    """transformers' repeat_kv."""
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, rep, t, d).reshape(b, h * rep, t, d)


def repeat_kv_causal(q, k, v):
    """transformers' eager attention with its causal finfo.min mask, written out."""
    rep, t = q.shape[1] // k.shape[1], q.shape[-2]
    kk, vv = repeat_kv(k, rep), repeat_kv(v, rep)
    mask = torch.full((t, t), torch.finfo(q.dtype).min, device=q.device).triu(1)
    att = torch.matmul(q, kk.transpose(2, 3)) * q.shape[-1] ** -0.5 + mask
    return torch.matmul(F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype), vv)


def repeat_kv_causal_where(q, k, v):
    """The same, its causal mask from position comparisons (how transformers 5 builds it): on CUDA
    enn reads it as is_causal, so cuDNN and flash can take the site."""
    rep, t = q.shape[1] // k.shape[1], q.shape[-2]
    kk, vv = repeat_kv(k, rep), repeat_kv(v, rep)
    i, j = torch.arange(t, device=q.device)[:, None], torch.arange(t, device=q.device)[None, :]
    mask = torch.where(j <= i, torch.tensor(0.0, device=q.device), torch.finfo(torch.float32).min)
    att = torch.matmul(q, kk.transpose(2, 3)) * q.shape[-1] ** -0.5 + mask
    return torch.matmul(F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype), vv)


def left_padded_bf16(q, k, v, pad):
    """The same under bf16 autocast with a [B, T] attention mask (left padding) folded into the mask."""
    with torch.autocast("cpu", torch.bfloat16):
        b, hkv, t, d = k.shape
        kk, vv = repeat_kv(k, q.shape[1] // hkv), repeat_kv(v, q.shape[1] // hkv)
        i, j = torch.arange(t)[None, None, :, None], torch.arange(t)[None, None, None, :]
        keep = (j <= i) & pad.bool()[torch.arange(b)[:, None, None, None], j]  # masking_utils' padding lookup
        mask = torch.where(keep, torch.tensor(0.0), torch.finfo(torch.float32).min)
        att = torch.matmul(q, kk.transpose(2, 3)) * d ** -0.5 + mask
        return torch.matmul(F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype), vv)


def _heads(node: torch.fx.Node) -> int:
    return node.meta["val"].shape[1]


def _repeats(graph: torch.fx.Graph) -> list[str]:
    """The repeat_kv copies of K/V in ``graph`` (match.gqa_base's pattern), and the [B, Hkv, rep, T, D]
    expands behind them (not key_padding.DeadRows' [B, Hkv, rep, 1, Dv] broadcast of V's mean)."""
    return [n.format_node() for n in graph.nodes if gqa_base(n)[1] > 1
            or (n.target is aten.expand.default and n.meta["val"].dim() == 5 and n.meta["val"].shape[3] > 1)]


def _folds(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """K/V gradients summed over a group's repeated heads ([B, Hkv, rep, T, D] summed over rep)."""
    return [n for n in find_ops(graph, aten.sum.dim_IntList) if n.args[1] == [2] and n.args[0].meta["val"].dim() == 5]


def check_grouped(run, forward, backward, layers: int = 1) -> None:
    """Each emitted forward (and backward) reads K/V with their own heads; no copy, no fold left."""
    assert _repeats(run.before), "the case must repeat its K/V"
    fwds, bwds = find_ops(run.after, forward), find_ops(run.after, backward)
    assert len(fwds) == layers and len(bwds) == (layers if run.training else 0), (fwds, bwds)
    for n in fwds + bwds:
        k, v = (n.args[1], n.args[2]) if n in fwds else (n.args[2], n.args[3])
        assert _heads(k) == _heads(v) == HKV, n.format_node()
    for n in bwds:
        dk, dv = (u for u in n.users if u.args[1] in (1, 2))
        assert _heads(dk) == _heads(dv) == HKV
    assert not _repeats(run.after), _repeats(run.after)
    assert not _folds(run.after)
    got = [c for c in run.choices if c.get("fused", True)]
    assert len(got) == layers and all(c["gqa"] and GROUPED in c["reason"] for c in got), got


# ----------------------------------------------------------------------------- hand-written GQA, CPU flash
CASES = {"repeat_kv": repeat_kv_causal, "repeat_interleave": gqa_repeat_interleave}


@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_flash_reads_grouped_kv(case, dtype, training):
    run = run_passes(CASES[case], qkv(dtype, hkv=HKV, grad=training), ["attention"], training=training,
                     options=FLASH)
    check_grouped(run, CPU_FLASH, CPU_FLASH_BWD)
    run.check_eager()


@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
def test_cpu_flash_reads_grouped_kv_with_left_padding(training):
    """Key padding (a [B, 1, 1, T] bias and the causal flag) with the dead rows' closed form
    (key_padding.DeadRows, which reads the Hkv-head K/V too): batch 1's first three rows keep no key."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, 16, generator=g).requires_grad_(training)
    k, v = (torch.randn(B, HKV, T, 16, generator=g).requires_grad_(training) for _ in range(2))
    pad = torch.ones(B, T, dtype=torch.long)
    pad[1, :3] = 0
    run = run_passes(left_padded_bf16, (q, k, v, pad), ["attention"], training=training, options=FLASH)
    check_grouped(run, CPU_FLASH, CPU_FLASH_BWD)
    assert run.choices[0]["key_padding"] and run.choices[0]["causal"]
    run.check_eager(atol=3e-2, rtol=3e-2)


def test_a_kernel_without_grouped_kv_reads_the_copy_and_folds_its_gradients(monkeypatch):
    """The path memory-efficient takes (it needs equal heads), on CPU flash made to refuse
    grouped K/V: the kernel reads the repeat, the K/V gradients are summed back per group."""
    monkeypatch.setitem(sdpa.NATIVE, Backend.CPU_FLASH, sdpa.NATIVE[Backend.CPU_FLASH]._replace(grouped_kv=False))
    run = run_passes(repeat_kv_causal, qkv(hkv=HKV), ["attention"], training=True, options=FLASH)
    (fwd,), (bwd,) = find_ops(run.after, CPU_FLASH), find_ops(run.after, CPU_FLASH_BWD)
    assert _heads(fwd.args[1]) == _heads(bwd.args[2]) == H
    assert len(_folds(run.after)) == 2  # dk, dv
    (c,) = run.choices
    assert COPY in c["reason"] and "cpu_flash needs as many K/V heads as query heads" in c["reason"], c
    run.check_eager()


def test_grouped_kv_per_kernel():
    assert {b: k.grouped_kv for b, k in sdpa.NATIVE.items()} == {
        Backend.FLASH: True, Backend.CUDNN: True, Backend.EFFICIENT: False, Backend.CPU_FLASH: True}


# ----------------------------------------------------------------------------- transformers' own models
transformers = pytest.importorskip("transformers")

from _hf import Logits, build  # noqa: E402


@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("padded", [False, True], ids=["causal", "left_padded"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hf_eager_gqa_reads_grouped_kv(family, padded, training):
    """LLaMA / Qwen2 (4 query heads, 2 K/V heads, eager attention, 2 layers): every layer's CPU
    flash kernel reads the K/V projections' heads; the logits and every parameter's gradient
    (q/k/v projections included) equal eager's."""
    model, kwargs = build(family, "eager")
    assert model.config.num_key_value_heads == HKV < model.config.num_attention_heads
    args = (kwargs["input_ids"], kwargs["attention_mask"] if padded else None)
    run = run_passes(Logits(model), args, ["attention"], training=training, options=FLASH)
    check_grouped(run, CPU_FLASH, CPU_FLASH_BWD, layers=model.config.num_hidden_layers)
    assert all(c["key_padding"] == padded for c in run.choices), run.choices
    run.check_eager()


# ----------------------------------------------------------------------------- CUDA kernels
CUDA_FORWARD = {"cudnn": aten._scaled_dot_product_cudnn_attention.default,
                "flash": aten._scaled_dot_product_flash_attention.default,
                "efficient": aten._scaled_dot_product_efficient_attention.default}
CUDA_BACKWARD = {"cudnn": aten._scaled_dot_product_cudnn_attention_backward.default,
                 "flash": aten._scaled_dot_product_flash_attention_backward.default,
                 "efficient": aten._scaled_dot_product_efficient_attention_backward.default}


def _cuda_qkv(t: int = 128, d: int = 64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, 8, t, d, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    k, v = (torch.randn(B, HKV, t, d, generator=g).to("cuda", torch.bfloat16).requires_grad_() for _ in range(2))
    return q, k, v


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_cuda_kernel_reads_grouped_kv(kernel):
    if kernel == "cudnn" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("enn runs cuDNN attention on sm90+ only")
    run = run_passes(repeat_kv_causal_where, _cuda_qkv(), ["attention"], training=True,
                     options={"attention_backend": kernel})
    check_grouped(run, CUDA_FORWARD[kernel], CUDA_BACKWARD[kernel])
    run.check_eager()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs CUDA sm90+ (cuDNN attention)")
def test_cudnn_reads_grouped_kv_with_left_padding():
    """cuDNN with the key-padding bias: the bias is expanded to [B, Hq, T, Tk] (Tk read from the
    Hkv-head K), dead rows by key_padding.DeadRows."""
    q, k, v = _cuda_qkv()
    pad = torch.ones(B, q.shape[2], dtype=torch.long, device="cuda")
    pad[1, :5] = 0

    def attend(q, k, v, pad):
        with torch.autocast("cuda", torch.bfloat16):
            b, hkv, t, d = k.shape
            kk, vv = repeat_kv(k, q.shape[1] // hkv), repeat_kv(v, q.shape[1] // hkv)
            i, j = (torch.arange(t, device="cuda").view(shape) for shape in ((1, 1, t, 1), (1, 1, 1, t)))
            keep = (j <= i) & pad.bool()[torch.arange(b, device="cuda")[:, None, None, None], j]
            mask = torch.where(keep, torch.tensor(0.0, device="cuda"), torch.finfo(torch.float32).min)
            att = torch.matmul(q, kk.transpose(2, 3)) * d ** -0.5 + mask
            return torch.matmul(F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype), vv)

    run = run_passes(attend, (q, k, v, pad), ["attention"], training=True, options={"attention_backend": "cudnn"})
    check_grouped(run, CUDA_FORWARD["cudnn"], CUDA_BACKWARD["cudnn"])
    assert run.choices[0]["key_padding"]
    run.check_eager(atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_efficient_reads_the_repeated_copy():
    """Memory-efficient needs as many K/V heads as query heads: it reads the repeat, and the
    K/V gradients are summed back per group."""
    run = run_passes(repeat_kv_causal, _cuda_qkv(), ["attention"], training=True,
                     options={"attention_backend": "efficient"})
    (fwd,), (bwd,) = find_ops(run.after, CUDA_FORWARD["efficient"]), find_ops(run.after, CUDA_BACKWARD["efficient"])
    assert _heads(fwd.args[1]) == _heads(bwd.args[2]) == 8
    assert len(_folds(run.after)) == 2
    (c,) = run.choices
    assert "reads the graph's 4x repeated K/V copy (efficient needs as many K/V heads" in c["reason"], c
    run.check_eager()
