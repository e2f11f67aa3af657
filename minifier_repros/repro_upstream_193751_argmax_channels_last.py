#!/usr/bin/env python
"""pytorch/pytorch#193751 (closed; right on 2.15): https://github.com/pytorch/pytorch/issues/193751

Fault: ``argmax`` over all dims of a reduction fused with it (``argmax(mean(x, -1))``) on a
channels_last input returns the kernel's physical flat index instead of the logical row-major
one: the index points at a value that is not the maximum (eager 14, compiled 25 here).
Torch: wrong under Inductor on 2.11, 2.13 and 2.14 (CPU); right on 2.15 (PR #195063).
Covered by: known_bad (compat.KNOWN_MISCOMPILES, until 2.15): an ``aten.argmax`` / ``argmin``
over all dims of an input with two or more dims runs its eager kernel.
"""

import sys

import torch

from upstream_corpus import check, main

ISSUE = 193751
MECHANISM = "known_bad"
FIXED_IN = (2, 15)


def argmax_of_mean(x):
    return torch.argmax(torch.mean(x, dim=-1))


def make_inputs():
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(4, 4, 8, 8, generator=g).to(memory_format=torch.channels_last)]


def test_upstream_193751_argmax_channels_last():
    assert not check(argmax_of_mean, make_inputs)


if __name__ == "__main__":
    sys.exit(main(argmax_of_mean, make_inputs, fixed_in=FIXED_IN))
