#!/usr/bin/env python
"""enn minimized repro: nonfinite with 1 compute node(s) (aten.addmm.default), from 6

Fault: a GEMM kernel (aten.addmm) returns NaN in a forward graph while eager is finite.
Source: injected with ENN_FAULT_INJECT=aten.addmm:nan:fwd on Linear-ReLU-Linear (training
step); the guard's repro (6 nodes) minimized by `python -m enn_backend minify` to 1 node.
What enn must do: blame addmm, pin it to eager, return eager's result; the report names addmm.

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


PHASE = 'forward'
OPTIONS = {"fault_inject": "aten.addmm:nan:fwd"}
EXPECT = {"kind": "nonfinite", "nodes": ["addmm"], "what": "compiled output has NaN/Inf where eager is finite"}
INPUTS = [
    {"kind": "tensor", "shape": [16], "stride": [1], "dtype": "float32", "device": "cpu"},
    {"kind": "tensor", "shape": [3, 8], "stride": [8, 1], "dtype": "float32", "device": "cpu"},
    {"kind": "tensor", "shape": [8, 16], "stride": [1, 8], "dtype": "float32", "device": "cpu"},
]
CONSTANTS = {}
HERE = os.path.dirname(os.path.abspath(__file__))


class Repro(torch.nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, arg0_1, arg1_1, arg2_1):
        addmm = torch.ops.aten.addmm.default(arg0_1, arg1_1, arg2_1);  arg0_1 = arg1_1 = arg2_1 = None
        return (addmm,)



def make_module():
    return load_constants(Repro(), os.path.join(HERE, 'constants.pt'), CONSTANTS)


def make_inputs():
    generated = regenerate(INPUTS, seed=0)
    return [
        torch.tensor([-0.12368477135896683, -0.28978002071380615, -0.07520616054534912, 0.07557431608438492, -0.23032793402671814, -0.018144134432077408, 0.2530914843082428, -0.03634537756443024, 0.009826031513512135, -0.030500661581754684, 0.07155261933803558, 0.22480319440364838, 0.3349021077156067, 0.22452616691589355, 0.3356683552265167, -0.02556956559419632], dtype=torch.float32).reshape([16]).to('cpu'),
        torch.tensor([-1.2536547183990479, 0.9868360757827759, -0.494655042886734, -1.2830430269241333, 0.4386492073535919, -0.010704048909246922, 1.338354229927063, -0.27940502762794495, 0.07472498714923859, 0.5599694848060608, 0.5314036011695862, 1.2350903749465942, -1.4777427911758423, -1.7556711435317993, 0.07616609334945679, -1.0786033868789673, -1.6034189462661743, 0.058098483830690384, -0.6302464604377747, 0.7466416358947754, -0.06402487307786942, 1.0384255647659302, 0.9068235158920288, -0.47551384568214417], dtype=torch.float32).reshape([3, 8]).to('cpu'),
        generated[2],
    ]


def test_injected_addmm_nan_fwd():
    problems = guarded_problems(make_module(), make_inputs(), phase=PHASE, options=OPTIONS, expect=EXPECT)
    assert not problems, problems



if __name__ == "__main__":
    sys.exit(run_repro(make_module, make_inputs, phase=PHASE, options=OPTIONS, expect=EXPECT))
