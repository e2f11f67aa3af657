"""The attention pass on its own (tests/pass_harness.py): which ops replace each pattern family,
how many sites match, eager's values and gradients, and the near misses that must not match.
CPU, tiny shapes."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import enn_backend
from attention_cases import (ALIBI, BACKEND, BIAS, CAUSAL, CPU_FLASH, CPU_FLASH_BWD, MASK, MASKED_ROWS, WINDOW,
                             B, H, T, D, alibi_causal, aten, bool_padding_neg_inf, causal_arange,
                             causal_tril, causal_triu_where_min, choices, enn, exp_not_softmax, finfo_min_padding,
                             fused, heads_of_hidden, int_padding, intermediate_reused, learned_bias,
                             padding_bias, qkv, scale_q_div, sliding_window, softmax_over_dim1_3d,
                             softmax_over_queries, t5_bias, t5_bias_scaled, t5_bias_twice, t5_cross, the,
                             three_d_bias, three_d_causal, untouched, UNFUSED, T5Layers)
from enn_backend.custom_ops.attention import SATURATED_FLOOR
from enn_backend.custom_ops.pinned import EMITTED
from enn_backend.passes.attention import AttentionPass, provenance
from pass_harness import assert_ops, count_ops, find_ops, run_passes


@pytest.fixture(autouse=True)
def _fuse_tiny(monkeypatch):
    """The shapes here are tiny; by default the policy leaves tiny CPU attention to Inductor
    (see test_tiny_cpu_attention_left_to_inductor). An explicit order makes enn fuse them."""
    monkeypatch.setenv("ENN_ATTENTION_ORDER", "flash,explicit")


# ----------------------------------------------------------------------------- pattern families
CAUSAL_FAMILIES = {"causal_tril": causal_tril, "causal_triu_where_finfo_min": causal_triu_where_min,
                   "causal_arange": causal_arange, "scale_before_div": scale_q_div}


@pytest.mark.parametrize("name", sorted(CAUSAL_FAMILIES))
def test_causal_families_become_the_cpu_flash_kernel_with_a_causal_flag(name):
    run = fused(CAUSAL_FAMILIES[name], qkv())
    assert_ops(run.after, present=[CPU_FLASH, CPU_FLASH_BWD], absent=[enn.attention])
    assert the(run.after, CPU_FLASH).args[4] is True  # is_causal: no mask tensor
    assert the(run.after, CPU_FLASH).kwargs["attn_mask"] is None


def test_sliding_window_becomes_a_window_flag():
    run = fused(sliding_window, qkv())
    node = the(run.after, enn.attention)
    assert node.args[CAUSAL] is True and node.args[WINDOW] == 3 and node.args[MASK] is None
    assert_ops(run.after, present=[enn.attention_backward])


@pytest.mark.parametrize("fn", [causal_tril, sliding_window])
def test_inference_graph_gets_the_forward_only(fn):
    run = fused(fn, qkv(grad=False), train=False)
    assert_ops(run.after, absent=[CPU_FLASH_BWD, enn.attention_backward])
    assert count_ops(run.after, CPU_FLASH) + count_ops(run.after, enn.attention) == 1


def test_the_pass_fuses_in_the_joint_pre_stage():
    """Before Inductor's own fuse_attention (between enn's two joint stages) can take the site."""
    pad = torch.ones(B, T)
    pad[1, 5:] = 0
    run = fused(padding_bias, (*qkv(), pad))
    assert [(s.stage, s.matches["attention"]) for s in run.stages] == [("joint_pre", 1), ("joint", 0)]


def test_additive_padding_mask_from_a_float_tensor_runs_in_the_enn_op():
    """A float user tensor may hold -inf: the bias goes to enn::attention (dead-row handling)."""
    pad = torch.ones(B, T)
    pad[1, 5:] = 0
    run = fused(padding_bias, (*qkv(), pad))
    node = the(run.after, enn.attention)
    assert node.args[BIAS] is not None and node.args[MASK] is None and node.args[BACKEND] == "cpu_flash"


@pytest.mark.parametrize("order", ["flash", "explicit"])
def test_saturated_rows_of_a_finfo_min_mask(order, monkeypatch):
    """A sequence that is all padding: every score of its rows is absorbed by ``finfo.min``, so
    eager's softmax is uniform over the keys -- finite. CPU flash recomputes P from the saved
    log-sum-exp, which rounds to the bias: enn divides those rows' incoming gradient by the key
    count. The explicit math computes softmax as eager does. Values and gradients equal eager's."""
    monkeypatch.setenv("ENN_ATTENTION_ORDER", order)
    pad = torch.ones(B, T)
    pad[0, :] = 0  # batch 0: all padding
    pad[1, 5:] = 0
    run = fused(finfo_min_padding, (*qkv(), pad))
    assert torch.isfinite(run.output).all()
    assert the(run.after, enn.attention).args[BACKEND] == ("cpu_flash" if order == "flash" else "explicit")


