#!/usr/bin/env python
"""pytorch/pytorch#183763 (closed): https://github.com/pytorch/pytorch/issues/183763

Fault: Inductor computes ``sinh`` as ``(exp(x) - exp(-x)) / 2``; ``exp(89)`` overflows float32
where ``sinh(89)`` (about 2.2e38) does not: the compiled result is ``inf`` where eager's is finite.
Torch: wrong under Inductor on 2.11 and 2.13 (CPU); right on 2.14 and 2.15.
Covered by: nonfinite (the guard's NaN/Inf check, on today): the compiled output has Inf where
eager's is finite, so enn localizes ``sinh``, pins it and returns eager's values.
"""

import sys

import torch

from upstream_corpus import check, main

ISSUE = 183763
MECHANISM = "nonfinite"
FIXED_IN = (2, 14)


def sinh(x):
    return torch.sinh(x) * 0.5


def make_inputs():
    return [torch.tensor([88.85, 89.2, 88.95, -89.0])]


def test_upstream_183763_sinh_overflow():
    assert not check(sinh, make_inputs)


if __name__ == "__main__":
    sys.exit(main(sinh, make_inputs, fixed_in=FIXED_IN))
