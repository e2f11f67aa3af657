"""Attention with dropout on the probabilities: fused with the kernel's own dropout.

The fused kernel draws its own mask, so with dropout on the results equal eager's in
distribution, not bitwise: the tests compare statistics over many draws. With dropout off
(p = 0, eval mode) values and gradients are eager's, as without a dropout. Near misses (a dropout
on the scores, a mask that is not a fresh draw, another scale) stay as written, with the reason
in the report. CPU, tiny shapes, pass harness; the CUDA test runs on a GPU only.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import enn_backend
from attention_cases import BACKEND, CPU_FLASH, MASKED_ROWS, UNFUSED, aten, enn, fused
from enn_backend.custom_ops.attention import Backend
from enn_backend.custom_ops.attention.masks import dropout_scale
from enn_backend.passes.attention.policy import choose
from enn_backend.passes.attention.problem import AttentionProblem
from pass_harness import assert_ops, find_ops, run_passes

DROPOUT, SEED = 9, 12  # enn::attention's dropout_p and seed arguments
P = 0.1
B, H, T, D = 1, 2, 8, 4  # D != T: a (..., T, T) tensor is a probability-sized one
DRAWS = 200
Z = 5.0  # bound on each |z| below: P(|N(0, 1)| > 5) = 5.7e-7, at most 12 statistics per comparison


@pytest.fixture(autouse=True)
def _fuse_tiny(monkeypatch):
    """Tiny CPU attention is left to Inductor by default; this order makes enn fuse it (the CPU
    flash kernel has no dropout: enn's explicit math takes it)."""
    monkeypatch.setenv("ENN_ATTENTION_ORDER", "flash,explicit")


def attend_dropout(q, k, v, p=P):
    att = (q @ k.transpose(-1, -2) * 0.7).softmax(-1)
    return F.dropout(att, p, training=True) @ v


def attend_no_scaling(q, k, v):
    """Dropout without its 1 / (1 - p): what a broken dropout computes (the statistics must see it)."""
    return attend_dropout(q, k, v) * (1.0 - P)


class DropoutModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout(P)

    def forward(self, q, k, v):
        return self.drop((q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))).softmax(-1)) @ v


def qkv(grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g).requires_grad_(grad) for _ in range(3)]


def skipped() -> list[str]:
    return [f["reason"] for f in enn_backend.report().to_dict()["fallbacks"] if f["kind"] == "pass_skipped"]


def no_square_tensor(graph, t=T):
    """No probability-sized tensor (..., T, T) is left: no probabilities, no dropout mask or draw."""
    left = [n.name for n in graph.nodes if isinstance(x := n.meta.get("val"), torch.Tensor)
            and x.dim() >= 2 and tuple(x.shape[-2:]) == (t, t)]
    assert not left, f"T x T tensors left: {left}"


# ----------------------------------------------------------------------------- structure
@pytest.mark.parametrize("fn", [attend_dropout, DropoutModule().train()], ids=["F.dropout", "nn.Dropout"])
def test_dropout_site_is_fused_with_its_p(fn):
    run = run_passes(fn, qkv(), ["attention"])
    assert run.matches == {"attention": 1}
    assert_ops(run.after, present=[enn.attention, enn.attention_backward], absent=UNFUSED + [aten.rand])
    fwd, bwd = find_ops(run.after, enn.attention)[0], find_ops(run.after, enn.attention_backward)[0]
    assert fwd.args[DROPOUT] == P and fwd.args[BACKEND] == "explicit"
    seed = fwd.args[SEED]  # aten.randint, Inductor's inductor_randint after its joint passes
    assert "randint" in str(seed.target) and bwd.args[-1] is seed and bwd.args[-2] == P  # one draw, read twice
    assert not [n for n in run.after.nodes if "random" in str(n.target)], "the graph's own draw is left"
    no_square_tensor(run.after)
    (c,) = run.choices
    assert c["dropout"] == P and "not bitwise" in c["reason"], c


def test_cpu_flash_refuses_dropout_explicit_takes_it():
    problem = AttentionProblem(device="cpu", capability=(0, 0), dtype="float32", head_dim=64, head_dim_v=64,
                               tq=512, tk=512, heads_q=4, heads_kv=4, causal=True, window=0, has_mask=False,
                               has_bias=False, bias_grad=False, alibi=False, training=True, dropout=P)
    c = choose(problem, "flash")
    assert c.backend is Backend.EXPLICIT and "no dropout" in c.forced_failed, c


