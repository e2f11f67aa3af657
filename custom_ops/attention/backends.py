"""The attention kernels ``enn::attention`` knows, by the names options, reports and the op use."""

from __future__ import annotations

import enum

class Backend(str, enum.Enum):
    """Every attention kernel enn knows, by the name options, reports and ``enn::attention`` use."""

    EXPLICIT = "explicit"  # enn's own fp32 math: any device, dtype and mask
    CPU_FLASH = "cpu_flash"  # ATen's CPU flash kernel
    FLASH = "flash"  # SDPA on CUDA, this backend forced
    EFFICIENT = "efficient"  # SDPA memory-efficient
    CUDNN = "cudnn"  # SDPA cuDNN
    MATH = "math"  # SDPA math
    FLEX = "flex"  # FlexAttention, compiled
    INDUCTOR = "inductor"  # not a kernel: the attention stays as written and Inductor compiles it

    def __str__(self) -> str:
        return self.value


BACKENDS = tuple(b.value for b in Backend if b is not Backend.INDUCTOR)  # what enn::attention runs
MASKED_ROWS = ("eager", "zero")

# Backends whose backward recomputes P from the saved log-sum-exp (see saturated_counts).
LSE_BACKWARD = frozenset({Backend.CPU_FLASH, Backend.FLASH, Backend.EFFICIENT, Backend.CUDNN, Backend.FLEX})
