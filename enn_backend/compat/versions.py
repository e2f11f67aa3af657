"""The torch version enn runs on, and each upstream behaviour a test states, as a named predicate.

Each predicate names the torch versions it holds on, the upstream reason and the test that covers it.
"""

from __future__ import annotations

import torch

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def cpp_emulates_precision_casts() -> bool:
    """torch >= 2.13: Inductor's C++ (CPU) code honours ``emulate_precision_casts``, rounding
    each intermediate to the low-precision dtype as eager does; 2.11 and 2.12 emit the same CPU
    code with it on or off (``codegen/cpp.py`` reads the flag from 2.13: checked in the 2.11,
    2.12.1 and 2.13.0 sources; 2.11 measured). Triton code honours it on every supported torch.
    Covered by tests/test_precision.py::test_emulate_precision_casts_matches_eager_bitwise."""
    return TORCH_VERSION >= (2, 13)


def emulate_precision_casts_rounds_python_scalars() -> bool:
    """torch >= 2.15: under ``emulate_precision_casts`` Inductor's C++ code rounds a Python
    scalar operand of a bf16 op to bf16 (``static_cast<at::BFloat16>(0.33)``; 2.13 and 2.14.1
    emit ``static_cast<float>(0.33)``), where eager multiplies by the scalar in fp32: the
    result is no longer eager's bit for bit (it differs from eager in more elements than
    without emulation). Tensor operands still match eager exactly on every version.
    Covered by tests/test_precision.py::test_emulate_precision_casts_matches_eager_bitwise."""
    return TORCH_VERSION >= (2, 15)


def inductor_compiles_nan_amax() -> bool:
    """torch >= 2.14: Inductor compiles ``amax`` over a NaN-filled constant (pytorch/pytorch
    #188225 fixed); 2.13 raises "ValueError: The argument 'nan' is not comparable" (index
    propagation calls sympy's max on nan). Covered by
    minifier_repros/repro_upstream_188225_amax_nan_constant.py."""
    return TORCH_VERSION >= (2, 14)


def export_traces_compiled_regions() -> bool:
    """torch >= 2.13: ``torch.export`` under ``force_compile_during_fx_trace`` traces through a
    ``torch.compile``'d region. On 2.11 Dynamo's guard on the torch-function mode stack fails on
    the frame that created it ("Guard failed on the same frame it was created"), with any
    backend, ``eager`` included (2.11 and 2.13 measured; 2.12 not). Covered by
    tests/test_export.py::test_a_compile_that_export_asks_for_runs_as_captured."""
    return TORCH_VERSION >= (2, 13)


def cpp_wrapper_tunes_on_real_inputs() -> bool:
    """torch < 2.12: Inductor's C++ wrapper for a CUDA graph is generated in two passes: the
    graph is first compiled with the Python wrapper and run once on its real inputs (compile_fx's
    ``V.real_inputs``; without them, on random ones made from the fake inputs, which may index out
    of bounds), which tunes and records the kernels the C++ wrapper then launches. A backward,
    compiled by AOT Autograd on fake inputs, fails there ("CudaKernelParamCache not populated",
    2.11 measured: bench/results/gpu-h100/real_gaps_cpp_wrapper.log). From 2.12 the JIT C++
    wrapper is generated in one pass and compiles its kernels on its first call (``GraphLowering.
    codegen_with_cpp_wrapper``: checked in the 2.11, 2.12.1, 2.13, 2.14.1 and 2.15 sources).
    Covered by tests/test_guard.py::test_enns_compile_fx_defaults_give_every_graph_a_cpp_wrapper."""
    return TORCH_VERSION < (2, 12)
