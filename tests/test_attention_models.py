"""Attention as real model code writes it, end to end: the zoo's GPT-2 (tril mask buffer), LLaMA
(RoPE under autocast, GQA, additive triu mask), BERT (HF padding mask) and ViT under bf16
autocast training. Each attention must be fused, run as the ATen kernel itself where no row can
be fully masked, and give eager's loss and gradients.

CPU runs ATen's CPU flash kernel (forced: the CPU policy leaves training attention to
Inductor); the GPU test runs the default CUDA policy (cuDNN / flash / memory-efficient).
"""

from __future__ import annotations

import copy

import pytest
import torch

import enn_backend
from enn_backend.bench import zoo
from enn_backend.passes.attention import masks as A

MODELS = ("gpt2_naive", "llama", "bert", "vit")
FLEX_MODELS = ("alibi", "sliding")  # ALiBi slopes / sliding window: FlexAttention in the graph (CUDA)
ONE_LAYER = {"gpt2_naive": {"n_layer": 1}, "llama": {"n_layer": 1}, "bert": {"n_layer": 1}, "vit": {"depth": 1},
             "alibi": {"n_layer": 1}, "sliding": {"n_layer": 1}}
EMITTED = ("ATen kernel itself", "FlexAttention ops in the graph")


def _train_step(run, model, batch, loss_fn, device_type):
    with torch.autocast(device_type, dtype=torch.bfloat16):
        loss = loss_fn(run(*batch.args), batch.target)
    loss.backward()
    return loss.detach().float(), {n: p.grad.detach().float() for n, p in model.named_parameters()}


def _check_model(name, device, options):
    entry = zoo.build(name, "cpu-small", device=device, **ONE_LAYER[name])
    reference = copy.deepcopy(entry.model)
    batch = entry.make_inputs(0)
    compiled = torch.compile(entry.model, backend="enn", options=options)
    loss, grads = _train_step(compiled, entry.model, batch, entry.loss_fn, torch.device(device).type)
    want_loss, want_grads = _train_step(reference, reference, batch, entry.loss_fn, torch.device(device).type)
    rep = enn_backend.report()
    assert rep.fusions().get("attention") == 1, (name, str(rep))
    choices = [c for g in rep.to_dict()["graphs"] for c in g.get("kernel_choices", [])
               if any(e in c["reason"] for e in EMITTED)]
    assert len(choices) == 1, (name, str(rep))
    assert not rep.to_dict()["fallbacks"], str(rep)
    # bf16 autocast: the fused kernel rounds differently from eager's bf16 matmuls; compare
    # against the size of eager's own values.
    torch.testing.assert_close(loss, want_loss, rtol=2e-2, atol=2e-2)
    overall = max(g.abs().max().item() for g in want_grads.values())
    for n, g in want_grads.items():
        # (a key bias has an exactly-zero true gradient: compare noise against the model's scale)
        scale = max(g.abs().max().item(), 1e-2 * overall)
        err = (grads[n] - g).abs().max().item()
        assert err <= 0.05 * scale, f"{name}: grad {n} differs by {err:.3g} (max |g| {scale:.3g})"
    return choices[0]