@pytest.mark.parametrize("capability,dtype,want", [((9, 0), "bfloat16", Backend.FLASH),
                                                   ((8, 0), "bfloat16", Backend.FLASH),
                                                   ((9, 0), "float32", Backend.EFFICIENT)])
def test_cuda_dropout_goes_to_a_kernel_with_dropout(capability, dtype, want):
    """cuDNN is not handed dropout (wrong in cuDNN 9.11-9.13); SDPA math would run inside
    enn::attention, whose recompute backward would draw a second mask."""
    problem = AttentionProblem(device="cuda", capability=capability, dtype=dtype, head_dim=64, head_dim_v=64,
                               tq=1024, tk=1024, heads_q=12, heads_kv=12, causal=True, window=0, has_mask=False,
                               has_bias=False, bias_grad=False, alibi=False, training=True, dropout=P)
    assert choose(problem).backend is want
    if capability >= (9, 0) and dtype == "bfloat16":
        assert "cuDNN 9.11" in choose(problem, "cudnn").forced_failed
    assert "draw" in choose(problem, "math").forced_failed
    masked = AttentionProblem(**{**problem.__dict__, "has_mask": True})
    assert "ATen op" in choose(masked, "efficient").forced_failed


def test_op_backward_redraws_the_forwards_mask():
    """enn::attention with dropout: out and gradients are those of eager math with the mask the
    seed gives (dropout_scale), so the backward drew the forward's mask again."""
    q, k, v = qkv(grad=True)
    seed = torch.tensor(77)
    out, _ = torch.ops.enn.attention(q, k, v, None, None, None, 0.5, True, 0, 0.25, "eager", "explicit", seed)
    scale = dropout_scale(q, k, 0.25, seed)
    torch.testing.assert_close(scale.unique(), torch.tensor([0.0, 1 / 0.75]))
    keep = torch.ones(T, T, dtype=torch.bool).tril()
    ref = ((q @ k.transpose(-1, -2) * 0.5).masked_fill(~keep, float("-inf")).softmax(-1) * scale) @ v
    g = torch.randn_like(out)
    torch.testing.assert_close(out, ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b)


def test_op_refuses_dropout_it_cannot_draw():
    q, k, v = qkv(grad=False)
    with pytest.raises(ValueError, match="needs backend 'explicit' and an integer seed"):
        torch.ops.enn.attention(q, k, v, None, None, None, 0.5, False, 0, 0.1, "eager", "cpu_flash", torch.tensor(1))
    with pytest.raises(ValueError, match="needs backend 'explicit' and an integer seed"):
        torch.ops.enn.attention(q, k, v, None, None, None, 0.5, False, 0, 0.1, "eager", "explicit")


# ----------------------------------------------------------------------------- dropout off: exact
@pytest.mark.parametrize("fn,train", [(lambda q, k, v: attend_dropout(q, k, v, 0.0), True),
                                      (DropoutModule().eval(), True), (DropoutModule().eval(), False)],
                         ids=["p=0", "eval", "eval-inference"])
def test_dropout_off_is_exact(fn, train):
    run = fused(fn, qkv(grad=train), train=train)  # values (and gradients) equal eager's
    (node,) = find_ops(run.after, CPU_FLASH)  # as without a dropout: the CPU flash kernel takes it
    assert node.args[3] == 0.0 and run.choices[0]["dropout"] == 0.0


def safe_softmax_attention(q, k, v, keep):
    """SDPA's math path (a model's SDPA call where no kernel takes it, e.g. with dropout on CPU):
    the safe softmax gives 0 in a row whose every score is -inf."""
    s = (q @ k.transpose(-1, -2) * 0.5).masked_fill(~keep, float("-inf"))
    return torch.ops.aten._safe_softmax(s, -1) @ v


