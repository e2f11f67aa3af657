#!/usr/bin/env python
"""pytorch/pytorch#198033 (right on 2.15; fix in PR #198242): https://github.com/pytorch/pytorch/issues/198033

Fault: an in-place foreach op whose second operand reads the first at other positions
(``torch._foreach_add_([x], [x.flip(0)])``) is lowered as the out-of-place op written straight
into ``x`` (``mutate_to(..., unsafe_alias=True)``): later rows read values already overwritten.
Torch: wrong under Inductor on 2.11, 2.13 and 2.14 (CPU); right on 2.15.
Covered by: value_check (the guard compares a sampled compiled call, mutated inputs included,
with enn's eager copy, which is right).
"""

import sys

import torch

from upstream_corpus import check, main

ISSUE = 198033
MECHANISM = "value_check"
FIXED_IN = (2, 15)


def foreach_add_flipped_self(x):
    torch._foreach_add_([x], [x.flip(0)])
    return x


def make_inputs():
    return [torch.rand(4, 8, generator=torch.Generator().manual_seed(0))]


def test_upstream_198033_foreach_reads_self_elsewhere():
    assert not check(foreach_add_flipped_self, make_inputs)


if __name__ == "__main__":
    sys.exit(main(foreach_add_flipped_self, make_inputs, fixed_in=FIXED_IN))
