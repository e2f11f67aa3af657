"""Fused attention: enn::attention op, the attention pass's pattern families, HF-style models,
the attention policy, masked-row semantics and fault injection. CPU, tiny shapes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import enn_backend
from enn_backend.passes.attention.policy import AttentionProblem, choose
from enn_backend.custom_ops import attention as A

B, H, T, D = 2, 4, 8, 8


@pytest.fixture(autouse=True)
def _fuse_tiny(monkeypatch):
    """The shapes here are tiny; by default the policy leaves tiny CPU attention to Inductor
    (see test_tiny_cpu_attention_left_to_inductor). An explicit order makes enn fuse them."""
    monkeypatch.setenv("ENN_ATTENTION_ORDER", "flash,explicit")


def fused() -> int:
    return enn_backend.report().to_dict()["fusions"].get("attention", 0)


def choices() -> list[dict]:
    return [c for g in enn_backend.report().to_dict()["graphs"] for c in g["kernel_choices"]]


def qkv(dtype=torch.float32, hkv=H, grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    k = torch.randn(B, hkv, T, D, generator=g, dtype=dtype)
    v = torch.randn(B, hkv, T, D, generator=g, dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def check(fn, args, *, train=True, fusions=1, atol=1e-5, rtol=1e-4, options=None):
    """Compile ``fn`` with enn; values (and gradients) equal eager; ``fusions`` matches counted."""
    ref = fn(*args)
    cf = torch.compile(fn, backend="enn", options=options or {})
    if train:
        out = cf(*args)
        wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        gout = torch.randn_like(ref)
        g_ref = torch.autograd.grad(ref, wrt, gout)
        g = torch.autograd.grad(out, wrt, gout)
        for a, b in zip(g, g_ref):
            torch.testing.assert_close(a, b, atol=atol, rtol=rtol, equal_nan=True)
    else:
        with torch.no_grad():
            out = cf(*args)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol, equal_nan=True)
    assert fused() == fusions, enn_backend.report()
    return out


# ----------------------------------------------------------------------------- the op
def test_opcheck():
    q, k, v = qkv(hkv=2)
    bias = torch.randn(1, H, T, T, requires_grad=True)
    mask = torch.rand(B, 1, 1, T, generator=torch.Generator().manual_seed(0)) > 0.3
    mask[..., ::2] = True  # every 3-key window keeps a key: no all-masked (NaN) row, which opcheck cannot compare
    for backend in ("explicit", "cpu_flash"):
        for b, m, causal, window in ((None, None, True, 0), (bias, None, False, 0), (None, mask, False, 3)):
            torch.library.opcheck(torch.ops.enn.attention.default,
                                  (q, k, v, b, m, None, 0.3, causal, window, 0.0, "eager", backend))


def test_op_alibi_and_window_match_reference():
    q, k, v = qkv(grad=False)
    slopes = torch.rand(H)
    out, _ = torch.ops.enn.attention(q, k, v, None, None, slopes, 0.25, True, 3, 0.0, "eager", "cpu_flash")
    i, j = torch.arange(T).view(T, 1), torch.arange(T).view(1, T)
    s = q @ k.transpose(-1, -2) * 0.25 + slopes.view(H, 1, 1) * (j - i)
    s = s.masked_fill(~((j <= i) & (i - j < 3)), float("-inf"))
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- pattern families
def causal_tril(q, k, v):
    t = q.size(-2)
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
    att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
    att = att.masked_fill(~mask, float("-inf"))
    return F.softmax(att, dim=-1) @ v


def causal_triu_where_min(q, k, v):
    t = q.size(-2)
    upper = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    att = torch.matmul(q * (1.0 / math.sqrt(q.size(-1))), k.transpose(-1, -2))
    att = torch.where(upper, torch.finfo(att.dtype).min, att)
    return torch.softmax(att, dim=-1) @ v


def causal_arange(q, k, v):
    t = q.size(-2)
    keep = torch.arange(t)[:, None] >= torch.arange(t)[None, :]
    att = torch.matmul(q, k.transpose(-1, -2)) * 0.3
    att = att.masked_fill(keep.logical_not(), float("-inf"))
    return att.softmax(-1) @ v


def sliding_window(q, k, v):
    t = q.size(-2)
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    band = (j <= i) & (i - j < 3)
    att = (q @ k.transpose(-2, -1)) * 0.5
    att = att.masked_fill(~band, float("-inf"))
    return torch.softmax(att, -1) @ v


def scale_q_div(q, k, v):
    att = (q / math.sqrt(q.size(-1))) @ k.transpose(-2, -1)
    t = q.size(-2)
    att = att.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
    return torch.softmax(att, dim=-1) @ v


FAMILIES = {
    "causal_tril": causal_tril,
    "causal_triu_where_finfo_min": causal_triu_where_min,
    "causal_arange": causal_arange,
    "sliding_window": sliding_window,
    "scale_before_div": scale_q_div,
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_training(name):
    check(FAMILIES[name], qkv())
    assert all(c["causal"] for c in choices())
    if name == "sliding_window":
        assert choices()[0]["window"] == 3


@pytest.mark.parametrize("name", ["causal_tril", "sliding_window"])
def test_family_inference(name):
    check(FAMILIES[name], qkv(grad=False), train=False)


def padding_bias(q, k, v, pad):
    att = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1)) + (1.0 - pad[:, None, None, :]) * -10000.0
    return att.softmax(-1) @ v


def learned_bias(q, k, v, bias):
    att = torch.matmul(q, k.transpose(-1, -2)) * 0.35 + bias
    return F.softmax(att.float(), dim=-1).to(q.dtype) @ v


def bool_padding_neg_inf(q, k, v, keep):
    att = torch.matmul(q, k.transpose(-1, -2)) * 0.35
    att = att.masked_fill(~keep[:, None, None, :], float("-inf"))
    return torch.softmax(att, -1) @ v



def test_additive_padding_mask():
    pad = torch.ones(B, T)
    pad[1, 5:] = 0
    check(padding_bias, (*qkv(), pad))


def finfo_min_padding(q, k, v, pad):
    """HF's padding mask: ``(1 - mask) * finfo.min`` added to the scores."""
    att = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1)) + (1.0 - pad[:, None, None, :]) * torch.finfo(q.dtype).min
    return att.softmax(-1) @ v


