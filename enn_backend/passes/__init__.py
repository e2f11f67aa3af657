"""enn's FX passes: one pattern family per module, run in one fixed order (:data:`PASS_ORDER`).

How passes run (EnnPass, PassContext, PassManager, the FX-cache uuid): manager.py. FX helpers
shared with the guard: enn_backend/fx_utils.py. The graph invariants every pass keeps: README.md.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..options import Options
from . import manager
from .attention import AttentionPass
from .attention.kernels.flex import FlexConstantsPass
from .epilogue import EpiloguePass
from .fp8 import Fp8Pass
from .fp32_tail import Fp32TailPass
from .manager import EnnPass, ModuleState, PassContext, PassFailed, current_module_state, module_state
from .nvtx import NvtxPass
from .precision import PrecisionPass

# All enn passes in run order (each runs in its own stage(s), in this order within a stage).
PASS_ORDER: tuple[type[EnnPass], ...] = (
    # attention first, and in the joint *pre* stage: it must see softmax / masked_fill before
    # Inductor's own fuse_attention (which runs between the pre and post stages) takes the
    # patterns it knows, and before precision rewrites softmax.
    AttentionPass,
    # fp8 before epilogue: it takes the plain mm / addmm GEMMs (fwd and bwd) it finds eligible,
    # which the epilogue would otherwise fuse into enn::gemm_bias_act; the rest stay the epilogue's.
    Fp8Pass,
    # epilogue before precision: it matches addmm + activation as Inductor emits them.
    EpiloguePass,
    # precision after the fusions: it promotes whatever low-precision reductions remain.
    PrecisionPass,
    # fp32 tail last in the joint stage: it wraps the output tail the other passes left.
    Fp32TailPass,
    # flex constants (post-grad) after Inductor's fake-tensor propagation, which needs the lifts
    # the attention pass put around them.
    FlexConstantsPass,
    # nvtx last (post-grad, option nvtx): it wraps the kernels the other passes emitted, in the
    # forward and backward graphs as partitioned.
    NvtxPass,
)

PASSES_BY_NAME: dict[str, type[EnnPass]] = {cls.name: cls for cls in PASS_ORDER}


class PassManager(manager.PassManager):
    """:class:`manager.PassManager` running :data:`PASS_ORDER` unless given other passes."""

    def __init__(self, opts: Options, unit: str, stage: str, passes: Optional[Sequence[type[EnnPass]]] = None,
                 said: set[str] | None = None) -> None:
        super().__init__(opts, unit, stage, PASS_ORDER if passes is None else passes, said)


__all__ = ["PASS_ORDER", "PASSES_BY_NAME", "AttentionPass", "EnnPass", "EpiloguePass", "FlexConstantsPass",
           "Fp32TailPass", "ModuleState", "NvtxPass", "PassContext", "PassFailed", "PassManager", "PrecisionPass",
           "current_module_state", "module_state"]
