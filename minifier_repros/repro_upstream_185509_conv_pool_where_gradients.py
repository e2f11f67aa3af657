#!/usr/bin/env python
"""pytorch/pytorch#185509 (closed; right on 2.14): https://github.com/pytorch/pytorch/issues/185509

Fault: bilinear interpolate -> slice -> conv2d -> max_pool2d -> ``torch.where(mask, conv, pool)``:
the forward matches eager, but the backward returns gradients of the input, weight and bias off
by up to ~77 (training silently diverges; the loss looks fine).
Torch: wrong under Inductor on 2.11 and 2.13 (CPU); right on 2.14 and 2.15.
Covered by: value_check (the guard compares a sampled backward call's gradients with enn's
eager copy of the backward graph, which is right).
"""

import sys

import torch
import torch.nn.functional as F

from upstream_corpus import check, main

ISSUE = 185509
MECHANISM = "value_check"
FIXED_IN = (2, 14)


def _conv_pool(x, weight, bias):
    y = F.interpolate(x, scale_factor=(1.5, 1.25), mode="bilinear", align_corners=False)[:, :, 1:7, 1:8]
    conv = F.conv2d(y, weight, bias, padding=1)
    return conv, F.max_pool2d(conv, kernel_size=3, stride=1, padding=1)


def where_conv_or_pool(x, weight, bias, mask):
    conv, pool = _conv_pool(x, weight, bias)
    return torch.where(mask, conv, pool)


def make_inputs():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 3, 6, 8, generator=g), torch.randn(4, 3, 3, 3, generator=g), torch.randn(4, generator=g)
    with torch.no_grad():
        conv, pool = _conv_pool(x, w, b)
        mask = conv > pool.mean(dim=(2, 3), keepdim=True)
    return [x.requires_grad_(), w.requires_grad_(), b.requires_grad_(), mask]


def test_upstream_185509_conv_pool_where_gradients():
    assert not check(where_conv_or_pool, make_inputs, grad=True)


if __name__ == "__main__":
    sys.exit(main(where_conv_or_pool, make_inputs, grad=True, fixed_in=FIXED_IN))
