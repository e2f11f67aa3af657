#!/usr/bin/env python
"""pytorch/pytorch#186799 (open upstream): https://github.com/pytorch/pytorch/issues/186799

Fault: ``torch.atan2(x, y).amin(dim=-1)``: the forward is right, the backward is not -- the
gradient at one or more argmin positions is dropped (0.0 instead of the upstream value).
``backend="aot_eager"`` is right; Inductor's decompositions, applied while AOT Autograd traces
the joint graph, make the backward wrong, so enn's eager copy of the backward graph (which has
them too) agrees with the compiled backward and the per-graph value check sees nothing.
Torch: wrong under Inductor on 2.13 (CPU; x.grad off by 0.09 on these inputs).
Covered by: value_check against the Dynamo graph (guard/dynamo_reference.py): on the unit's first
call, the gradients its compiled backward gives are compared with those of the graph Dynamo
handed over run through autograd on the same inputs and cotangents; an fp64 run sides with the
Dynamo graph: a ``dynamo_graph`` fallback in the backward, the call returns the Dynamo graph's
gradients, and the unit runs the Dynamo graph from then on.
"""

import sys

import torch

from upstream_corpus import check, main

ISSUE = 186799
MECHANISM = "value_check"
FIXED_IN = None


def atan2_amin(x, y):
    return torch.atan2(x, y).amin(dim=-1)


def make_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, generator=g).requires_grad_(), torch.randn(2, 3, generator=g)]


def test_upstream_186799_atan2_amin_backward():
    assert not check(atan2_amin, make_inputs, grad=True)


if __name__ == "__main__":
    sys.exit(main(atan2_amin, make_inputs, grad=True, fixed_in=FIXED_IN))