def test_saturated_rows_under_bf16_autocast():
    """The same all-padding rows under CPU bf16 autocast, through enn::attention's CPU flash
    backend in bf16 (the float pad is not provably finite, so the op, not the emitted kernel,
    runs; it floors the mask with kernel_bias and divides saturated rows' gradient by their key
    count): eager's uniform rows and gradients."""
    pad = torch.ones(B, T)
    pad[0, :] = 0
    pad[1, 5:] = 0

    def attend(q, k, v, pad):
        with torch.autocast("cpu", torch.bfloat16):
            return finfo_min_padding(q, k, v, pad)

    run = run_passes(attend, (*qkv(), pad), ["attention"], options={"attention_backend": "flash"})
    assert run.matches == {"attention": 1}
    assert the(run.after, enn.attention).args[BACKEND] == "cpu_flash"
    assert torch.isfinite(run.output).all()
    run.check_eager(atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("fill", [-10000.0, torch.finfo(torch.float32).min], ids=["-10000", "finfo.min"])
def test_integer_padding_mask_is_the_kernel_bias(fill):
    """An integer padding mask scaled by a finite fill is provably finite: the pass emits the
    kernel itself, its bias floored (values at or below SATURATED become -2**100) and, in the
    backward, saturated rows' incoming gradient divided by their key count. The report says when
    the floor matters (a finfo.min mask), not for a -10000 mask, which cannot saturate a row."""
    pad = torch.ones(B, T, dtype=torch.long)
    pad[1, 5:] = 0
    if fill < -1e30:
        # batch 0 all padding: saturated rows. (With -10000 such a row keeps its scores, rounded
        # at 10000's ulp; the kernel's backward recomputes P from a log-sum-exp of that size and
        # differs from eager by ~5e-4 relative there, more than this test's fp32 tolerance.)
        pad[0, :] = 0
    run = fused(int_padding(fill), (*qkv(), pad))
    assert_ops(run.after, present=[CPU_FLASH, CPU_FLASH_BWD], absent=[enn.attention])
    floor = [n for n in find_ops(run.after, aten.where.ScalarOther) if n.args[2] == SATURATED_FLOOR]
    assert len(floor) == 1 and the(run.after, CPU_FLASH).kwargs["attn_mask"] is not None
    assert ("-2**100" in choices()[0]["reason"]) == (fill < -1e30), choices()


def test_learned_bias_with_gradient():
    bias = (0.1 * torch.randn(1, H, T, T)).requires_grad_(True)
    run = fused(learned_bias, (*qkv(), bias))
    assert the(run.after, enn.attention).args[BACKEND] == "explicit"  # CPU flash gives no bias gradient
    assert the(run.after, enn.attention_backward).args[-1] is True  # bias_grad


def _padding_mask(shape):
    """HF's extended padding mask (0: keep, finfo.min: padding), broadcast to ``shape``; no gradient."""
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, 5:] = False
    return torch.where(keep, 0.0, torch.finfo(torch.float32).min)[:, None, None, :].expand(shape).contiguous()


def _position_bias():
    return (0.5 * torch.randn(1, H, T, T, generator=torch.Generator().manual_seed(1))).requires_grad_(True)


@pytest.mark.parametrize("fn,factor", [(t5_bias, 1.0), (t5_bias_scaled, 0.5), (t5_bias_twice, 3.0)],
                         ids=["t5", "scaled", "one_node_twice"])
