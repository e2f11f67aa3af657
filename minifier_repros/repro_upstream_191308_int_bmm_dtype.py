#!/usr/bin/env python
"""pytorch/pytorch#191308 (open upstream; right on 2.15): https://github.com/pytorch/pytorch/issues/191308

Fault: an integer batched matmul with a size-1 row (``(1,1,2) @ (1,2,2)``, int8, uint8, int16 or
int32) is decomposed by CPU Inductor into a multiply and a sum, and the sum's int64 result is
returned: the output dtype changes from int8 to int64 (values equal here), which changes
downstream type promotion and dispatch.
Torch: wrong under Inductor on 2.11, 2.13 and 2.14 (CPU); right on 2.15.
Covered by: known_bad (compat.KNOWN_MISCOMPILES, until 2.15): an ``aten.bmm`` on integers
narrower than int64 runs its eager kernel.
"""

import sys

import torch

from upstream_corpus import check, main

ISSUE = 191308
MECHANISM = "known_bad"
FIXED_IN = (2, 15)


def int_bmm(a, b):
    return torch.matmul(a, b)


def make_inputs():
    return [torch.ones((1, 1, 2), dtype=torch.int8), torch.ones((1, 2, 2), dtype=torch.int8)]


def test_upstream_191308_int_bmm_dtype():
    assert not check(int_bmm, make_inputs)


if __name__ == "__main__":
    sys.exit(main(int_bmm, make_inputs, fixed_in=FIXED_IN))
