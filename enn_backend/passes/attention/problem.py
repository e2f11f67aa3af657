"""What decides which kernel may run one attention: :class:`AttentionProblem`, metadata only.

The attention pass describes each match as one (enn_backend/passes/attention/plan.py); each
kernel's checker (``kernels/*.py``) reads it and says whether the kernel can run it, and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class AttentionProblem:
    """What decides which kernel may run one attention."""

    device: str  # "cuda" | "cpu" | ...
    capability: tuple[int, int]  # (0, 0) off CUDA
    dtype: str  # "float32" | "bfloat16" | "float16"
    head_dim: int
    head_dim_v: int
    tq: int
    tk: int
    heads_q: int
    heads_kv: int
    causal: bool
    window: int
    has_mask: bool  # a boolean keep-mask tensor
    has_bias: bool  # an additive float tensor
    bias_grad: bool  # the bias needs a gradient
    alibi: bool  # per-head slopes (ALiBi-like), no tensor bias
    training: bool
    dropout: float = 0.0
    static_shapes: bool = True  # Tq / Tk are fixed (not dynamic-shape symbols)
    bias_finite: bool = False  # the bias provably holds no -inf (e.g. HF's (1 - mask) * finfo.min)
    bias_may_saturate: bool = False  # ... but may hold finfo.min: a fully masked row is uniform in eager
    key_padding: bool = False  # the bias is a [B, 1, 1, Tk] key-padding bias, rows that keep no key fixed up
    batch: int = 1

    @property
    def scores(self) -> int:
        """Attention scores per call, ``B * Hq * Tq * Tk``: what an unfused attention writes and reads back."""
        return self.batch * self.heads_q * self.tq * self.tk

    @property
    def low_precision(self) -> bool:
        return self.dtype in ("bfloat16", "float16")


# A kernel's checker: (can it run this problem, why / why not).
Checker = Callable[[AttentionProblem], "tuple[bool, str]"]