@pytest.mark.parametrize("mask_shape", [(B, 1, 1, T), (B, 1, T, T)], ids=["mask_b11t", "mask_b1tt"])
def test_bias_of_several_terms_one_with_gradient(fn, factor, mask_shape):
    """T5: a learned position bias [1, H, T, T] (gradient) plus the padding mask (none). The kernel
    gets their sum; the position bias's gradient is the kernel's bias gradient summed over the
    batch (the axis it broadcasts over) times the bias's factor; the mask gets none."""
    run = fused(fn, (*qkv(), _position_bias(), _padding_mask(mask_shape)))
    assert the(run.after, enn.attention).args[BACKEND] == "explicit"  # CPU flash gives no bias gradient
    backward = the(run.after, enn.attention_backward)
    assert backward.args[-1] is True  # bias_grad
    (dbias,) = [n for n in backward.users if n.args[1] == 3]
    (reduced,) = dbias.users
    assert reduced.target is aten.sum.dim_IntList and list(reduced.args[1]) == [0], reduced.format_node()
    scaled = [u for u in reduced.users if u.target is aten.mul.Tensor and u.args[1] == factor]
    assert len(scaled) == (factor != 1.0), [u.format_node() for u in reduced.users]


@pytest.mark.parametrize("fn", [t5_bias, t5_bias_scaled, learned_bias], ids=["t5", "scaled", "learned"])
def test_bias_gradient_told_apart_from_qkvs_of_its_shape(fn):
    """A bias with a gradient in Q, K and V's own shape (T5's encoder at a sequence length equal to
    its head size: the position bias with the padding mask added is [B, H, T, T] like Q, K, V):
    a backward node settled as one input's gradient is no other's candidate, so the last is the
    bias's, and the values equal eager's."""
    assert T == D  # the case: every input of one shape
    g = torch.Generator().manual_seed(2)
    bias = (0.5 * torch.randn(B, H, T, T, generator=g)).requires_grad_(True)
    args = (*qkv(), bias) + ((torch.zeros(B, 1, 1, T),) if fn is not learned_bias else ())
    run = fused(fn, args)
    backward = the(run.after, enn.attention_backward)
    assert backward.args[-1] is True  # bias_grad


