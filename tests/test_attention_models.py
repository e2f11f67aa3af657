"""Attention as real model code writes it, end to end: the zoo's GPT-2 (tril mask buffer), LLaMA
(RoPE under autocast, GQA, additive triu mask), BERT (HF padding mask) and ViT under bf16
autocast training. Each attention must be fused, run as the ATen kernel itself where no row can
be fully masked (the pass's graph, tests/pass_harness.py), and give eager's loss and gradients
through backend="enn".

CPU runs ATen's CPU flash kernel (forced: the CPU policy leaves training attention to
Inductor); the GPU test runs the default CUDA policy (cuDNN / flash / memory-efficient).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import enn_backend
from enn_backend import compat, models
from enn_backend.custom_ops.attention import Backend
from enn_backend.passes.attention.kernels.sdpa import NATIVE
from pass_harness import assert_ops, count_ops, run_passes

aten = torch.ops.aten
MODELS = ("gpt2_naive", "llama", "bert", "vit")
FLEX_MODELS = ("alibi", "sliding")  # ALiBi slopes / sliding window: FlexAttention in the graph (CUDA)
ONE_LAYER = {"gpt2_naive": {"n_layer": 1}, "llama": {"n_layer": 1}, "bert": {"n_layer": 1}, "vit": {"depth": 1},
             "alibi": {"n_layer": 1}, "sliding": {"n_layer": 1}}
# backend -> the op the pass emits for it
KERNELS = {**{b.value: k.forward for b, k in NATIVE.items()}, Backend.FLEX.value: torch.ops.higher_order.flex_attention}


class Autocast(nn.Module):
    """``model`` under bf16 autocast (its parameters are this module's)."""

    def __init__(self, model: nn.Module, device_type: str) -> None:
        super().__init__()
        self.model, self.device_type = model, device_type

    def forward(self, *args):
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            return self.model(*args)


def _train_step(run, model, batch, loss_fn, device_type):
    with torch.autocast(device_type, dtype=torch.bfloat16):
        loss = loss_fn(run(*batch.args), batch.target)
    loss.backward()
    return loss.detach().float(), {n: p.grad.detach().float() for n, p in model.named_parameters()}


def _check_model(name, device, options):
    """The pass's graph: one site fused into the chosen kernel's own op, no enn::attention around
    it. Then the whole backend: eager's loss and gradients, nothing fallen back."""
    entry = models.build(name, "cpu-small", device=device, **ONE_LAYER[name])
    reference = copy.deepcopy(entry.model)
    batch = entry.make_inputs(0)
    device_type = torch.device(device).type
    run = run_passes(Autocast(entry.model, device_type), batch.args, ["attention"], options=options)
    assert run.matches == {"attention": 1}, (name, run.matches)
    assert_ops(run.after, absent=[torch.ops.enn.attention])
    emitted = [kernel for kernel, op in KERNELS.items() if count_ops(run.after, op)]
    assert len(emitted) == 1, (name, emitted)
    entry.model.zero_grad(set_to_none=True)

    torch._dynamo.reset()
    enn_backend.reset()
    compiled = torch.compile(entry.model, backend="enn", options=options)
    loss, grads = _train_step(compiled, entry.model, batch, entry.loss_fn, device_type)
    want_loss, want_grads = _train_step(reference, reference, batch, entry.loss_fn, device_type)
    rep = enn_backend.report().to_dict()
    assert [c["choice"] for c in run.choices] == emitted, run.choices
    assert emitted[0] in [c["choice"] for g in rep["graphs"] for c in g["kernel_choices"]], (name, rep)
    assert not rep["fallbacks"], rep
    # bf16 autocast: the fused kernel rounds differently from eager's bf16 matmuls; compare
    # against the size of eager's own values.
    torch.testing.assert_close(loss, want_loss, rtol=2e-2, atol=2e-2)
    overall = max(g.abs().max().item() for g in want_grads.values())
    for n, g in want_grads.items():
        # (a key bias has an exactly-zero true gradient: compare noise against the model's scale)
        scale = max(g.abs().max().item(), 1e-2 * overall)
        err = (grads[n] - g).abs().max().item()
        assert err <= 0.05 * scale, f"{name}: grad {n} differs by {err:.3g} (max |g| {scale:.3g})"
    return emitted[0], run


@pytest.mark.parametrize("name", MODELS)
def test_zoo_attention_fused_as_aten_kernel_cpu(name):
    kernel, run = _check_model(name, "cpu", {"attention_backend": "flash"})
    assert kernel == "cpu_flash"
    assert bool(run.assumed) == (name == "gpt2_naive")  # nanoGPT's tril buffer, compiled as a causal flag


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", [m for m in MODELS if m != "bert"] + list(FLEX_MODELS))
def test_zoo_attention_fused_as_aten_kernel_gpu(name):
    # (BERT's finfo.min padding mask stays with Inductor on CUDA: tests/test_hf_models.py)
    kernel, _ = _check_model(name, "cuda", {})
    assert kernel in (("flex",) if name in FLEX_MODELS else ("cudnn", "flash", "efficient"))


def _hand_causal(q, k, v):
    """bench/gpu_attention.py's causal problem, as it writes it: tril + masked_fill(-inf) + fp32 softmax."""
    t = q.size(-2)
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool, device=q.device))
    att = (q @ k.transpose(-2, -1)) / q.size(-1) ** 0.5
    att = att.masked_fill(~mask, float("-inf"))
    return torch.softmax(att.float(), dim=-1).to(q.dtype) @ v


