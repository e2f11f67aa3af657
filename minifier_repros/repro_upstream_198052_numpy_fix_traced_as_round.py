#!/usr/bin/env python
"""pytorch/pytorch#198052 (open): https://github.com/pytorch/pytorch/issues/198052

Fault: NumPy code under torch.compile is translated by Dynamo to ``torch._numpy``, where
``np.fix`` is an alias of ``torch.round``: ``np.fix([1.5, -1.5])`` gives ``[2, -2]`` instead of
``[1, -1]`` (also ``np.cbrt`` of negatives, ``np.clip`` with out-of-range bounds, ``np.sign(nan)``).
Torch: wrong on 2.11, 2.13, 2.14 and 2.15 with every backend, ``backend="eager"`` included.
Covered by: none. The graph Dynamo hands to enn already rounds; enn's eager copy and the Dynamo
graph agree with the compiled kernel, so no check can see it. What the user sees under
``backend="enn"``: ``np.fix`` rounds half away from zero and nothing is reported. The test
pins that behaviour down; it fails once Dynamo translates ``np.fix`` right.
"""

import sys

import numpy as np
import torch

from upstream_corpus import check, inductor_wrong, main

ISSUE = 198052
MECHANISM = "none"
FIXED_IN = None


def fix(a):
    return torch.from_numpy(np.fix(a.numpy()))


def make_inputs():
    return [torch.tensor([1.5, -1.5, 2.5, -0.5])]


def test_upstream_198052_numpy_fix_traced_as_round():
    diffs = check(fix, make_inputs)
    assert bool(diffs) == inductor_wrong(FIXED_IN), diffs


if __name__ == "__main__":
    sys.exit(main(fix, make_inputs, fixed_in=FIXED_IN))
