"""FlexAttention in the graph (enn_backend/passes/attention/kernels/flex.py): ALiBi positions as the
user's code rounds them, the traced fragment the pass splices in, and the closed-form block mask.
CPU (flex inference only, when asked for)."""

from __future__ import annotations

import math

import pytest
import torch

import enn_backend
from attention_cases import alibi_bf16_positions, aten, enn, fused
from enn_backend.custom_ops.attention import band_mask_mod
from enn_backend.passes.attention.kernels.flex import _fragment, block_mask
from pass_harness import assert_ops, run_passes


def test_alibi_with_bf16_rounded_positions():
    """``rel.to(bf16)`` rounds positions past 256: FlexAttention's score_mod rounds them the same
    way (so the result is what the user's code computes); a kernel that would add exact positions
    leaves the attention unfused, recorded."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 512, 16) for _ in range(3))
    slopes = torch.tensor([0.01, 0.02])  # gentle slopes: keys 256+ apart still count, so rounding shows
    run = fused(alibi_bf16_positions, (q, k, v, slopes), train=False, options={"attention_backend": "flex"})
    assert_ops(run.after, present=[torch.ops.higher_order.flex_attention], absent=[enn.attention])
    enn_backend.reset()
    untouched_run = run_passes(alibi_bf16_positions, (q, k, v, slopes), ["attention"], training=False,
                               options={"attention_backend": "explicit"})
    assert untouched_run.matches == {"attention": 0}
    assert_ops(untouched_run.after, present=[aten.bmm], absent=[enn.attention])
    skipped = [f for f in enn_backend.report().to_dict()["fallbacks"] if f["kind"] == "pass_skipped"]
    assert skipped and all(f["node"].startswith("bmm") for f in skipped), skipped


def test_flex_training_fragment_matches_eager_math():
    """The joint (forward + backward) flex fragment the pass splices in, run eagerly (the HOPs'
    reference implementation) on CPU: values and q/k/v gradients equal hand-written ALiBi."""
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


def test_guard_reference_runs_flex_without_per_element_vmap_fallback():
    """The guard's eager copy runs the spliced flex op through its math path, which evaluates the
    score_mod under vmap: every cast there must have a batching rule (``aten._to_copy``, not
    ``prims.convert_element_type``), or vmap loops over every (batch, head, query, key) and one
    checked call at T=1024 takes minutes. Rounded ALiBi positions put casts in the score_mod; the
    compiled graph keeps the prim (Inductor lowers no ``_to_copy`` there)."""
    import warnings

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    slopes = torch.tensor([0.01, 0.02])
    fn = torch.compile(alibi_bf16_positions, backend="enn",
                       options={"attention_backend": "flex", "guard": "strict", "guard_values": 1})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fn(q, k, v, slopes)
    torch.testing.assert_close(got, alibi_bf16_positions(q, k, v, slopes), rtol=1e-4, atol=1e-4)
    rep = enn_backend.report().to_dict()
    assert sum(g["counters"].get("value_checks", 0) for g in rep["graphs"]) >= 1 and not rep["fallbacks"], rep
    assert not [w for w in caught if "batching rule" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.parametrize("t", [128, 512, 1024])
@pytest.mark.parametrize("causal, window", [(True, 0), (True, 100), (True, 256), (False, 300), (False, 0)])
def test_closed_form_block_mask_equals_create_block_mask(t, causal, window):
    """The band's block mask built from block indices equals the one create_block_mask derives
    from every (query, key) position: the same partial and full blocks, in the same order."""
    from torch.nn.attention.flex_attention import create_block_mask

    want = [x for x in create_block_mask(band_mask_mod(causal, window), None, None, t, t, device="cpu").as_tuple()
            if isinstance(x, torch.Tensor)][:4]
    got = [x for x in block_mask(causal, window, t, t, torch.device("cpu")).as_tuple()
           if isinstance(x, torch.Tensor)][:4]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
