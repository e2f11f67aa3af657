#!/usr/bin/env python
"""pytorch/pytorch#197091 (open): https://github.com/pytorch/pytorch/issues/197091

Fault: Inductor's native ``ldexp`` lowering keeps the mantissa's floating dtype instead of
promoting both operands: an fp16 mantissa with an fp32 exponent returns fp16 (eager fp32), so
precision is lost with no warning (and int or bool mantissas with an fp16 exponent go fp32).
Torch: wrong under Inductor on 2.11, 2.13, 2.14 and 2.15 (CPU); aot_eager is right.
Covered by: known_bad (compat.KNOWN_MISCOMPILES): an ``aten.ldexp`` whose result dtype is not
its mantissa's runs its eager kernel.
"""

import sys

import torch

from upstream_corpus import check, main

ISSUE = 197091
MECHANISM = "known_bad"
FIXED_IN = None


def ldexp(mantissa, exponent):
    return torch.ldexp(mantissa, exponent)


def make_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 4, generator=g).half(), torch.randn(3, 4, generator=g)]


def test_upstream_197091_ldexp_dtype():
    assert not check(ldexp, make_inputs)


if __name__ == "__main__":
    sys.exit(main(ldexp, make_inputs, fixed_in=FIXED_IN))
