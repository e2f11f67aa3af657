#!/usr/bin/env python
"""enn minimized repro: compile with 1 compute node(s) (aten.mul.Tensor), from 9

Fault: an Inductor lowering raises while compiling (a broken enn lowering looks like this).
Source: injected with ENN_FAULT_INJECT=aten.mul:nan:compile on Linear-GELU-Linear (inference);
the compile-time fault's graph (9 nodes) minimized to 1 node.
What enn must do: record a compile_error fallback that blames mul, recompile the graph
without enn's rewrites and lowerings, and return eager's result.

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


PHASE = 'inference'
OPTIONS = {"fault_inject": "aten.mul:nan:compile"}
EXPECT = {"kind": "compile", "nodes": ["mul"], "what": "enn's compile raised InductorError: LoweringException: InjectedFault: enn injected fault: lowering raised at compile time (ENN_FAULT_INJECT) (caused by LoweringException: InjectedFault: enn injected fault: lowering raised at compile time (ENN_FAULT_INJECT))"}
INPUTS = [
    {"kind": "tensor", "shape": [3, 16], "stride": [16, 1], "dtype": "float32", "device": "cpu"},
]
CONSTANTS = {}
HERE = os.path.dirname(os.path.abspath(__file__))


class Repro(torch.nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, arg0_1):
        mul = torch.ops.aten.mul.Tensor(arg0_1, 0.5);  arg0_1 = None
        return (mul,)



def make_module():
    return load_constants(Repro(), os.path.join(HERE, 'constants.pt'), CONSTANTS)


def make_inputs():
    generated = regenerate(INPUTS, seed=0)
    return [
        torch.tensor([4.589781284332275, -1.64218270778656, 0.651856541633606, 0.21530678868293762, 2.9339752197265625, 0.11824212968349457, -5.963603973388672, 0.5404248833656311, -3.905709981918335, -4.851681232452393, -3.318861722946167, -2.379519462585449, 1.6269694566726685, -6.234053611755371, -3.668302297592163, 1.4654288291931152, -0.32606229186058044, -0.9229307174682617, -1.2810611724853516, -0.1476590633392334, 1.2356206178665161, 0.397530734539032, 1.7415006160736084, 1.7598718404769897, -0.16565847396850586, 1.4302475452423096, 0.4293723702430725, -0.7570133805274963, 0.6926683783531189, -1.148514747619629, -1.4624156951904297, -0.21528057754039764, 1.1359115839004517, 4.2486467361450195, -2.354464054107666, -6.857504367828369, 2.4160094261169434, 0.047565460205078125, -7.070779323577881, 0.6020075678825378, -2.6085758209228516, 0.9646235704421997, -1.3079968690872192, -3.237358570098877, -0.635317325592041, -9.661844253540039, -2.787886619567871, 3.0578298568725586], dtype=torch.float32).reshape([3, 16]).to('cpu'),
    ]


def test_injected_lowering_compile_fault():
    problems = guarded_problems(make_module(), make_inputs(), phase=PHASE, options=OPTIONS, expect=EXPECT)
    assert not problems, problems



if __name__ == "__main__":
    sys.exit(run_repro(make_module, make_inputs, phase=PHASE, options=OPTIONS, expect=EXPECT))