@pytest.mark.parametrize("order", ["flash", "explicit"])
def test_saturated_rows_of_a_finfo_min_mask(order, monkeypatch):
    """A sequence that is all padding: every score of its rows is absorbed by ``finfo.min``, so
    eager's softmax is uniform over the keys -- finite, and not the kernel's business to change.
    The CPU flash kernel (emitted directly) recomputes P from the saved log-sum-exp, which rounds
    to the bias: enn divides those rows' incoming gradient by the key count. The explicit math
    computes softmax as eager does. Values and gradients equal eager's either way."""
    monkeypatch.setenv("ENN_ATTENTION_ORDER", order)
    pad = torch.ones(B, T)
    pad[0, :] = 0  # batch 0: all padding
    pad[1, 5:] = 0
    out = check(finfo_min_padding, (*qkv(), pad))
    assert torch.isfinite(out).all()
    assert choices()[0]["choice"] == ("cpu_flash" if order == "flash" else "explicit")


def test_saturated_counts():
    fb = torch.tensor([[0.0, -3e38, 0.0], [-3e38, -3e38, -3e38], [-3e38, -3e38, float("-inf")],
                       [float("-inf")] * 3, [-1.0, -2e30, -5.0], [-3e38, -2e30, -3e38]])
    # the last row: every key is at or below SATURATED, which kernel_bias gives one value
    assert A.saturated_counts(fb).flatten().tolist() == [1.0, 3.0, 2.0, 1.0, 1.0, 3.0]


def as_pre_pass():
    """Install enn's attention pass as Inductor's joint *pre* pass (before Inductor's patterns)."""
    from enn_backend.options import Options
    from enn_backend.passes import PassManager
    from enn_backend.passes.attention import AttentionPass

    return torch._inductor.config.patch(joint_custom_pre_pass=PassManager(Options.from_sources(), "pre", "joint", [AttentionPass]))


def test_additive_padding_mask_as_pre_pass():
    pad = torch.ones(B, T)
    pad[1, 5:] = 0
    with as_pre_pass():
        check(padding_bias, (*qkv(), pad))