def _hand_alibi(q, k, v, slopes):
    """bench/gpu_attention.py's ALiBi problem: causal plus slopes x relative position."""
    t = q.size(-2)
    pos = torch.arange(t, device=q.device)
    rel = (pos[None, :] - pos[:, None]).to(q.dtype)
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool, device=q.device))
    att = (q @ k.transpose(-2, -1)) * (1.0 / q.size(-1) ** 0.5) + slopes.view(1, -1, 1, 1) * rel
    att = att.masked_fill(~mask, float("-inf"))
    return torch.softmax(att.float(), dim=-1).to(q.dtype) @ v


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pattern", ["causal", "alibi"])
def test_benchmark_attention_patterns_fused_gpu(pattern):
    """The hand-written attention that bench/gpu_attention.py times (bf16, H16 T1024 D64,
    inference), compiled by enn with its default CUDA policy: one fusion; causal becomes an SDPA
    kernel with the causal flag, ALiBi FlexAttention with its slopes; no fallback; nearer fp64 than
    eager (whose bf16 scores round: H100, bench/results/gpu-h100/attention.log, RMSE 2.5e-4 against
    eager's 4.4e-4, ALiBi 6.5e-4 against 1.1e-3)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 16, 1024, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    fn, extra = _hand_causal, ()
    if pattern == "alibi":
        fn, extra = _hand_alibi, (torch.tensor([2 ** (-8 * (h + 1) / 16) for h in range(16)], device="cuda",
                                               dtype=torch.bfloat16),)
    with torch.no_grad():
        got = torch.compile(fn, backend="enn")(q, k, v, *extra)
        want = fn(q, k, v, *extra)
        ref = fn(q.double(), k.double(), v.double(), *(x.double() for x in extra))  # (its softmax in fp32)
    rep = enn_backend.report().to_dict()
    assert rep["fusions"] == {"attention": 1} and not rep["fallbacks"], rep
    (choice,) = [c for gr in rep["graphs"] for c in gr["kernel_choices"] if c["choice"] != "inductor"]
    if pattern == "causal":
        assert choice["choice"] in ("cudnn", "flash", "efficient") and choice["causal"] and not choice["bias"], choice
    else:
        assert choice["choice"] == "flex" and choice["alibi"], choice

    def rmse(a):
        return (a.double() - ref).pow(2).mean().sqrt().item()

    assert torch.isfinite(got).all() and rmse(got) <= rmse(want), (rmse(got), rmse(want))


def test_mask_buffer_content_is_guarded():
    """nanoGPT's causal buffer is compiled as a causal flag; if the buffer changes, the graph
    runs eagerly (recorded) and the result follows the new mask."""
    entry = models.build("gpt2_naive", "cpu-small", n_layer=1)
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


def test_flex_in_graph_inference_cpu():
    """ALiBi + causal and a sliding window become FlexAttention ops that Inductor compiles (CPU
    flex is inference-only, so only when asked for; CUDA picks flex by default). The block mask
    enters the joint graph through lifts, which the post-grad pass drops."""
    entry = models.build("alibi", "cpu-small", n_layer=1)
    batch = entry.make_inputs(0)
    options = {"attention_backend": "flex"}
    run = run_passes(entry.model, batch.args, ["attention", "flex_constants"], training=False, options=options)
    assert run.matches["attention"] == 1 and run.matches["flex_constants"] > 0, run.matches
    assert_ops(run.after, present=[torch.ops.higher_order.flex_attention], absent=[torch.ops.enn.attention])
    (post,) = [s for s in run.stages if s.stage == "post_grad"]
    lifts = aten.lift_fresh_copy.default
    assert count_ops(post.before, lifts) == run.matches["flex_constants"] and count_ops(post.after, lifts) == 0
    run.check_eager(atol=1e-4, rtol=1e-4)

    torch._dynamo.reset()
    enn_backend.reset()
    compiled = torch.compile(entry.model, backend="enn", options=options)
    with torch.no_grad():
        got, want = compiled(*batch.args), entry.model(*batch.args)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    rep = enn_backend.report().to_dict()
    assert not rep["fallbacks"] and [g["path"] for g in rep["graphs"]] == ["inductor"], rep
    assert [c["choice"] for c in run.choices] == ["flex"]
    assert "flex" in [c["choice"] for g in rep["graphs"] for c in g["kernel_choices"]]
    # q, k, v are views of the fused qkv projection: copied apart where Inductor's CPU flex needs it
    copied = "q, k, v copied to buffers of their own" in run.choices[0]["reason"]
    assert copied == compat.cpu_flex_needs_distinct_buffers(), run.choices[0]["reason"]


def test_inductors_own_attention_fusion_keeps_the_joint_graph_valid():
    """On CPU enn leaves BERT's attention to Inductor, whose fuse_attention rewrites it between
    enn's joint passes and leaves the graph unsorted until after enn's post pass: enn must
    restore the order (before the fix the graph failed lint and fell back to plain Inductor)."""
    entry = models.build("bert", "cpu-small")
    reference = copy.deepcopy(entry.model)
    batch = entry.make_inputs(0)
    compiled = torch.compile(entry.model, backend="enn")
    loss = entry.loss_fn(compiled(*batch.args), batch.target)
    loss.backward()
    want = entry.loss_fn(reference(*batch.args), batch.target)
    want.backward()
    assert enn_backend.report().to_dict()["fallbacks"] == [], str(enn_backend.report())
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
