#!/usr/bin/env python
"""pytorch/pytorch#197895 (open): https://github.com/pytorch/pytorch/issues/197895

Fault: Inductor lowers floating floor division (``a // b``, ``torch.floor_divide``,
``torch.div(..., rounding_mode="floor")``) to ``floor(a / b)``: where the exact quotient lies
just below an integer the rounded quotient reaches it, and the result is one too high
(``1.0 // 0.1`` gives 10, eager and Python 9). Binning or index arithmetic lands one bucket off.
Torch: wrong under Inductor on 2.11, 2.13, 2.14 and 2.15 (CPU); aot_eager is right.
Covered by: known_bad (compat.KNOWN_MISCOMPILES): the floating ``aten.div.Tensor_mode`` (floor)
node runs its eager kernel.
"""

import sys

import torch

from upstream_corpus import check, main

ISSUE = 197895
MECHANISM = "known_bad"
FIXED_IN = None


def floor_div(a, b):
    return a // b, torch.div(a, 0.1, rounding_mode="floor")


def make_inputs():
    return [torch.tensor([1.0, 0.5, 6.0, 1.0, 7.0, 0.3]), torch.tensor([0.1, 0.1, 0.2, 1 / 3, 0.7, 0.1])]


def test_upstream_197895_float_floor_division():
    assert not check(floor_div, make_inputs)


if __name__ == "__main__":
    sys.exit(main(floor_div, make_inputs, fixed_in=FIXED_IN))