def test_bert_as_pre_pass():
    torch.manual_seed(0)
    model, ref_model = Stack(BertSelfAttention), Stack(BertSelfAttention)
    ref_model.load_state_dict(model.state_dict())
    x, m = torch.randn(2, 8, 32), torch.ones(2, 8)
    m[1, 6:] = 0
    ref_model(x, m).pow(2).mean().backward()
    with as_pre_pass():
        torch.compile(model, backend="enn")(x, m).pow(2).mean().backward()
    for p, p_ref in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-5, rtol=1e-4)
    assert fused() == 2


def test_learned_bias_with_gradient():
    bias = (0.1 * torch.randn(1, H, T, T)).requires_grad_(True)
    check(learned_bias, (*qkv(), bias))
    assert choices()[0]["choice"] == "explicit"  # CPU flash gives no bias gradient


def test_bool_padding_mask_and_fully_masked_rows():
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, 4:] = False
    keep[0, :] = False  # batch 0: every key masked -> eager gives NaN rows
    out = check(bool_padding_neg_inf, (*qkv(), keep))
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1]).all()


def test_fully_masked_rows_zero_option():
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[0, :] = False
    q, k, v = qkv(grad=False)
    cf = torch.compile(bool_padding_neg_inf, backend="enn", options={"masked_rows": "zero"})
    out = cf(q, k, v, keep)
    assert fused() == 1
    assert (out[0] == 0).all()
    torch.testing.assert_close(out[1], bool_padding_neg_inf(q, k, v, keep)[1])


def test_bf16_softmax_in_fp32_inference():
    bias = torch.zeros(1, H, T, T, dtype=torch.bfloat16)
    check(learned_bias, (*qkv(torch.bfloat16, grad=False), bias), train=False, atol=2e-2, rtol=2e-2)


def gqa_repeat_interleave(q, k, v):
    n_rep = q.size(1) // k.size(1)
    k = k.repeat_interleave(n_rep, dim=1)
    v = v.repeat_interleave(n_rep, dim=1)
    t = q.size(-2)
    att = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    att = att.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    return att.softmax(-1) @ v


def test_gqa_repeat_interleave():
    check(gqa_repeat_interleave, qkv(hkv=2))
    assert choices()[0]["gqa"]


# ----------------------------------------------------------------------------- near misses
def softmax_over_queries(q, k, v):
    # (without the mask, Inductor's own fuse_attention rewrites this to SDPA on 2.13 and gets it
    # wrong: it does not check the softmax axis; see the report)
    t = q.size(-2)
    att = (q @ k.transpose(-1, -2) * 0.3).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return att.softmax(-2) @ v


def dropout_between(q, k, v):
    att = (q @ k.transpose(-1, -2) * 0.3).softmax(-1)
    return F.dropout(att, 0.5, training=True) @ v


def intermediate_reused(q, k, v):
    p = (q @ k.transpose(-1, -2) * 0.3).softmax(-1)
    return p @ v, p.sum()


def exp_not_softmax(q, k, v):
    att = torch.exp(q @ k.transpose(-1, -2) * 0.3)
    return att @ v


@pytest.mark.parametrize("fn", [softmax_over_queries, intermediate_reused, exp_not_softmax])
def test_near_miss_not_fused(fn):
    args = qkv(grad=False)
    ref = fn(*args)
    with torch.no_grad():
        out = torch.compile(fn, backend="enn")(*args)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert fused() == 0


def test_dropout_not_fused():
    torch.compile(dropout_between, backend="enn")(*qkv())
    assert fused() == 0


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


@pytest.mark.parametrize("kind", ["gpt2", "bert",
                                  "llama"])
def test_hf_style_models(kind):
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
    loss_ref = ref_model(x, *extra).pow(2).mean()
    loss_ref.backward()
    loss = torch.compile(model, backend="enn")(x, *extra).pow(2).mean()
    loss.backward()
    torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5)
    for (name, p), p_ref in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-5, rtol=1e-4, msg=name)
    assert fused() == 2, enn_backend.report()


# ----------------------------------------------------------------------------- policy
def problem(**kw):
    base = dict(device="cuda", capability=(9, 0), dtype="bfloat16", head_dim=64, head_dim_v=64, tq=1024, tk=1024,
                heads_q=16, heads_kv=16, causal=True, window=0, has_mask=False, has_bias=False, bias_grad=False,
                alibi=False, training=True)
    base.update(kw)
    return AttentionProblem(**base)


