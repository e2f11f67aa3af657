"""The kernels the attention pass emits, one module each: its checkers (pure: an
:class:`~..problem.AttentionProblem` in, ``(ok, reason)`` out), when it can be emitted, and how
(forward, backward, the reason suffix the report gets).

- sdpa.py: SDPA's ATen kernels themselves (flash / cuDNN / memory-efficient on CUDA, flash on CPU)
- flex.py: FlexAttention higher-order ops, compiled by Inductor
- flex_padding.py: a model's own SDPA call with a causal band and key padding, as flex (sdpa_calls.py)
- enn_op.py: ``enn::attention``, which runs any backend with any mask
"""

from __future__ import annotations

from typing import Any, Union

from ....custom_ops.attention import Backend
from ..problem import AttentionProblem
from .enn_op import EnnOpKernel, check_explicit
from .flex import FlexKernel, check_flex
from .sdpa import SdpaKernel, can_emit, check_cpu_flash, check_cudnn, check_efficient, check_flash, check_math

Kernel = Union[type[EnnOpKernel], type[FlexKernel], type[SdpaKernel]]


def kernel_for(backend: Backend, p: AttentionProblem, bias_last_dim: Any) -> Kernel:
    """Which kernel module emits ``backend`` for ``p``."""
    if backend is Backend.FLEX:
        return FlexKernel
    if can_emit(backend, p, bias_last_dim):
        return SdpaKernel
    return EnnOpKernel


__all__ = ["EnnOpKernel", "FlexKernel", "SdpaKernel", "Kernel", "kernel_for", "check_cpu_flash", "check_cudnn",
           "check_efficient", "check_explicit", "check_flash", "check_flex", "check_math"]
