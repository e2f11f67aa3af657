#!/usr/bin/env python
"""pytorch/pytorch#196468 (open): https://github.com/pytorch/pytorch/issues/196468

Fault: Inductor's attention rewrite (fx_passes/fuse_attention.py) ignores the softmax axis.
``softmax(q @ k^T * s, dim=1) @ v`` -- a softmax over the heads, not over the keys, so not
attention -- is rewritten to scaled_dot_product_attention, which normalizes over the keys:
values off by ~3, no error. Any axis but the last one: dim=1 (inference and training) and
dim=-2 with an additive mask (another pattern of the family).
Torch: wrong under Inductor on 2.11, 2.13 and 2.14 (CPU), right on 2.15; right with
``torch._inductor.config.pattern_matcher = False``.
Covered by: enn owns attention (compat.inductor_attention_rewrites_off): enn's matcher declines
these graphs, and Inductor's attention patterns never see enn's compiles.
"""

import sys

import pytest
import torch

from upstream_corpus import check, main

ISSUE = 196468
MECHANISM = "attention"
FIXED_IN = (2, 15)


def over_heads(q, k, v):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return torch.softmax(s, dim=1) @ v


def over_queries_masked(q, k, v, mask):
    return (torch.matmul(q, k.transpose(-2, -1)).div(2.0) + mask).softmax(dim=-2).matmul(v)


def inputs(grad=False, mask=False):
    def make():
        g = torch.Generator().manual_seed(0)
        t = [torch.randn(2, 4, 16, 8, generator=g, requires_grad=grad) for _ in range(3)]
        return t + [torch.randn(2, 4, 16, 16, generator=g)] if mask else t
    return make


CASES = {"over_heads": (over_heads, inputs(), False),
         "over_heads_training": (over_heads, inputs(grad=True), True),
         "over_queries_masked": (over_queries_masked, inputs(mask=True), False)}


@pytest.mark.parametrize("case", list(CASES))
def test_upstream_196468_softmax_not_over_keys(case):
    fn, make, grad = CASES[case]
    assert not check(fn, make, grad=grad)


if __name__ == "__main__":
    sys.exit(max(main(fn, make, grad=grad, fixed_in=FIXED_IN) for fn, make, grad in CASES.values()))
