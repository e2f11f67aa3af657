"""Which kernel runs a fused attention: :func:`choose` asks each kernel's checker in order.

- ``flash`` / ``cudnn`` / ``efficient`` / ``math``: SDPA on CUDA (kernels/sdpa.py);
- ``flex``: FlexAttention (compiled), for causal / window / ALiBi structure with no mask tensor;
- ``cpu_flash``: ATen's CPU flash kernel; ``explicit``: enn's own fp32 math (always possible);
- ``inductor``: do not fuse (:func:`check_inductor`; the default orders try it first).

Preference: ``attention_backend`` (ENN_ATTENTION_BACKEND) forces one; ``attention_order``
(ENN_ATTENTION_ORDER) sets the order; else the default order for the device. A forced choice
that its checker refuses falls back to the first one that passes, and the caller records a
``FallbackKind.KERNEL_CHOICE`` with the checker's reason.

The choice is made by the kernel registry (``enn_backend.registry.select``) from :data:`POLICY`:
these checkers, the default orders as its rules, ``explicit`` as the fallback behind every
choice. With measurement on (a :class:`~enn_backend.registry.Measurement`, from ``measure_ms`` or
max-autotune) and no kernel forced, the eligible SDPA kernels of an attention with no mask,
bias or dropout tensor (causal or none) are timed on the real shapes (:func:`runner`); the
decision to leave a site to Inductor stays the rules' (Inductor's code cannot be timed before
it is compiled).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from ...custom_ops.attention import Backend
from ...registry import ChoiceKey, Measurement, Policy, choice_key, select
from .kernels import (check_cpu_flash, check_cudnn, check_efficient, check_explicit, check_flash, check_flex,
                      check_math)
from .problem import AttentionProblem, Checker

B = Backend
# Measured on an H200 (torch 2.11, bf16, B4 H16 D64; see bench/gpu_attention.py): cuDNN's Hopper
# kernels and FA2 are close; cuDNN is tried first on sm90+, flash first before that.
# flex comes before memory-efficient: for ALiBi / window structure it needs no T x T bias tensor
# (and refuses mask / bias tensors, which memory-efficient takes).
DEFAULT_ORDER_HOPPER = (B.CUDNN, B.FLASH, B.FLEX, B.EFFICIENT, B.MATH, B.EXPLICIT)
DEFAULT_ORDER_CUDA = (B.FLASH, B.FLEX, B.EFFICIENT, B.CUDNN, B.MATH, B.EXPLICIT)
# CPU: after check_inductor (which keeps all but causal / unmasked inference with Inductor), ATen's
# flash kernel; explicit is the last resort.
DEFAULT_ORDER_CPU = (B.CPU_FLASH, B.EXPLICIT)

# Below this many scores per head on CPU, the custom op's per-call cost (~30 us through the Python
# dispatcher, measured on the 2-core CI box, noisy) outweighs what ATen's kernel saves over
# Inductor's own fused C++ softmax: the policy leaves such attention to Inductor ("inductor").
CPU_MIN_SCORES = 64 * 64

# Below this many scores per call (B * Hq * Tq * Tk) a CUDA attention with key padding stays with
# Inductor. Measured on an H100 (bench/gpu_attention_size.py, bf16 inference, attention_size.log):
# the fused path -- cuDNN's host cost, the shared padding bias, the dead-row fix-up -- costs 55-105 us
# more host time per call than Inductor's unfused code, and saves -3 us of device time at 1.6M
# scores, 0 at 6.3M (T5's cross-attention), 27 at 25M, 74 at 50M (BERT). Below the threshold the
# saving never pays for the host time, which a short step (T5 inference) waits for. Training was
# not measured apart: its backward adds both more host time (the dead rows' gradients) and more
# device time saved.
CUDA_MIN_PADDING_SCORES = 1 << 25


def check_inductor(p: AttentionProblem) -> tuple[bool, str]:
    if p.device == "cpu" and p.tq * p.tk < CPU_MIN_SCORES and not p.bias_grad:
        return True, f"CPU, {p.tq}x{p.tk} scores: Inductor's own fused code is cheaper than a kernel call"
    if p.device == "cpu" and not p.bias_grad and not p.training and not (
            p.has_mask or p.has_bias or p.alibi or p.window > 0):
        # Causal (or unmasked) inference: ATen's CPU flash kernel, emitted directly, beat Inductor's
        # fused C++ softmax on the zoo's cpu-small models (2 cores, one thread, 11 interleaved
        # rounds): nanoGPT 1.06x, LLaMA 1.05x. Everything else measured slower fused: training
        # (backward) 0.94-0.97x, BERT's padding mask 0.95x, ALiBi's bias 0.63-0.66x.
        return False, "CPU causal / unmasked inference: ATen's CPU flash kernel measured faster (1.05-1.06x)"
    if p.device == "cpu" and not p.bias_grad:
        return True, ("CPU: Inductor's fused C++ attention measured faster than ATen's flash kernel for training "
                      "(0.94-0.97x), padding masks (0.95x) and biases (0.63-0.66x)")
    if p.device == "cuda" and (p.alibi or p.window > 0) and not (p.has_mask or p.has_bias) and not check_flex(p)[0]:
        # ALiBi / window structure goes to FlexAttention in the graph; where flex cannot take it
        # (dynamic shapes, head dim), enn::attention would run it through a materialized bias.
        return True, "CUDA ALiBi/window that FlexAttention cannot take here: " + check_flex(p)[1]
    if p.device == "cuda" and p.key_padding and p.scores < CUDA_MIN_PADDING_SCORES:
        return True, (f"CUDA key padding, {p.scores / 1e6:.1f}M scores (< {CUDA_MIN_PADDING_SCORES / 1e6:.0f}M): the fused "
                      "path costs more host time than it saves on the device (bench/gpu_attention_size.py)")
    if p.device == "cuda" and p.key_padding and p.window > 0:
        # SDPA's kernels have no window flag and flex takes no padding bias: the window would be
        # materialized inside enn::attention, measured slower than Inductor (below).
        return True, ("CUDA sliding window + key padding: no kernel here takes both without a T x T tensor; "
                      "Inductor's fused code")
    if p.device == "cuda" and (p.has_mask or (p.has_bias and (p.bias_grad or not p.bias_finite or (
            p.bias_may_saturate and p.dtype == "float16")))):
        # A boolean mask, a bias that may hold -inf or one that needs a gradient runs inside
        # enn::attention's Python body (dead-row handling, recompute backward). Measured on an
        # H200 (the first zoo run, bf16) that was slower than Inductor's own fused code (BERT
        # inference 1.93 vs 1.19 ms, T5 2.27 vs 1.04 ms). A provably finite bias without
        # gradient (padding masks, finfo.min ones too outside fp16) is emitted as the
        # memory-efficient kernel itself (zoo BERT on an H100: training 1.03x / 1.01x, inference
        # 1.23x / 1.08x Inductor in two runs, bench/results/gpu-h100/gpu_run1.md and gpu.md).
        return True, ("CUDA attention with a mask tensor, a bias that may hold -inf (or, in fp16, mask a whole "
                      "row with finfo.min), or a bias gradient: Inductor's fused code measured faster than "
                      "enn::attention's mask path")
    return False, "only for tiny CPU problems and CUDA ALiBi / window structure / mask tensors"


CHECKERS: dict[Backend, Checker] = {
    B.CUDNN: check_cudnn,
    B.FLASH: check_flash,
    B.EFFICIENT: check_efficient,
    B.MATH: check_math,
    B.FLEX: check_flex,
    B.CPU_FLASH: check_cpu_flash,
    B.EXPLICIT: check_explicit,
    B.INDUCTOR: check_inductor,  # leave the attention unfused (only via the default orders)
}


def default_order(p: AttentionProblem) -> tuple[Backend, ...]:
    if p.device == "cpu":
        return (B.INDUCTOR,) + DEFAULT_ORDER_CPU
    if p.device == "cuda":
        order = DEFAULT_ORDER_HOPPER if p.capability >= (9, 0) else DEFAULT_ORDER_CUDA
        # check_inductor keeps ALiBi / window (flex is reached only when forced) and mask
        # tensors with Inductor; structural causal / no-mask attention goes to SDPA.
        return (B.INDUCTOR,) + order
    return (B.EXPLICIT,)


def _expand(name: str, p: AttentionProblem) -> list[Backend]:
    """An option's kernel name as backends: 'flash' on CPU means ATen's CPU flash kernel."""
    if name == "flash" and p.device == "cpu":
        return [B.CPU_FLASH]
    if name == "auto":
        return list(default_order(p))
    return [Backend(name)]


_SDPA = {B.FLASH: "FLASH_ATTENTION", B.EFFICIENT: "EFFICIENT_ATTENTION", B.CUDNN: "CUDNN_ATTENTION",
         B.MATH: "MATH", B.CPU_FLASH: "FLASH_ATTENTION"}


def runner(kernel: Backend, p: AttentionProblem) -> Optional[Callable[[], Any]]:
    """SDPA with ``kernel`` forced, on random q / k / v of ``p``'s shapes (forward, and backward
    in training); None for a kernel or a problem that cannot be timed alone (mask / bias / dropout
    tensors, ALiBi, windows, dynamic shapes; flex, explicit and Inductor)."""
    if (kernel not in _SDPA or p.has_mask or p.has_bias or p.alibi or p.window > 0 or p.dropout > 0
            or not p.static_shapes or p.tq <= 0 or p.tk <= 0):
        return None
    dev, dtype = torch.device(p.device), getattr(torch, p.dtype)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(p.batch, p.heads_q, p.tq, p.head_dim, device=dev, dtype=dtype, generator=g)
    k = torch.randn(p.batch, p.heads_kv, p.tk, p.head_dim, device=dev, dtype=dtype, generator=g)
    v = torch.randn(p.batch, p.heads_kv, p.tk, p.head_dim_v, device=dev, dtype=dtype, generator=g)
    backend = getattr(torch.nn.attention.SDPBackend, _SDPA[kernel])
    gqa = p.heads_q != p.heads_kv

    def run() -> Any:
        with torch.nn.attention.sdpa_kernel([backend]), torch.enable_grad():
            qq, kk, vv = ((t.detach().requires_grad_(p.training) for t in (q, k, v)))
            out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=p.causal, enable_gqa=gqa)
            if p.training:
                out.sum().backward()
            return out

    return run


def choice_key_of(p: AttentionProblem) -> Optional[ChoiceKey]:
    if not p.static_shapes:
        return None
    structure = "causal" if p.causal else "none"
    epilogue = structure + ("+train" if p.training else "")
    return choice_key("attention", (p.batch, p.heads_q, p.heads_kv, p.tq, p.tk, p.head_dim, p.head_dim_v), "bhtd",
                      epilogue, p.dtype, p.device)


POLICY: Policy[Backend, AttentionProblem] = Policy(
    op="attention", kernels=Backend, checkers=CHECKERS, order=default_order, fallback=B.EXPLICIT, runner=runner,
    key=choice_key_of, device_type=lambda p: p.device)


@dataclass(frozen=True)
class Choice:
    backend: Backend
    reason: str
    forced_failed: str = ""  # the forced/preferred backend that was impossible, and why
    how: str = "rule"  # rule | measured | cached | fallback (the registry's Selection.how)
    timings_ms: tuple[tuple[str, float], ...] = ()  # measured or cached: each timed kernel's ms

    def measured(self) -> dict[str, Any]:
        """What a kernel choice records of a measurement: how the choice was made, the times."""
        return {"how": self.how, "timings_ms": dict(self.timings_ms)} if self.how in ("measured", "cached") else {}


def choose(p: AttentionProblem, backend: str = "auto", order: str = "",
           measurement: Optional[Measurement] = None) -> Choice:
    """Pick the backend for ``p``: forced -> order -> default order; explicit always works.
    Measurement (when given) applies to the default order only: a kernel the user names is kept."""
    preferred: list[Backend] = []
    if backend != "auto":
        preferred = _expand(backend, p)
    elif order:
        for name in order.split(","):
            preferred += _expand(name.strip(), p)
    fallback = list(default_order(p)) + [B.EXPLICIT]
    if preferred:  # a user who names kernels wants attention fused: never fall back to "unfused"
        fallback = [f for f in fallback if f is not B.INDUCTOR]
    s = select(POLICY, p, order=preferred + fallback, measurement=None if preferred else measurement)
    failed = ""
    if backend != "auto":
        named = {b.value for b in preferred}
        refused = next((v for v in s.verdicts if v.kernel in named and not v.eligible), None)
        failed = f"{backend} impossible: {refused.reason}" if refused is not None else ""
    return Choice(s.kernel, s.reason, failed, s.how, tuple(sorted(s.timings_ms.items())))