def test_policy_choices():
    assert choose(problem()).backend == "cudnn"
    assert choose(problem(capability=(8, 0))).backend == "flash"
    assert choose(problem(dtype="float32")).backend == "efficient"
    assert choose(problem(has_mask=True, causal=False)).backend == "inductor"  # measured faster than SDPA with a mask
    assert choose(problem(has_mask=True, causal=False), backend="efficient").backend == "efficient"
    assert choose(problem(alibi=True)).backend == "flex"  # FlexAttention ops in the graph
    assert choose(problem(window=64)).backend == "flex"
    assert choose(problem(alibi=True, static_shapes=False)).backend == "inductor"  # flex needs fixed lengths
    assert choose(problem(), order="flash,cudnn").backend == "flash"
    cpu = dict(device="cpu", capability=(0, 0))
    assert choose(problem(**cpu)).backend == "inductor"  # training: Inductor measured faster
    assert choose(problem(**cpu, training=False)).backend == "cpu_flash"  # causal inference: flash faster
    assert choose(problem(**cpu, training=False, causal=False)).backend == "cpu_flash"
    for masked in (dict(has_mask=True), dict(has_bias=True), dict(alibi=True), dict(window=16)):
        assert choose(problem(**cpu, training=False, **masked)).backend == "inductor", masked
    assert choose(problem(device="cpu", capability=(0, 0)), order="flash").backend == "cpu_flash"
    assert choose(problem(device="cpu", capability=(0, 0), tq=8, tk=8)).backend == "inductor"
    assert choose(problem(device="cpu", capability=(0, 0), bias_grad=True, has_bias=True)).backend == "explicit"
    forced = choose(problem(device="cpu", capability=(0, 0)), backend="cudnn")
    assert forced.backend == "cpu_flash" and "cudnn impossible" in forced.forced_failed  # a forced kernel stays fused


def test_policy_sends_saturating_biases_to_the_memory_efficient_kernel_except_in_fp16():
    """A finfo.min bias can mask a whole row. In bf16 / fp32 the kernel gets SATURATED_FLOOR
    there and gives eager's uniform row; fp16 cannot hold a bias that absorbs the scores, so
    there the policy leaves such attention to Inductor (a -10000 mask cannot saturate)."""
    from enn_backend.passes.attention.kernels.sdpa import check_efficient

    base = dict(device="cuda", capability=(9, 0), head_dim=64, head_dim_v=64, tq=512, tk=512,
                heads_q=12, heads_kv=12, causal=False, window=0, has_mask=False, has_bias=True, bias_grad=False,
                alibi=False, training=True, bias_finite=True)
    for dtype in ("bfloat16", "float32"):
        assert choose(AttentionProblem(**base, dtype=dtype)).backend == "efficient"
        assert choose(AttentionProblem(**base, dtype=dtype, bias_may_saturate=True)).backend == "efficient"
    assert choose(AttentionProblem(**base, dtype="float16")).backend == "efficient"
    saturating = AttentionProblem(**base, dtype="float16", bias_may_saturate=True)
    assert choose(saturating).backend == "inductor"
    ok, why = check_efficient(saturating)
    assert not ok and "fp16" in why


def test_kernel_bias_floors_saturating_values():
    """What a kernel receives: -inf stays, values at or below SATURATED become SATURATED_FLOOR
    (bf16 / fp32), fp16 clamps to its range; ordinary values pass unchanged."""
    fb = torch.tensor([0.0, -5.0, -2e30, torch.finfo(torch.float32).min, float("-inf")])
    for dtype in (torch.float32, torch.bfloat16):
        got = A.kernel_bias(fb, dtype)
        assert got.dtype == dtype
        assert got.float().tolist() == [0.0, -5.0, A.SATURATED_FLOOR, A.SATURATED_FLOOR, float("-inf")]
    half = A.kernel_bias(fb, torch.float16).float().tolist()
    assert half == [0.0, -5.0, -65504.0, -65504.0, float("-inf")]


def test_forced_impossible_backend_is_recorded():
    check(causal_tril, qkv(grad=False), train=False, options={"attention_backend": "flash"})
    check_choice = choices()[0]["choice"]
    assert check_choice == "cpu_flash"
    enn_backend.reset()
    torch._dynamo.reset()
    check(causal_tril, qkv(grad=False), train=False, options={"attention_backend": "cudnn"})
    kinds = [f["kind"] for f in enn_backend.report().to_dict()["fallbacks"]]
    assert "kernel_choice" in kinds
    assert choices()[0]["choice"] == "cpu_flash"  # a user who names a kernel wants attention fused


