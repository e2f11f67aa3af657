#!/usr/bin/env python
"""pytorch/pytorch#185464 (closed; right on 2.14): https://github.com/pytorch/pytorch/issues/185464

Fault: ``F.multilabel_margin_loss`` with a ``-1``-padded target: the decomposition used while the
graph is traced does not stop at the first ``-1``; the loss (1.96 vs eager's 1.48) and the
gradient are wrong. Even ``backend="aot_eager"`` is wrong: the ATen graph enn receives after
AOT Autograd, and so enn's eager copy, already computes the wrong loss. Only the graph as Dynamo
handed it over (before AOT Autograd and decompositions) is a right reference.
Torch: wrong under Inductor and aot_eager on 2.11 and 2.13 (CPU); right on 2.14 and 2.15.
Covered by: value_check against the Dynamo graph (guard/dynamo_reference.py): on the unit's first
call the compiled loss and the eager copy's (both 1.96) differ from the graph Dynamo handed over,
run eagerly (1.48), whose fp64 run sides with it: a ``dynamo_graph`` fallback, the call returns the
Dynamo graph's loss with its gradient (eager's autograd), and the unit runs the Dynamo graph from
then on (a decomposition wrong only in its backward is caught by the same reference's gradient
check: repro_upstream_186799_atan2_amin_backward.py).
"""

import sys

import torch
import torch.nn.functional as F

from upstream_corpus import check, main

ISSUE = 185464
MECHANISM = "value_check"
FIXED_IN = (2, 14)


def multilabel_margin(x, target):
    return F.multilabel_margin_loss(x, target)


def make_inputs():
    return [torch.tensor([[1.0, -1.0, 0.5, 0.3, -0.2]], requires_grad=True), torch.tensor([[0, 1, -1, -1, -1]])]


def test_upstream_185464_multilabel_margin_decomposition():
    assert not check(multilabel_margin, make_inputs, grad=True)


if __name__ == "__main__":
    sys.exit(main(multilabel_margin, make_inputs, grad=True, fixed_in=FIXED_IN))
