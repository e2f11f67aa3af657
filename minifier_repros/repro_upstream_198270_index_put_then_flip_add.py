#!/usr/bin/env python
"""pytorch/pytorch#198270 (open upstream; right on 2.15): https://github.com/pytorch/pytorch/issues/198270

Fault: ``x.index_put_(...)`` followed by ``x.add_(x.flip(0))``: Inductor fuses the copy back
into ``x`` with the read of ``x`` at mirrored positions, so the add reads rows it has already
overwritten. Wrong at every size on CPU (a race on CUDA); either statement alone is fine.
Torch: wrong under Inductor on 2.11, 2.13 and 2.14 (CPU); right on 2.15.
Covered by: value_check (the guard compares a sampled compiled call, mutated inputs included,
with enn's eager copy, which is right).
"""

import sys

import torch

from upstream_corpus import check, main

ISSUE = 198270
MECHANISM = "value_check"
FIXED_IN = (2, 15)


def index_put_then_flip_add(x):
    x.index_put_((torch.arange(x.size(0)),), x * 2.0)
    x.add_(x.flip(0))
    return x


def make_inputs():
    return [torch.rand(4, 8, generator=torch.Generator().manual_seed(0))]


def test_upstream_198270_index_put_then_flip_add():
    assert not check(index_put_then_flip_add, make_inputs)


if __name__ == "__main__":
    sys.exit(main(index_put_then_flip_add, make_inputs, fixed_in=FIXED_IN))
