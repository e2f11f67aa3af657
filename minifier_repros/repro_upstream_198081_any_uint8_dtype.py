#!/usr/bin/env python
"""pytorch/pytorch#198081 (open): https://github.com/pytorch/pytorch/issues/198081

Fault: ``torch.any`` of a uint8 tensor returns uint8 in eager (legacy result type) and bool
under Inductor, whose own ``reduce_any`` lowering skips the cast back. Arithmetic on the result
then promotes to int64 instead of wrapping in uint8: ``torch.any(x) * 200 + 100`` is 44 in
eager and 300 compiled; ``x.any(0)`` comes back as bool.
Torch: wrong under Inductor on 2.11, 2.13, 2.14 and 2.15 (CPU); aot_eager is right.
Covered by: known_bad (compat.KNOWN_MISCOMPILES): ``aten.any`` of a uint8 input runs its eager kernel.
"""

import sys

import torch

from upstream_corpus import check, main

ISSUE = 198081
MECHANISM = "known_bad"
FIXED_IN = None


def any_uint8(x):
    return torch.any(x) * 200 + 100, x.any(0)


def make_inputs():
    return [torch.tensor([[0, 3], [0, 0]], dtype=torch.uint8)]


def test_upstream_198081_any_uint8_dtype():
    assert not check(any_uint8, make_inputs)


if __name__ == "__main__":
    sys.exit(main(any_uint8, make_inputs, fixed_in=FIXED_IN))