def test_tiny_cpu_attention_left_to_inductor(monkeypatch):
    monkeypatch.delenv("ENN_ATTENTION_ORDER")
    check(causal_tril, qkv(grad=False), train=False, fusions=0)
    assert choices()[0]["choice"] == "inductor" and choices()[0]["fused"] is False


def test_explicit_backend_forced():
    check(causal_tril, qkv(), options={"attention_backend": "explicit"})
    assert choices()[0]["choice"] == "explicit"


# ----------------------------------------------------------------------------- fault injection
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


def alibi_causal(q, k, v, slopes):
    t = q.size(-2)
    pos = torch.arange(t)
    rel = (pos[None, :] - pos[:, None]).float()
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1))) + slopes.view(1, -1, 1, 1) * rel
    att = att.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool)), float("-inf"))
    return F.softmax(att, dim=-1) @ v


def test_alibi_from_slopes():
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)])
    check(alibi_causal, (*qkv(), slopes))
    c = choices()[0]
    assert c["alibi"] and c["causal"] and not c["bias"]


def test_runtime_causal_buffer_becomes_is_causal_and_a_changed_buffer_is_rechecked():
    from enn_backend.custom_ops.attention import normalize_mask

    q = torch.randn(1, 2, 8, 4)
    buf = torch.ones(8, 8, dtype=torch.bool).tril().view(1, 1, 8, 8)
    assert normalize_mask(q, q, buf, False, 0) == (None, True)
    assert normalize_mask(q, q, buf, False, 0) == (None, True)  # cached
    buf[0, 0, 0, 5] = True  # an in-place write bumps the version: checked again
    mask, causal = normalize_mask(q, q, buf, False, 0)
    assert mask is buf and causal is False
    pad = torch.ones(1, 1, 1, 8, dtype=torch.bool)
    assert normalize_mask(q, q, pad, False, 0)[0] is pad  # not a square structural mask: untouched


def test_dynamic_shapes_keep_causal_structure_without_recompiles():
    def causal_dyn(q, k, v):
        t = q.size(-2)
        keep = torch.tril(torch.ones(t, t, dtype=torch.bool))
        att = (q @ k.transpose(-1, -2)) * 0.25
        return att.masked_fill(~keep, float("-inf")).softmax(-1) @ v

    f = torch.compile(causal_dyn, backend="enn", dynamic=True)
    for t in (9, 13, 21):
        q, k, v = (torch.randn(1, 2, t, 8) for _ in range(3))
        torch.testing.assert_close(f(q, k, v), causal_dyn(q, k, v), atol=1e-5, rtol=1e-4)
    rep = enn_backend.report().to_dict()
    assert len({g["unit"] for g in rep["graphs"]}) == 1
    choices = [c for g in rep["graphs"] for c in g["kernel_choices"]]
    assert choices and all(c["causal"] and not c["mask"] for c in choices), choices


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_efficient_kernel_on_saturated_rows(dtype):
    """On a row whose every key is at finfo.min eager's softmax is uniform. SDPA's
    memory-efficient kernel given finfo.min is not (it overflows to -inf and reads the row as
    fully masked); given kernel_bias's SATURATED_FLOOR it is, and its backward with the
    incoming gradient divided by saturated_counts gives eager's gradients (measured with
    bench/gpu_saturated_rows.py). If a torch update changes either, this fails."""
    torch.manual_seed(0)
    b, h, t, d, pad = 2, 4, 64, 64, 20
    q, k, v, g = (torch.randn(b, h, t, d, device="cuda", dtype=dtype) for _ in range(4))
    keep = torch.ones(b, 1, t, t, dtype=torch.bool, device="cuda").tril()
    keep[1, :, :, :pad] = False  # batch 1 is left-padded: its first rows see only padding
    bias = torch.zeros(b, 1, t, t, device="cuda").masked_fill(~keep, torch.finfo(torch.float32).min)
    qq, kk, vv = (x.float().requires_grad_() for x in (q, k, v))
    want = torch.softmax(qq @ kk.transpose(-1, -2) * d ** -0.5 + bias, -1) @ vv
    want_grads = torch.autograd.grad(want, (qq, kk, vv), g.float())
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention
    raw = efficient(q, k, v, bias.clamp_min(torch.finfo(dtype).min).to(dtype).expand(b, h, t, t), False, 0.0,
                    False, scale=d ** -0.5)[0]
    assert (raw[1, :, :pad].float() - want[1, :, :pad]).abs().max() > 1e-2  # finfo.min: wrong rows

    kb = A.kernel_bias(bias, dtype).expand(b, h, t, t)
    out, lse, seed, offset = efficient(q, k, v, kb, True, 0.0, False, scale=d ** -0.5)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.float(), want, **tol)
    gg = (g.float() / A.saturated_counts(kb.float())).to(dtype)
    grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        gg, q, k, v, kb, out, lse, seed, offset, 0.0, [True, True, True, False], False, scale=d ** -0.5)[:3]
    for got, w in zip(grads, want_grads):
        torch.testing.assert_close(got.float(), w, **tol)