@pytest.mark.parametrize("name", MODELS)
def test_zoo_attention_fused_as_aten_kernel_cpu(name):
    choice = _check_model(name, "cpu", {"attention_backend": "flash"})
    assert choice["choice"] == "cpu_flash"
    if name == "gpt2_naive":
        assert "mask buffer" in choice["reason"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", [m for m in MODELS if m != "bert"] + list(FLEX_MODELS))
def test_zoo_attention_fused_as_aten_kernel_gpu(name):
    # (BERT's finfo.min padding mask stays with Inductor on CUDA: tests/test_hf_models.py)
    choice = _check_model(name, "cuda", {})
    assert choice["choice"] in (("flex",) if name in FLEX_MODELS else ("cudnn", "flash", "efficient"))


def test_mask_buffer_content_is_guarded():
    """nanoGPT's causal buffer is compiled as a causal flag; if the buffer changes, the graph
    runs eagerly (recorded) and the result follows the new mask."""
    entry = zoo.build("gpt2_naive", "cpu-small", n_layer=1)
    reference = copy.deepcopy(entry.model)
    batch = entry.make_inputs(0)
    compiled = torch.compile(entry.model, backend="enn", options={"attention_backend": "flash"})
    with torch.no_grad():
        torch.testing.assert_close(compiled(*batch.args), reference(*batch.args), rtol=1e-5, atol=1e-5)
        assert enn_backend.report().to_dict()["fallbacks"] == []
        for model in (entry.model, reference):
            dict(model.named_buffers())["h.0.attn.bias"].fill_(1.0)  # attend to every key
        got, want = compiled(*batch.args), reference(*batch.args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    kinds = [f["kind"] for f in enn_backend.report().to_dict()["fallbacks"]]
    assert kinds == ["buffer_changed"]


def test_finite_bias_provenance():
    """What counts as a bias that cannot hold -inf (only those run as the bare kernel)."""
    import torch.fx as fx

    g = fx.Graph()
    mask = g.placeholder("mask")
    mask.meta["val"] = torch.ones(2, 8, dtype=torch.long)
    f = g.call_function(torch.ops.prims.convert_element_type.default, (mask, torch.float32))
    f.meta["val"] = torch.ones(2, 8)
    inv = g.call_function(torch.ops.aten.rsub.Scalar, (f, 1.0))
    inv.meta["val"] = torch.ones(2, 8)
    hf = g.call_function(torch.ops.aten.mul.Tensor, (inv, torch.finfo(torch.float32).min))
    hf.meta["val"] = torch.ones(2, 8)
    assert A.finite_bias(hf)  # HF's (1 - mask) * finfo.min
    assert A.may_saturate(hf)  # ... which can mask a whole row at finfo.min
    old_style = g.call_function(torch.ops.aten.mul.Tensor, (inv, -10000.0))
    old_style.meta["val"] = torch.ones(2, 8)
    assert A.finite_bias(old_style) and not A.may_saturate(old_style)
    inf = g.call_function(torch.ops.aten.mul.Tensor, (inv, float("-inf")))
    inf.meta["val"] = torch.ones(2, 8)
    assert not A.finite_bias(inf)
    learned = g.placeholder("bias")
    learned.meta["val"] = torch.ones(2, 8)
    assert not A.finite_bias(learned)  # a user tensor may hold -inf
    scaled = g.call_function(torch.ops.aten.mul.Tensor, (learned, 2.0))
    scaled.meta["val"] = torch.ones(2, 8)
    assert not A.finite_bias(scaled)  # a finite scale of an unknown tensor is still unknown
    summed = g.call_function(torch.ops.aten.add.Tensor, (hf, hf))
    summed.meta["val"] = torch.ones(2, 8)
    assert not A.finite_bias(summed)  # finfo.min + finfo.min overflows to -inf


# ----------------------------------------------------------------------------- FlexAttention
def test_flex_in_graph_inference_cpu():
    """ALiBi + causal and a sliding window become FlexAttention ops that Inductor compiles (CPU
    flex is inference-only, so only when asked for; CUDA picks flex by default)."""
    entry = zoo.build("alibi", "cpu-small", n_layer=1)
    batch = entry.make_inputs(0)
    compiled = torch.compile(entry.model, backend="enn", options={"attention_backend": "flex"})
    with torch.no_grad():
        got, want = compiled(*batch.args), entry.model(*batch.args)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    rep = enn_backend.report()
    assert rep.fusions().get("attention") == 1 and not rep.to_dict()["fallbacks"], str(rep)
    g = rep.to_dict()["graphs"][0]
    assert g["path"] == "inductor"
    assert [c["choice"] for c in g["kernel_choices"] if "Flex" in c["reason"]] == ["flex"]


def test_flex_training_fragment_matches_eager_math():
    """The joint (forward + backward) flex fragment the pass splices in, run eagerly (the HOPs'
    reference implementation) on CPU: values and q/k/v gradients equal hand-written ALiBi."""
    import math

    from enn_backend.passes.attention.kernels.flex import _fragment, block_mask

    torch.manual_seed(0)
    b, h, t, d = 1, 2, 64, 16
    q, k, v = (torch.randn(b, h, t, d) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25])
    g = torch.randn(b, h, t, d)
    parts = block_mask(True, 16, t, t, q.device).as_tuple()
    frag = _fragment(q.clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_(), slopes,
                     parts, 1 / math.sqrt(d), training=True)
    for n in frag.graph.nodes:  # joint_fwd_bwd renames placeholders: call them by position
        if n.op == "placeholder":
            n.target = n.name
    frag.recompile()
    mask_tensors = [x for x in parts if isinstance(x, torch.Tensor)]
    out, dq, dk, dv = list(frag(q, k, v, *mask_tensors, slopes, g))[:4]

    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    s = qq @ kk.transpose(-2, -1) / math.sqrt(d) + slopes.view(1, -1, 1, 1) * (j - i)
    s = s.masked_fill(~((j <= i) & (i - j < 16)), float("-inf"))
    want = s.softmax(-1) @ vv
    want_grads = torch.autograd.grad(want, (qq, kk, vv), g)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for got, ref in zip((dq, dk, dv), want_grads):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_alibi_with_bf16_rounded_positions():
    """``rel.to(bf16)`` rounds positions past 256: FlexAttention's score_mod rounds them the same
    way (so the result is what the user's code computes); a kernel that would add exact positions
    leaves the attention unfused, with the reason recorded."""
    import math

    import torch.nn.functional as F

    def alibi(q, k, v, slopes):
        t = q.size(-2)
        pos = torch.arange(t)
        rel = (pos[None, :] - pos[:, None]).to(torch.bfloat16)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1))) + slopes.view(1, -1, 1, 1) * rel
        att = att.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool)), float("-inf"))
        return F.softmax(att.float(), dim=-1).to(q.dtype) @ v

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 512, 16) for _ in range(3))
    slopes = torch.tensor([0.01, 0.02])  # gentle slopes: keys 256+ apart still count, so rounding shows
    with torch.no_grad():
        want = alibi(q, k, v, slopes)
        got = torch.compile(alibi, backend="enn", options={"attention_backend": "flex"})(q, k, v, slopes)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert enn_backend.report().fusions().get("attention") == 1
        torch._dynamo.reset()
        enn_backend.reset()
        torch.compile(alibi, backend="enn", options={"attention_backend": "explicit"})(q, k, v, slopes)
    assert enn_backend.report().fusions().get("attention", 0) == 0
    assert any("rounded" in f["reason"] for f in enn_backend.report().to_dict()["fallbacks"])


