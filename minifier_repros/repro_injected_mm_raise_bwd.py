#!/usr/bin/env python
"""enn minimized repro: exception with 1 compute node(s) (aten.mm.default), from 12

Fault: a GEMM kernel (aten.mm) raises in a BACKWARD graph (compiled lazily by AOT Autograd).
Source: injected with ENN_FAULT_INJECT=aten.mm:raise:bwd on Linear-ReLU-Linear (training
step); the guard's repro of the backward graph (12 nodes) minimized to 1 node.
What enn must do: catch the exception in the backward graph, blame mm, pin it, return
eager's gradients; the report names mm.

    python <this file>      enn's fast path (guard off) vs eager vs fp64: exit 3 while the
                            fault still reproduces (0 once fixed upstream, 4 undecided,
                            1 the script itself failed)
    pytest <this file>      enn's guard must handle it: eager's result, the report names it
"""

import os
import sys
from math import inf, nan

import torch
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree
from torch import device

import enn_backend.custom_ops  # noqa: F401  enn's ops (enn::attention, ...) may appear in the graph
from enn_backend.debug.replay import load_constants, load_inputs, guarded_problems, regenerate, run_repro

NoneType = type(None)


PHASE = 'backward'
OPTIONS = {"fault_inject": "aten.mm:raise:bwd"}
EXPECT = {"kind": "exception", "nodes": ["mm"], "what": "the compiled graph raised InjectedFault: enn injected fault: kernel raised (ENN_FAULT_INJECT)"}
INPUTS = [
    {"kind": "tensor", "shape": [3, 4], "stride": [4, 1], "dtype": "float32", "device": "cpu"},
    {"kind": "tensor", "shape": [4, 16], "stride": [16, 1], "dtype": "float32", "device": "cpu"},
]
CONSTANTS = {}
HERE = os.path.dirname(os.path.abspath(__file__))


class Repro(torch.nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, arg0_1, arg1_1):
        mm = torch.ops.aten.mm.default(arg0_1, arg1_1);  arg0_1 = arg1_1 = None
        return (mm,)



def make_module():
    return load_constants(Repro(), os.path.join(HERE, 'constants.pt'), CONSTANTS)


def make_inputs():
    generated = regenerate(INPUTS, seed=0)
    return [
        torch.tensor([-0.02710847184062004, 0.013740490190684795, 0.03816762566566467, -0.08311700820922852, -0.012910756282508373, 0.0069559598341584206, 0.0732981339097023, 0.04366956651210785, -0.044472888112068176, -0.007913152687251568, 0.04635448753833771, -0.04153953865170479], dtype=torch.float32).reshape([3, 4]).to('cpu'),
        torch.tensor([-0.22458037734031677, -0.11851930618286133, 0.1702263057231903, -0.0016206204891204834, -0.12426158785820007, -0.1915779411792755, -0.2339630126953125, -0.21100205183029175, -0.05070918798446655, 0.13710150122642517, 0.13516026735305786, -0.2411079704761505, 0.15594550967216492, -0.195627361536026, -0.0528525710105896, -0.10136815905570984, -0.048153817653656006, -0.04908567667007446, -0.22433748841285706, -0.21585947275161743, -0.039119869470596313, 0.0032330453395843506, -0.11356872320175171, 0.09417480230331421, -0.2250145971775055, -0.01687180995941162, 0.21985486149787903, -0.10197299718856812, 0.22575077414512634, 0.09053844213485718, -0.2256152331829071, 0.1581743359565735, -0.028848618268966675, -0.11160171031951904, 0.19991332292556763, -0.20202380418777466, 0.02682623267173767, -0.05234217643737793, 0.17852815985679626, 0.06978613138198853, 0.12012633681297302, 0.08828973770141602, -0.060118675231933594, -0.05257636308670044, -0.20602035522460938, 0.13546103239059448, 0.19849452376365662, 0.17105621099472046, -0.17634457349777222, 0.011149972677230835, -0.17623353004455566, -0.13762104511260986, -0.1456763744354248, 0.08543625473976135, -0.14897829294204712, -0.005454301834106445, 0.010517030954360962, 0.16115576028823853, -0.18898001313209534, -0.17162805795669556, -0.14516538381576538, 0.17498335242271423, -0.08986625075340271, 0.21087217330932617], dtype=torch.float32).reshape([4, 16]).to('cpu'),
    ]


def test_injected_mm_raise_bwd():
    problems = guarded_problems(make_module(), make_inputs(), phase=PHASE, options=OPTIONS, expect=EXPECT)
    assert not problems, problems



if __name__ == "__main__":
    sys.exit(run_repro(make_module, make_inputs, phase=PHASE, options=OPTIONS, expect=EXPECT))