def test_saturated_rows_under_bf16_autocast():
    """The same all-padding rows under CPU bf16 autocast, through enn::attention's CPU flash
    backend in bf16 (the float pad is not provably finite, so the op, not the emitted kernel,
    runs; it floors the mask with kernel_bias and divides saturated rows' gradient by their key
    count): eager's uniform rows and gradients. This kernel also handles bf16 finfo.min; the
    CUDA kernel that does not is pinned by test_efficient_kernel_on_saturated_rows."""
    pad = torch.ones(B, T)
    pad[0, :] = 0  # batch 0: all padding
    pad[1, 5:] = 0
    q, k, v = qkv()
    gout = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1))

    def run(fn):
        with torch.autocast("cpu", torch.bfloat16):
            out = fn(q, k, v, pad)
        return out.float(), torch.autograd.grad(out, (q, k, v), gout.to(out.dtype))

    want, want_grads = run(finfo_min_padding)
    got, got_grads = run(torch.compile(finfo_min_padding, backend="enn", options={"attention_backend": "flash"}))
    assert choices()[0]["choice"] == "cpu_flash", choices()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2)


def _int_padding(fill):
    def attend(q, k, v, pad):  # pad: an integer attention mask (1 keep, 0 pad), as HF passes it
        att = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1)) + (1.0 - pad[:, None, None, :].to(q.dtype)) * fill
        return att.softmax(-1) @ v
    return attend


@pytest.mark.parametrize("fill", [-10000.0, torch.finfo(torch.float32).min], ids=["-10000", "finfo.min"])
def test_report_says_when_a_mask_is_floored(fill):
    """An integer padding mask scaled by a finite fill is provably finite: the pass emits the
    kernel itself. The report says when the kernel gets the finfo.min-sized values as -2**100
    (and not for a -10000 mask, which cannot saturate a row)."""
    pad = torch.ones(B, T, dtype=torch.long)
    pad[1, 5:] = 0
    if fill < -1e30:
        # batch 0 all padding: saturated rows. (With -10000 such a row keeps its scores, rounded
        # at 10000's ulp; the kernel's backward recomputes P from a log-sum-exp of that size and
        # differs from eager by ~5e-4 relative there, more than this test's fp32 tolerance.)
        pad[0, :] = 0
    check(_int_padding(fill), (*qkv(), pad))
    reason = choices()[0]["reason"]
    assert "emitted as the ATen kernel itself" in reason, reason
    assert ("-2**100" in reason) == (fill < -1e30), reason


def test_a_site_left_to_inductor_is_reported_once(monkeypatch):
    """The pass runs before and after Inductor's joint passes; a site it leaves to Inductor (and
    that Inductor does not rewrite in between) is met twice, and reported once."""
    monkeypatch.delenv("ENN_ATTENTION_ORDER")  # the default policy: tiny CPU attention stays with Inductor
    def attend(q, k, v, bias):  # T5's form (no scale): Inductor's own fuse_attention leaves it alone
        return (q @ k.transpose(-1, -2) + bias).softmax(-1) @ v

    bias = torch.randn(B, 1, T, T)
    with torch.no_grad():
        torch.compile(attend, backend="enn")(*qkv(), bias)
    assert [c["choice"] for c in choices()] == ["inductor"], choices()