@pytest.mark.parametrize("batch", [1, B])
def test_three_d_attention_bias_with_gradient(batch):
    """The kernel's bias gradient of a 3-D attention ([B, 1, Tq, Tk], the head axis added) loses the
    head axis again before it is summed down to the bias's [1 or B, Tq, Tk]."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, t, d, generator=g, requires_grad=True) for t, d in ((T, 4), (2 * T, 4), (2 * T, 6)))
    bias = (0.5 * torch.randn(batch, T, 2 * T, generator=g)).requires_grad_(True)
    keep = torch.ones(B, 2 * T, dtype=torch.bool)
    keep[1, 11:] = False
    run = fused(three_d_bias, (q, k, v, bias, torch.where(keep, 0.0, torch.finfo(torch.float32).min)[:, None, :]))
    assert the(run.after, enn.attention_backward).args[-1] is True


def test_position_bias_shared_by_two_layers():
    """T5 computes the position bias in layer 0 and reuses it: both sites fused, each gives its
    share of the bias gradient, which reaches the learned table as in eager."""
    run = run_passes(T5Layers(), (*qkv(), _padding_mask((B, 1, 1, T))), ["attention"])
    assert run.matches == {"attention": 2}, run.matches
    assert_ops(run.after, absent=UNFUSED)
    assert count_ops(run.after, enn.attention_backward) == 2
    run.check_eager()


def test_site_first_planned_after_inductors_joint_clean_up(monkeypatch):
    """T5's cross-attention seen in the joint stage only (as when the policy leaves it to Inductor
    in joint_pre): the forward ``* 1.0`` has been replaced by a node with another ``seq_nr`` than
    its backward's. That backward lies between two nodes of the region's backward, so it is
    part of it: the exits are dq, dk and dv only (the scores' gradient, [B, H, Tq, Tk] like q's
    [B, H, Tq, D], is no exit to be mistaken for dq)."""
    monkeypatch.setattr(AttentionPass, "stage", "joint")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, 2 * T, generator=g, requires_grad=True)
    k, v = (torch.randn(B, H, 2 * T, 2 * T, generator=g, requires_grad=True) for _ in range(2))
    keep = torch.ones(B, 2 * T, dtype=torch.bool)
    keep[1, 11:] = False
    mask = torch.where(keep, 0.0, torch.finfo(torch.float32).min)[:, None, None, :].expand(B, 1, T, 2 * T)
    run = fused(t5_cross, (q, k, v, mask))
    assert [s.stage for s in run.stages] == ["joint"]
    assert_ops(run.after, present=[enn.attention, enn.attention_backward])
    assert not enn_backend.report().to_dict()["fallbacks"]


def test_bf16_softmax_in_fp32_inference():
    bias = torch.zeros(1, H, T, T, dtype=torch.bfloat16)
    run = fused(learned_bias, (*qkv(torch.bfloat16, grad=False), bias), train=False)
    assert the(run.after, enn.attention).args[BIAS] is not None


def test_bool_padding_mask_and_fully_masked_rows():
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, 4:] = False
    keep[0, :] = False  # batch 0: every key masked -> eager gives NaN rows
    run = fused(bool_padding_neg_inf, (*qkv(), keep))
    assert the(run.after, enn.attention).args[MASK] is not None
    assert torch.isnan(run.output[0]).all() and torch.isfinite(run.output[1]).all()


def test_fully_masked_rows_zero_option():
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[0, :] = False
    q, k, v = qkv(grad=False)
    run = run_passes(bool_padding_neg_inf, (q, k, v, keep), ["attention"], training=False,
                     options={"masked_rows": "zero"})
    assert the(run.after, enn.attention).args[MASKED_ROWS] == "zero"
    assert (run.output[0] == 0).all()
    torch.testing.assert_close(run.output[1], bool_padding_neg_inf(q, k, v, keep)[1])


def test_alibi_from_slopes():
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)])
    run = fused(alibi_causal, (*qkv(), slopes))
    node = the(run.after, enn.attention)
    assert node.args[ALIBI] is not None and node.args[CAUSAL] is True and node.args[BIAS] is None


def test_dynamic_shapes_keep_causal_structure_without_recompiles():
    def causal_dyn(q, k, v):
        t = q.size(-2)
        keep = torch.tril(torch.ones(t, t, dtype=torch.bool))
        att = (q @ k.transpose(-1, -2)) * 0.25
        return att.masked_fill(~keep, float("-inf")).softmax(-1) @ v

    inputs = lambda t: [torch.randn(1, 2, t, 8) for _ in range(3)]  # noqa: E731
    run = run_passes(causal_dyn, inputs(9), ["attention"], training=False, dynamic=True)
    assert run.matches == {"attention": 1}
    assert the(run.after, CPU_FLASH).args[4] is True and the(run.after, CPU_FLASH).kwargs["attn_mask"] is None
    stages = len(run.stages)
    with torch.no_grad():
        for t in (13, 21):
            x = inputs(t)
            torch.testing.assert_close(run.compiled(*x), causal_dyn(*x), atol=1e-5, rtol=1e-4)
    assert len(run.stages) == stages  # no recompile


def test_three_d_attention():
    """``bmm`` on [B, T, D] (no head axis): an additive causal mask becomes the causal flag."""
    run = fused(three_d_causal, [torch.randn(3, T, D) for _ in range(3)], train=False)
    assert the(run.after, CPU_FLASH).args[4] is True


@pytest.mark.parametrize("order", ["flash", "explicit"])
def test_gradients_in_the_kernels_layout_reach_the_inputs_through_valid_views(order, monkeypatch):
    """The fused backward's contiguous dk, permuted back to [B, T, H, D], cannot be viewed as
    [B, T, H * D] as the unfused graph's could: the pass turns that view into a reshape, so the
    graph stays valid ATen (the guard's eager reference and pinned nodes run it as written)."""
    monkeypatch.setenv("ENN_ATTENTION_ORDER", order)
    g = torch.Generator().manual_seed(0)
    run = fused(heads_of_hidden, [torch.randn(B, T, H * D, generator=g, requires_grad=True) for _ in range(3)])
    if order == "explicit":  # CPU flash returns each gradient in its input's layout: nothing to reshape
        assert count_ops(run.stages[0].after, aten.reshape) > count_ops(run.stages[0].before, aten.reshape)


def test_three_d_attention_whose_gradients_cannot_be_told_apart_is_not_fused():
    """In training, q / k / v of one shape and one forward op leave the backward's exits
    ambiguous: the site is left as written (recorded), not guessed."""
    untouched(three_d_causal, [torch.randn(3, T, D, requires_grad=True) for _ in range(3)], train=True)
    skipped = [f["kind"] for f in enn_backend.report().to_dict()["fallbacks"]]
    assert skipped and set(skipped) == {"pass_skipped"}, skipped


def test_every_node_the_pass_emits_is_tagged():
    """The guard's eager reference runs enn's safe path for nodes tagged EMITTED, and ATen for
    the rest: every node the pass adds carries the tag."""
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, 5:] = False
    cases = [(causal_tril, qkv(), True, {}), (bool_padding_neg_inf, (*qkv(), keep), True, {}),
             (alibi_causal, (*qkv(grad=False), slopes), False, {"attention_backend": "flex"})]
    for fn, args, train, options in cases:
        run = run_passes(fn, args, ["attention"], training=train, options=options)
        assert run.matches == {"attention": 1}, fn.__name__
        for stage in run.stages:
            old = {n.name for n in stage.before.nodes}
            new = [n for n in stage.after.nodes if n.name not in old and n.op != "output"]
            assert all(n.meta.get(EMITTED) for n in new), (fn.__name__, [n.name for n in new if not n.meta.get(EMITTED)])


