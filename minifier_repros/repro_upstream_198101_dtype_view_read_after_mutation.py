#!/usr/bin/env python
"""pytorch/pytorch#198101 (open): https://github.com/pytorch/pytorch/issues/198101

Fault: a value computed from a dtype view of an input (``y = x.view(int32) * 2``) is read after
a later in-place write into that input (``x[:, 2:5] = 2``): Inductor computes ``y`` from the
mutated ``x``, so three of every six elements come back wrong, no error.
Torch: wrong under Inductor on 2.11, 2.13, 2.14 and 2.15 (CPU); aot_eager is right, and so is
enn's eager copy of the graph.
Covered by: value_check (the guard compares a sampled compiled call, outputs and mutated inputs,
with enn's eager copy; integer results exactly: an integer graph's fp64 run is its eager run, so
any difference is the compiled code's), which pins the ``mul`` reading the view to its eager kernel.
"""

import sys

import torch

from upstream_corpus import check, main

ISSUE = 198101
MECHANISM = "value_check"
FIXED_IN = None


def view_then_mutate(x):
    y = x.view(torch.int32) * 2
    y.sub_(-4)
    x[:, 2:5] = 2
    return y.view(torch.int64)


def make_inputs():
    return [torch.arange(-12, 12, dtype=torch.int64).reshape(4, 6)]


def test_upstream_198101_dtype_view_read_after_mutation():
    assert not check(view_then_mutate, make_inputs)


if __name__ == "__main__":
    sys.exit(main(view_then_mutate, make_inputs, fixed_in=FIXED_IN))