@pytest.mark.parametrize("t", [128, 512, 1024])
@pytest.mark.parametrize("causal, window", [(True, 0), (True, 100), (True, 256), (False, 300), (False, 0)])
def test_closed_form_block_mask_equals_create_block_mask(t, causal, window):
    """The band's block mask built from block indices equals the one create_block_mask derives
    from every (query, key) position: the same partial and full blocks, in the same order."""
    from torch.nn.attention.flex_attention import create_block_mask

    from enn_backend.custom_ops.attention import band_mask_mod
    from enn_backend.passes.attention.kernels.flex import block_mask

    want = [x for x in create_block_mask(band_mask_mod(causal, window), None, None, t, t, device="cpu").as_tuple()
            if isinstance(x, torch.Tensor)][:4]
    got = [x for x in block_mask(causal, window, t, t, torch.device("cpu")).as_tuple()
           if isinstance(x, torch.Tensor)][:4]
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("with_bias", [False, True])
def test_emitted_kernel_safe_paths_match_the_kernel(causal, with_bias):
    """What the guard runs for an emitted CPU flash node (its eager reference, or a pinned node):
    enn's fp32 math, with the kernel's values and output strides, forward and backward."""
    import enn_backend.custom_ops  # noqa: F401
    from enn_backend.custom_ops.pinned import SAFE_PATHS

    A = torch.ops.aten
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8).transpose(1, 2).contiguous().transpose(1, 2) for _ in range(3))
    kw = {"attn_mask": torch.randn(2, 1, 1, 16)} if with_bias else {}
    fwd, bwd = A._scaled_dot_product_flash_attention_for_cpu.default, A._scaled_dot_product_flash_attention_for_cpu_backward.default
    want = fwd(q, k, v, 0.0, causal, scale=0.3, **kw)
    got = SAFE_PATHS["aten._scaled_dot_product_flash_attention_for_cpu.default"](q, k, v, 0.0, causal, scale=0.3, **kw)
    g = torch.randn_like(want[0])
    want_b = bwd(g, q, k, v, want[0], want[1], 0.0, causal, scale=0.3, **kw)
    got_b = SAFE_PATHS["aten._scaled_dot_product_flash_attention_for_cpu_backward.default"](
        g, q, k, v, want[0], want[1], 0.0, causal, scale=0.3, **kw)
    for a, b in zip(list(got) + list(got_b), list(want) + list(want_b)):
        assert a.stride() == b.stride()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_inductors_own_attention_fusion_keeps_the_joint_graph_valid():
    """On CPU enn leaves BERT's attention to Inductor, whose fuse_attention rewrites it between
    enn's joint passes and leaves the graph unsorted until after enn's post pass: enn must
    restore the order (before the fix the graph failed lint and fell back to plain Inductor)."""
    entry = zoo.build("bert", "cpu-small")
    reference = copy.deepcopy(entry.model)
    batch = entry.make_inputs(0)
    compiled = torch.compile(entry.model, backend="enn")
    loss = entry.loss_fn(compiled(*batch.args), batch.target)
    loss.backward()
    want = entry.loss_fn(reference(*batch.args), batch.target)
    want.backward()
    assert enn_backend.report().to_dict()["fallbacks"] == [], str(enn_backend.report())
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