# ----------------------------------------------------------------------------- what must not match
@pytest.mark.parametrize("fn", [softmax_over_queries, intermediate_reused, exp_not_softmax])
def test_near_miss_not_fused(fn):
    untouched(fn, qkv(grad=False))


def test_softmax_over_the_query_axis_of_a_3d_attention_is_not_fused():
    untouched(softmax_over_dim1_3d, [torch.randn(3, T, D) for _ in range(3)])


def test_tiny_cpu_attention_left_to_inductor(monkeypatch):
    monkeypatch.delenv("ENN_ATTENTION_ORDER")
    untouched(causal_tril, qkv(grad=False))
    assert choices()[0]["choice"] == "inductor" and choices()[0]["fused"] is False


def test_explicit_backend_forced():
    run = fused(causal_tril, qkv(), options={"attention_backend": "explicit"})
    assert the(run.after, enn.attention).args[BACKEND] == "explicit"


# ----------------------------------------------------------------------------- where a bias comes from
def test_finite_bias_provenance():
    """What counts as a bias that cannot hold -inf (only those run as the bare kernel)."""
    g = fx.Graph()

    def node(target, args, value):
        n = g.call_function(target, args)
        n.meta["val"] = value
        return n

    mask = g.placeholder("mask")
    mask.meta["val"] = torch.ones(2, 8, dtype=torch.long)
    f = node(torch.ops.prims.convert_element_type.default, (mask, torch.float32), torch.ones(2, 8))
    inv = node(aten.rsub.Scalar, (f, 1.0), torch.ones(2, 8))
    hf = node(aten.mul.Tensor, (inv, torch.finfo(torch.float32).min), torch.ones(2, 8))
    assert provenance.finite_bias(hf)  # HF's (1 - mask) * finfo.min
    assert provenance.may_saturate(hf)  # ... which can mask a whole row at finfo.min
    old_style = node(aten.mul.Tensor, (inv, -10000.0), torch.ones(2, 8))
    assert provenance.finite_bias(old_style) and not provenance.may_saturate(old_style)
    assert not provenance.finite_bias(node(aten.mul.Tensor, (inv, float("-inf")), torch.ones(2, 8)))
    learned = g.placeholder("bias")
    learned.meta["val"] = torch.ones(2, 8)
    assert not provenance.finite_bias(learned)  # a user tensor may hold -inf
    assert not provenance.finite_bias(node(aten.mul.Tensor, (learned, 2.0), torch.ones(2, 8)))  # still unknown
    assert not provenance.finite_bias(node(aten.add.Tensor, (hf, hf), torch.ones(2, 8)))  # finfo.min + finfo.min = -inf


