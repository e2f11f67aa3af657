#!/usr/bin/env python
"""pytorch/pytorch#185464 (closed; right on 2.14): https://github.com/pytorch/pytorch/issues/185464

Fault: ``F.multilabel_margin_loss`` with a ``-1``-padded target: the decomposition used while the
graph is traced does not stop at the first ``-1``; the loss (1.96 vs eager's 1.48) and the
gradient are wrong. Even ``backend="aot_eager"`` is wrong: the ATen graph enn receives after
AOT Autograd, and so enn's eager copy, already computes the wrong loss. Only the graph as Dynamo
handed it over (before AOT Autograd and decompositions) is a right reference.
Torch: wrong under Inductor and aot_eager on 2.11 and 2.13 (CPU); right on 2.14 and 2.15.
Covered by: value_check against the Dynamo graph (the guard's reference where the eager copy
itself is suspect); enn's eager copy cannot show it.
"""

import sys

import torch
import torch.nn.functional as F

from upstream_corpus import awaiting_value_check, check, main

ISSUE = 185464
MECHANISM = "value_check"
FIXED_IN = (2, 14)


def multilabel_margin(x, target):
    return F.multilabel_margin_loss(x, target)


def make_inputs():
    return [torch.tensor([[1.0, -1.0, 0.5, 0.3, -0.2]], requires_grad=True), torch.tensor([[0, 1, -1, -1, -1]])]


@awaiting_value_check(FIXED_IN, "enn's eager copy computes the same wrong loss (the decomposition runs while "
                                "AOT Autograd traces), and the value check has no Dynamo-graph reference")
def test_upstream_185464_multilabel_margin_decomposition():
    assert not check(multilabel_margin, make_inputs, grad=True)


if __name__ == "__main__":
    sys.exit(main(multilabel_margin, make_inputs, grad=True, fixed_in=FIXED_IN))
