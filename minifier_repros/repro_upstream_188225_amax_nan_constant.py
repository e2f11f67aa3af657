#!/usr/bin/env python
"""enn minimized repro: compile with 2 compute node(s) (aten.full.default, aten.amax.default), from 9

Fault: a real Inductor bug, reproduced on torch 2.13.0 CPU: compiling amax over a NaN-filled
constant raises "ValueError: The argument 'nan' is not comparable" (index propagation calls
sympy max on nan); eager returns NaN. Fixed upstream in torch 2.14
(enn_backend.compat.inductor_compiles_nan_amax).
Source: pytorch/pytorch#188225 (softmax(arccosh(log2(atan2(ones, ones))))); enn's repro of
that graph (Inductor constant-folds the chain into full(nan)) minimized to 2 nodes:
    torch.compile(lambda: torch.full([2, 2], float("nan")).amax(-1, keepdim=True))()  # raises
What enn must do while the bug is there (torch < 2.14): record the compile_error, fall back
(plain Inductor fails too, so the graph runs eagerly) and return eager's NaN unchanged as the
model's own numerics. enn does not bisect compile errors it did not plant, so the report
blames <graph>. From torch 2.14 the graph compiles and enn's fast path returns eager's NaN.

    python <this file>      enn's fast path (guard off) vs eager vs fp64: exit 3 while the
                            fault still reproduces (torch < 2.14), 0 where it is fixed
                            (torch >= 2.14), 4 undecided, 1 the script itself failed
    pytest <this file>      torch < 2.14: enn's guard must handle it (eager's result, the
                            report names it); torch >= 2.14: the fault must not reproduce
"""

import os
import sys
from math import inf, nan

import torch
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree
from torch import device

import enn_backend.custom_ops  # noqa: F401  enn's ops (enn::attention, ...) may appear in the graph
from enn_backend import compat
from enn_backend.debug.replay import check, load_constants, load_inputs, guarded_problems, regenerate, run_repro

NoneType = type(None)


PHASE = 'inference'
OPTIONS = {}
EXPECT = {"kind": "compile", "nodes": ["<graph>"], "what": "enn's compile raised InductorError: ValueError: The argument 'nan' is not comparable."}
INPUTS = [
]
CONSTANTS = {}
HERE = os.path.dirname(os.path.abspath(__file__))


class Repro(torch.nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self):
        full = torch.ops.aten.full.default([2, 2], nan, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
        amax = torch.ops.aten.amax.default(full, [-1], True);  full = None
        return (amax,)



def make_module():
    return load_constants(Repro(), os.path.join(HERE, 'constants.pt'), CONSTANTS)


def make_inputs():
    generated = regenerate(INPUTS, seed=0)
    return [
    ]


def test_upstream_188225_amax_nan_constant():
    if compat.inductor_compiles_nan_amax():
        verdict = check(make_module(), make_inputs(), phase=PHASE, options=OPTIONS)
        assert verdict.kind == "ok", (verdict.message, verdict.details)
    else:
        problems = guarded_problems(make_module(), make_inputs(), phase=PHASE, options=OPTIONS, expect=EXPECT)
        assert not problems, problems



if __name__ == "__main__":
    sys.exit(run_repro(make_module, make_inputs, phase=PHASE, options=OPTIONS, expect=EXPECT))