def test_magnitude_bound_provenance():
    """What bounds a bias term kept beside a finfo.min mask (key_padding.take): integer tensors by
    their dtype, constants by their values, arithmetic of bounded terms; nothing else."""
    g = fx.Graph()

    def node(target, args, value, **kwargs):
        n = g.call_function(target, args, kwargs)
        n.meta["val"] = value
        return n

    mask = g.placeholder("mask")
    mask.meta["val"] = torch.ones(2, 8, dtype=torch.long)
    positions = node(aten.sub.Tensor, (node(aten.cumsum.default, (mask, -1), mask.meta["val"]), 1), mask.meta["val"])
    assert provenance.magnitude_bound(positions) == 2.0 ** 63  # int64: its range, whatever cumsum made
    base = node(aten.full.default, ([], 0.25), torch.tensor(0.25))
    heads = node(torch.ops.prims.iota.default, (4,), torch.arange(4, dtype=torch.int32),
                 start=0, step=1, dtype=torch.int32, device=torch.device("cpu"), requires_grad=False)
    slopes = node(aten.pow.Tensor_Tensor, (base, heads), torch.ones(4))
    assert provenance.magnitude_bound(slopes) == 1.0  # a constant: evaluated (0.25 ** 0 = 1)
    alibi = node(aten.mul.Tensor, (node(aten.view.default, (slopes, [1, 4, 1]), torch.ones(1, 4, 1)),
                                   node(aten.unsqueeze.default, (positions, 1), torch.ones(2, 1, 8))), torch.ones(2, 4, 8))
    assert provenance.magnitude_bound(alibi) == 2.0 ** 63 and provenance.finite_bias(alibi)
    huge = node(aten.mul.Tensor, (positions, 1e30), torch.ones(2, 8))
    assert provenance.magnitude_bound(huge) is None  # 2**63 * 1e30 is past fp32's range
    learned = g.placeholder("bias")
    learned.meta["val"] = torch.ones(2, 8)
    assert provenance.magnitude_bound(learned) is None
    assert provenance.magnitude_bound(node(aten.mul.Tensor, (learned, alibi), torch.ones(2, 8))) is None
    assert not provenance.finite_bias(node(aten.mul.Tensor, (learned, alibi), torch.ones(2, 8)))


# ----------------------------------------------------------------------------- finfo.min masks of a band and key padding
def hf_eager_gqa(window: int):
    """transformers' eager attention, written out: ``repeat_kv`` (expand + reshape) of grouped K/V,
    ``where(band & padding[b, j], 0, finfo.min)`` added to the scores, softmax in fp32."""
    def attend(q, k, v, pad):
        with torch.autocast("cpu", torch.bfloat16):
            b, hkv, t, d = k.shape
            rep = q.shape[1] // hkv
            kk, vv = (x[:, :, None].expand(b, hkv, rep, t, d).reshape(b, hkv * rep, t, d) for x in (k, v))
            i, j = torch.arange(t)[None, None, :, None], torch.arange(t)[None, None, None, :]
            keep = (j <= i) & (j > i - window if window else True) & pad.bool()[torch.arange(b)[:, None, None, None], j]
            mask = torch.where(keep, torch.tensor(0.0), torch.finfo(torch.float32).min)
            att = torch.matmul(q, kk.transpose(2, 3)) * d ** -0.5 + mask
            return torch.matmul(F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype), vv)
    return attend


@pytest.mark.parametrize("window", [0, 3], ids=["causal", "window3"])
def test_finfo_min_band_and_key_padding_under_bf16_autocast(window):
    """Grouped-query K/V, bf16 autocast: the mask reaches the kernel as its causal (window) flag and
    a [B, 1, 1, T] bf16 bias (0 / -2**100); the rows that keep no key (batch 1's first three:
    left padding; with the window also batch 0's row 7, whose window holds padding only) are
    eager's uniform rows, with eager's gradients."""
    t = 12
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, t, D, generator=g).requires_grad_()
    k, v = (torch.randn(B, 2, t, D, generator=g).requires_grad_() for _ in range(2))
    pad = torch.ones(B, t, dtype=torch.long)
    pad[1, :3] = 0
    pad[0, 4:8] = 0
    run = run_passes(hf_eager_gqa(window), (q, k, v, pad), ["attention"], training=True)
    assert run.matches == {"attention": 1}
    (c,) = choices()
    assert c["causal"] and c["window"] == window and c["key_padding"] and "mask_tensor" not in c, c
    op, bias_at = (CPU_FLASH, None) if not window else (enn.attention.default, BIAS)
    (kernel,) = find_ops(run.after, op)
    bias = kernel.kwargs["attn_mask"] if bias_at is None else kernel.args[bias_at]
    while bias.target in (aten.expand.default, aten.slice.Tensor, aten.constant_pad_nd.default):
        bias = bias.args[0]
    assert tuple(bias.meta["val"].shape) == (B, 1, 1, t) and bias.meta["val"].dtype == torch.bfloat16
    assert not [n for n in run.after.nodes if isinstance(x := n.meta.get("val"), torch.Tensor)
                and x.dim() == 4 and tuple(x.shape[-2:]) == (t, t) and x.stride(-2) != 0], "a T x T tensor is left"
    run.check_eager(atol=3e-2, rtol=3e-2)