def test_safe_softmax_rows_masked_whole_are_zero():
    keep = torch.rand(B, 1, T, T, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[0, :, 2] = False  # query row 2 keeps no key: 0 in eager, with no gradient through it
    run = fused(safe_softmax_attention, [*qkv(), keep])
    assert find_ops(run.after, enn.attention)[0].args[MASKED_ROWS] == "zero"


# ----------------------------------------------------------------------------- dropout on: statistics
def draws(fn, args, seed0, grad_out):
    """DRAWS runs of ``fn`` (torch.manual_seed(seed0 + i) before each): per tensor (output, dq, dk,
    dv) a [DRAWS, numel] float64 tensor."""
    got: dict[str, list] = {"out": [], "dq": [], "dk": [], "dv": []}
    for i in range(DRAWS):
        torch.manual_seed(seed0 + i)
        out = fn(*args)
        grads = torch.autograd.grad(out, args, grad_out)
        for name, t in zip(got, (out, *grads)):
            got[name].append(t.detach().double().flatten().cpu())
    return {name: torch.stack(ts) for name, ts in got.items()}


def _z_mean(a: torch.Tensor, b: torch.Tensor) -> float:
    """Welch's z of the difference of two means (one sample per draw)."""
    return float((a.mean() - b.mean()) / torch.sqrt(a.var() / len(a) + b.var() / len(b)))


def _z_var(a: torch.Tensor, b: torch.Tensor) -> float:
    """z of the difference of two variances; var(s^2) ~ (m4 - s^4) / n."""
    def est(x):
        s2 = x.var()
        return s2, ((x - x.mean()) ** 4).mean() - s2 ** 2
    (va, wa), (vb, wb) = est(a), est(b)
    return float((va - vb) / torch.sqrt(wa / len(a) + wb / len(b)))


def zs(a: dict, b: dict) -> dict[str, float]:
    """Per tensor, three statistics of independent draws, each |z| ~ |N(0, 1)| when both sides
    have one distribution: the mean and the variance of a fixed random projection, and the mean
    of the squared norm (which also sees a wrong scale of the whole tensor)."""
    out = {}
    for name in a:
        w = torch.randn(a[name].shape[1], generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        pa, pb = a[name] @ w, b[name] @ w
        out[f"{name} mean"] = _z_mean(pa, pb)
        out[f"{name} var"] = _z_var(pa, pb)
        out[f"{name} |x|^2"] = _z_mean((a[name] ** 2).sum(1), (b[name] ** 2).sum(1))
    return out


def test_dropout_statistics_match_eager():
    """Over DRAWS draws each, enn's outputs and q / k / v gradients have eager's mean and variance
    (12 statistics, each within Z standard errors); the same comparison tells eager from a dropout
    without its 1 / (1 - p) scaling, so it can fail."""
    args = qkv()
    grad_out = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(3))
    run = run_passes(attend_dropout, args, ["attention"])
    assert run.matches == {"attention": 1}
    fused_draws = draws(run.compiled, args, 0, grad_out)
    eager_draws = draws(attend_dropout, args, 10_000, grad_out)
    # Each alone, the gradients of a backward that drew another mask than the forward would have
    # the right distribution; per draw <out, g> = <(P*D) V, g> = <V, (P*D)^T g> = <V, dV> holds
    # only with the forward's mask D.
    v, g = args[2].detach().double().flatten(), grad_out.double().flatten()
    torch.testing.assert_close(fused_draws["out"] @ g, fused_draws["dv"] @ v, rtol=1e-5, atol=1e-5)  # fp32 sums
    z = zs(fused_draws, eager_draws)
    assert max(abs(x) for x in z.values()) < Z, z
    broken = zs(draws(attend_no_scaling, args, 20_000, grad_out), eager_draws)
    assert max(abs(x) for x in broken.values()) > Z, broken


def test_dropout_keep_rate_and_scale():
    """With V the identity the output is the dropped probabilities themselves: each is 0 or
    P / (1 - p), and the kept fraction over DRAWS * B * H * T * T independent Bernoulli(1 - p)
    draws is 1 - p within Z binomial standard errors."""
    q, k, _ = qkv()
    v = torch.eye(T).expand(B, H, T, T).clone().requires_grad_()
    run = run_passes(attend_dropout, [q, k, v], ["attention"])
    assert run.matches == {"attention": 1}
    with torch.no_grad():
        probs = (q @ k.transpose(-1, -2) * 0.7).softmax(-1)
    kept = 0
    for i in range(DRAWS):
        torch.manual_seed(i)
        out = run.compiled(q, k, v).detach()
        keep = out != 0
        torch.testing.assert_close(out[keep], (probs / (1 - P))[keep], rtol=1e-5, atol=1e-6)
        kept += int(keep.sum())
    n = DRAWS * B * H * T * T
    assert abs(kept / n - (1 - P)) < Z * math.sqrt(P * (1 - P) / n), kept / n


# ----------------------------------------------------------------------------- near misses: not fused, with a reason
def dropout_on_scores(q, k, v):
    return F.dropout(q @ k.transpose(-1, -2) * 0.7, P, training=True).softmax(-1) @ v


def mask_from_an_input(q, k, v, keep):
    return ((q @ k.transpose(-1, -2) * 0.7).softmax(-1) * keep * (1 / (1 - P))) @ v


def one_draw_per_row(q, k, v):
    att = (q @ k.transpose(-1, -2) * 0.7).softmax(-1)
    return (att * (torch.rand(att.shape[:-1] + (1,)) > P) * (1 / (1 - P))) @ v


def wrong_scale(q, k, v):
    att = (q @ k.transpose(-1, -2) * 0.7).softmax(-1)
    return (att * (torch.rand_like(att) > P) * 2.0) @ v


@pytest.mark.parametrize("fn,extra,why", [
    (dropout_on_scores, (), "random draw"),
    (mask_from_an_input, (torch.rand(B, H, T, T) > P,), "not a dropout's fresh random draw"),
    (one_draw_per_row, (), "not one fresh draw per probability"),
    (wrong_scale, (), "not 1 / (1 - p)"),
], ids=["on-scores", "input-mask", "per-row-draw", "wrong-scale"])
def test_dropout_near_miss_is_not_fused_and_says_why(fn, extra, why):
    run = run_passes(fn, [*qkv(), *extra], ["attention"])
    assert run.matches == {"attention": 0}
    assert_ops(run.after, present=[aten.bmm], absent=[enn.attention])
    (reason,) = skipped()  # one line per site, though the pass runs at two stages
    assert why in reason, reason


def test_softmax_over_another_axis_says_why_once():
    run = run_passes(lambda q, k, v: (q @ k.transpose(-1, -2)).softmax(-2) @ v, qkv(), ["attention"])
    assert run.matches == {"attention": 0}
    (reason,) = skipped()  # the site is there at both stages of the pass: one line
    assert "not the key axis" in reason, reason


# ----------------------------------------------------------------------------- CUDA (run on a GPU)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dropout_in_the_sdpa_kernel():
    """fp16 on CUDA: the site becomes SDPA's flash (or, below sm80, memory-efficient) ATen kernel
    with dropout_p = 0.1 in its forward and backward (the backward redrawing the forward's mask
    from its philox seed / offset); its statistics match eager's."""
    t, d = 16, 8  # head dim a multiple of 8 (both kernels), != T
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(B, H, t, d, generator=g).to("cuda", torch.float16).requires_grad_() for _ in range(3)]
    grad_out = torch.randn(B, H, t, d, generator=g).to("cuda", torch.float16)
    run = run_passes(attend_dropout, args, ["attention"], options={"attention_order": "cudnn,flash,efficient"})
    assert run.matches == {"attention": 1}
    (c,) = run.choices
    assert c["choice"] in ("flash", "efficient") and c["dropout"] == P, c
    kernels = [n for n in run.after.nodes if str(n.target).startswith("aten._scaled_dot_product_")]
    assert len(kernels) == 2 and all(P in n.args for n in kernels), [(n.target, n.args) for n in kernels]
    no_square_tensor(run.after, t)
    fused_draws = draws(run.compiled, args, 0, grad_out)
    v, gf = args[2].detach().double().flatten().cpu(), grad_out.double().flatten().cpu()
    torch.testing.assert_close(fused_draws["out"] @ gf, fused_draws["dv"] @ v, rtol=1e-2, atol=1e-2)  # fp16
    z = zs(fused_draws, draws(attend_dropout, args, 10_000, grad_out))
    assert max(abs(x) for x in z.values()) < Z, z
