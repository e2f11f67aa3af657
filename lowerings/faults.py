"""Lowering of ``enn::fault``: an injected ``compile`` fault raises here, inside
Inductor's lowering, exactly where a broken enn lowering would; other kinds become
an extern kernel call so the fault happens when the compiled code runs."""

from __future__ import annotations

import torch

from enn_backend import compat
from enn_backend.custom_ops.faults import InjectedFault


def lower_fault(x, kind: str):
    if kind == "compile":
        raise InjectedFault("enn injected fault: lowering raised at compile time (ENN_FAULT_INJECT)")
    return compat.fallback_lowering(torch.ops.enn.fault.default)(x, kind)


# op -> its lowering (collected by enn_backend.lowerings)
LOWERINGS = {
    torch.ops.enn.fault.default: lower_fault,
}
