"""Attention through ``backend="enn"`` end to end: HF-style attention modules (the pass's ops,
and eager's loss and gradients through Inductor and the guard), what the report records, and a
NaN from a fused kernel caught and blamed on it. CPU, tiny shapes.

The pass on its own: test_attention_passes.py; the op: test_attention_op.py; the policy:
test_attention_policy.py; real model code: test_attention_models.py, test_hf_models.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import enn_backend
from attention_cases import B, T, aten, bool_padding_neg_inf, causal_tril, qkv
from pass_harness import assert_ops, run_passes


@pytest.fixture(autouse=True)
def _fuse_tiny(monkeypatch):
    """The shapes here are tiny; by default the policy leaves tiny CPU attention to Inductor
    (test_attention_passes.py::test_tiny_cpu_attention_left_to_inductor). An explicit order makes
    enn fuse them."""
    monkeypatch.setenv("ENN_ATTENTION_ORDER", "flash,explicit")


def choices() -> list[dict]:
    return [c for g in enn_backend.report().to_dict()["graphs"] for c in g["kernel_choices"]]


# ----------------------------------------------------------------------------- HF-style models
class GPT2Attention(nn.Module):
    """Hugging Face GPT-2's eager attention, written the way modeling_gpt2.py writes it."""

    def __init__(self, d=32, heads=4, max_pos=16):
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.register_buffer("bias", torch.tril(torch.ones(max_pos, max_pos, dtype=torch.bool)).view(1, 1, max_pos, max_pos),
                             persistent=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, self.hd).permute(0, 2, 1, 3) for z in (q, k, v))
        w = torch.matmul(q, k.transpose(-1, -2))
        w = w / torch.full([], v.size(-1) ** 0.5, dtype=w.dtype, device=w.device)
        causal_mask = self.bias[:, :, t - t:t, :t]
        mask_value = torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype, device=w.device)
        w = torch.where(causal_mask, w.to(w.dtype), mask_value)
        w = F.softmax(w, dim=-1).type(v.dtype)
        y = torch.matmul(w, v).permute(0, 2, 1, 3).contiguous().view(b, t, c)
        return self.c_proj(y)


class BertSelfAttention(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def split(self, x):
        return x.view(x.size()[:-1] + (self.heads, self.hd)).permute(0, 2, 1, 3)

    def forward(self, x, attention_mask):
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.hd)
        ext = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        probs = F.softmax(scores + ext, dim=-1)
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        return ctx.view(ctx.size()[:-2] + (self.heads * self.hd,))


def repeat_kv(h, n_rep):
    b, kv, s, d = h.shape
    if n_rep == 1:
        return h
    return h[:, :, None, :, :].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


class LlamaAttention(nn.Module):
    def __init__(self, d=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv_heads, d // heads
        self.q_proj = nn.Linear(d, heads * self.hd, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.hd).transpose(1, 2)
        causal = torch.full((t, t), torch.finfo(x.dtype).min, device=x.device).triu(1)[None, None]
        k, v = repeat_kv(k, self.heads // self.kv), repeat_kv(v, self.heads // self.kv)
        w = torch.matmul(q, k.transpose(2, 3)) * self.hd ** -0.5 + causal
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        y = torch.matmul(w, v).transpose(1, 2).contiguous().reshape(b, t, -1)
        return self.o_proj(y)


class Stack(nn.Module):
    def __init__(self, make, layers=2):
        super().__init__()
        self.layers = nn.ModuleList(make() for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(32) for _ in range(layers))

    def forward(self, x, *extra):
        for n, layer in zip(self.norms, self.layers):
            x = x + layer(n(x), *extra)
        return x


@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama"])
def test_hf_style_models(kind):
    """Each layer's attention is fused (no bmm / softmax left in the joint graph), and the
    compiled model's loss and every gradient equal eager's."""
    torch.manual_seed(0)
    make = {"gpt2": GPT2Attention, "bert": BertSelfAttention, "llama": LlamaAttention}[kind]
    model = Stack(make)
    x = torch.randn(2, 8, 32)
    extra = ()
    if kind == "bert":
        m = torch.ones(2, 8)
        m[1, 6:] = 0
        extra = (m,)
    ref_model = Stack(make)
    ref_model.load_state_dict(model.state_dict())
    run = run_passes(model, (x, *extra), ["attention"])
    assert run.matches == {"attention": 2}, run.matches
    assert [c["choice"] for c in run.choices] == ["cpu_flash", "cpu_flash"], run.choices
    assert_ops(run.after, absent=[aten.bmm, aten._softmax, aten.exp])
    run.check_eager()

    torch._dynamo.reset()
    enn_backend.reset()
    loss_ref = ref_model(x, *extra).pow(2).mean()
    loss_ref.backward()
    loss = torch.compile(model, backend="enn")(x, *extra).pow(2).mean()
    loss.backward()
    torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5)
    for (name, p), p_ref in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-5, rtol=1e-4, msg=name)
    # (the epilogue pass may fuse the projections' residual adds too)
    assert enn_backend.report().fusions()["attention"] == 2 and not enn_backend.report().to_dict()["fallbacks"], \
        enn_backend.report()


# ----------------------------------------------------------------------------- the report and the guard
def test_forced_impossible_backend_is_recorded():
    ref = causal_tril(*qkv(grad=False))
    with torch.no_grad():
        out = torch.compile(causal_tril, backend="enn", options={"attention_backend": "cudnn"})(*qkv(grad=False))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    kinds = [f["kind"] for f in enn_backend.report().to_dict()["fallbacks"]]
    assert kinds == ["kernel_choice"], kinds
    assert choices()[0]["choice"] == "cpu_flash"  # a user who names a kernel wants attention fused


def test_fault_injection_after_attention():
    """A NaN from the fused attention is caught and blamed on it, whether the pass emitted the
    ATen kernel itself (causal, no mask tensor) or enn::attention (a runtime boolean mask)."""
    q, k, v = qkv(grad=False)
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, 4:] = False
    cases = [(causal_tril, (q, k, v), "aten._scaled_dot_product_flash_attention_for_cpu", "scaled_dot_product"),
             (bool_padding_neg_inf, (q, k, v, keep), "enn.attention", "attention")]
    for fn, args, op, node in cases:
        torch._dynamo.reset()
        enn_backend.reset()
        ref = fn(*args)
        out = torch.compile(fn, backend="enn", options={"fault_inject": f"{op}:nan:fwd"})(*args)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, equal_nan=True)
        fbs = enn_backend.report().to_dict()["fallbacks"]
        assert any(f["kind"] == "nonfinite" and node in f["node"] for f in fbs), (op, fbs)


def test_a_site_left_to_inductor_is_reported_once(monkeypatch):
    """The pass runs before and after Inductor's joint passes; a site it leaves to Inductor (and
    that Inductor does not rewrite in between) is met twice, and reported once."""
    monkeypatch.delenv("ENN_ATTENTION_ORDER")  # the default policy: tiny CPU attention stays with Inductor

    def attend(q, k, v, bias):  # T5's form (no scale): Inductor's own fuse_attention leaves it alone
        return (q @ k.transpose(-1, -2) + bias).softmax(-1) @ v

    bias = torch.randn(B, 1, T, T)
    with torch.no_grad():
        torch.compile(attend, backend="enn")(*qkv(grad=False), bias)
    assert [c["choice"] for c in choices()] == ["inductor"], choices()
