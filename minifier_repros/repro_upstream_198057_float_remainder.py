#!/usr/bin/env python
"""pytorch/pytorch#198057 (open): https://github.com/pytorch/pytorch/issues/198057

Fault: CPU Inductor's vectorized floating remainder computes ``a - floor(a / b) * b`` where eager
uses fmod with a sign fix: large quotients give 0 (``1e20 % 3.0`` is 0, eager 2) and an
infinite divisor gives NaN (eager: the dividend). Only tensors long enough for a vector (8
floats here) are affected; the scalar tail is right, so it looks like a data issue.
Torch: wrong under Inductor on 2.11, 2.13, 2.14 and 2.15 (CPU); aot_eager is right.
Covered by: known_bad (compat.KNOWN_MISCOMPILES): floating ``aten.remainder`` runs its eager
kernel. The guard's NaN/Inf check sees only the infinite-divisor half; these inputs are all
finite, so without the pin enn returns the wrong zeros silently.
"""

import sys

import torch

from upstream_corpus import check, main

ISSUE = 198057
MECHANISM = "known_bad"
FIXED_IN = None


def remainder(a, b):
    return torch.remainder(a, b), a % 3.0


def make_inputs():
    return [torch.tensor([1e20, 2147483648.0, 7.0, 1.0, -5.5, 5.5, 1e12, 3.0]),
            torch.tensor([3.0, 3.0, 0.7, 0.1, 2.0, -2.0, 7.0, 3.0])]


def test_upstream_198057_float_remainder():
    assert not check(remainder, make_inputs)


if __name__ == "__main__":
    sys.exit(main(remainder, make_inputs, fixed_in=FIXED_IN))
