"""Which kernel runs a fused attention: pure checkers, metadata in, (ok, reason) out.

The attention pass describes each match as an :class:`AttentionProblem` and asks
:func:`choose` for a backend of ``enn::attention`` (see enn_backend/custom_ops/attention.py):

- ``flash`` / ``cudnn`` / ``efficient`` / ``math``: SDPA on CUDA with that backend forced;
- ``flex``: FlexAttention (compiled), for causal / window / ALiBi structure with no mask tensor;
- ``cpu_flash``: ATen's CPU flash kernel; ``explicit``: enn's own fp32 math (always possible);
- ``inductor``: do not fuse (tiny CPU problems, default order only).

Preference: ``attention_backend`` (ENN_ATTENTION_BACKEND) forces one; ``attention_order``
(ENN_ATTENTION_ORDER) sets the order; else the default order for the device. A forced choice
that its checker refuses falls back to the first one that passes, and the caller records a
``FallbackKind.KERNEL_CHOICE`` with the checker's reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# Measured on an H200 (torch 2.11, bf16, B4 H16 D64; see bench/gpu_attention.py): cuDNN's Hopper
# kernels and FA2 are close; cuDNN is tried first on sm90+, flash first before that.
# flex comes before memory-efficient: for ALiBi / window structure it needs no T x T bias tensor
# (and refuses mask / bias tensors, which memory-efficient takes).
DEFAULT_ORDER_HOPPER = ("cudnn", "flash", "flex", "efficient", "math", "explicit")
DEFAULT_ORDER_CUDA = ("flash", "flex", "efficient", "cudnn", "math", "explicit")
# CPU: after check_inductor (which keeps all but causal / unmasked inference with Inductor), ATen's
# flash kernel; explicit is the last resort.
DEFAULT_ORDER_CPU = ("cpu_flash", "explicit")
_NAME_MAP = {"flash": "flash", "cudnn": "cudnn", "efficient": "efficient", "math": "math",
             "flex": "flex", "explicit": "explicit"}


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
    exporting: bool = False
    bias_finite: bool = False  # the bias provably holds no -inf (e.g. HF's (1 - mask) * finfo.min)
    bias_may_saturate: bool = False  # ... but may hold finfo.min: a fully masked row is uniform in eager


Checker = Callable[[AttentionProblem], "tuple[bool, str]"]


def _low(p: AttentionProblem) -> bool:
    return p.dtype in ("bfloat16", "float16")


def check_explicit(p: AttentionProblem) -> tuple[bool, str]:
    return True, "enn's fp32 math: any device, dtype and mask"


def check_cpu_flash(p: AttentionProblem) -> tuple[bool, str]:
    if p.device != "cpu":
        return False, f"CPU kernel, device is {p.device}"
    if p.head_dim != p.head_dim_v:
        return False, "CPU flash needs equal q/k and v head dims"
    if p.bias_grad:
        return False, "CPU flash backward gives no bias gradient"
    return True, "ATen CPU flash kernel"


def _cuda(p: AttentionProblem) -> tuple[bool, str]:
    if p.device != "cuda":
        return False, f"CUDA kernel, device is {p.device}"
    if p.exporting:
        return False, "export: keep the explicit math (no baked-in CUDA backend)"
    return True, ""


def check_flash(p: AttentionProblem) -> tuple[bool, str]:
    ok, why = _cuda(p)
    if not ok:
        return ok, why
    if p.capability < (8, 0):
        return False, f"flash needs sm80+, have sm{p.capability[0]}{p.capability[1]}"
    if not _low(p):
        return False, f"flash needs fp16/bf16, have {p.dtype}"
    if p.has_mask or p.has_bias or p.alibi:
        return False, "flash takes no mask or bias tensor"
    if p.window > 0:
        return False, "flash (SDPA) has no sliding window"
    if p.head_dim != p.head_dim_v or p.head_dim > 256 or p.head_dim % 8:
        return False, f"flash needs equal head dims, a multiple of 8, <= 256 (have {p.head_dim}/{p.head_dim_v})"
    return True, "SDPA flash: no mask tensor, fp16/bf16, sm80+"


def check_cudnn(p: AttentionProblem) -> tuple[bool, str]:
    ok, why = _cuda(p)
    if not ok:
        return ok, why
    if p.capability < (9, 0):
        return False, "cuDNN attention is preferred on Hopper (sm90) and newer only"
    if not _low(p):
        return False, f"cuDNN attention needs fp16/bf16, have {p.dtype}"
    if p.window > 0 or p.alibi:
        return False, "cuDNN (SDPA) has no sliding window or ALiBi"
    if p.has_mask or p.has_bias:
        return False, "enn runs cuDNN attention without a mask or bias tensor (bias goes to memory-efficient)"
    if p.head_dim > 128 or p.head_dim % 8 or p.head_dim != p.head_dim_v:
        return False, f"cuDNN needs equal head dims, a multiple of 8, <= 128 (have {p.head_dim}/{p.head_dim_v})"
    if p.heads_q != p.heads_kv:
        return False, "cuDNN (SDPA) does not take grouped-query K/V"
    return True, "SDPA cuDNN: Hopper, fp16/bf16"


def check_efficient(p: AttentionProblem) -> tuple[bool, str]:
    ok, why = _cuda(p)
    if not ok:
        return ok, why
    if p.capability < (5, 0):
        return False, "memory-efficient attention needs sm50+"
    if p.head_dim % 8 or p.head_dim_v % 8:
        return False, "memory-efficient attention needs head dims that are multiples of 8"
    if p.window > 0 and p.tk * p.tq > (1 << 24):
        return False, "sliding window as a mask tensor is quadratic in T; use flex"
    if p.has_bias and p.bias_may_saturate and p.dtype == "float16":
        # A row whose every key is at finfo.min is uniform in eager (the bias absorbs the
        # scores). In bf16 / fp32 enn hands the kernel SATURATED_FLOOR there, which it handles
        # (bench/gpu_saturated_rows.py); fp16 cannot hold a bias that absorbs the scores.
        return False, ("fp16 cannot hold a bias that absorbs the scores: a row masked whole with finfo.min "
                       "(left padding) would not be eager's uniform row")
    return True, "SDPA memory-efficient: masks and bias tensors (with bias gradient)"


def check_math(p: AttentionProblem) -> tuple[bool, str]:
    ok, why = _cuda(p)
    if not ok:
        return ok, why
    return True, "SDPA math on CUDA: any mask; quadratic memory"


def check_flex(p: AttentionProblem) -> tuple[bool, str]:
    if p.device == "cpu" and p.training:
        return False, "FlexAttention on CPU is inference-only (no backward)"
    if p.device not in ("cuda", "cpu"):
        return False, f"FlexAttention is used on CUDA (and CPU inference when asked for), device is {p.device}"
    if not p.static_shapes:
        return False, "flex's block mask is built for fixed sequence lengths (dynamic shapes here)"
    if p.exporting:
        return False, "export: FlexAttention is a prototype API"
    if p.has_mask or p.has_bias:
        return False, "flex is used for structure only (causal / window / ALiBi slopes), not mask tensors"
    if not (p.window > 0 or p.alibi):
        return False, "no window or ALiBi for flex to exploit; SDPA's kernels take causal / no mask without a compile"
    if p.head_dim < 16 or p.head_dim & (p.head_dim - 1):
        return False, f"flex's Triton template wants a power-of-two head dim >= 16, have {p.head_dim}"
    return True, "FlexAttention in the graph: structure as score_mod / block_mask, Inductor's Triton flex kernels"


# Below this many scores per head on CPU, the custom op's per-call cost (~30 us through the Python
# dispatcher, measured on the 2-core CI box, noisy) outweighs what ATen's kernel saves over
# Inductor's own fused C++ softmax: the policy leaves such attention to Inductor ("inductor").
CPU_MIN_SCORES = 64 * 64


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


CHECKERS: dict[str, Checker] = {
    "cudnn": check_cudnn,
    "flash": check_flash,
    "efficient": check_efficient,
    "math": check_math,
    "flex": check_flex,
    "cpu_flash": check_cpu_flash,
    "explicit": check_explicit,
    "inductor": check_inductor,  # leave the attention unfused (only via the default CPU order)
}


def default_order(p: AttentionProblem) -> tuple[str, ...]:
    if p.device == "cpu":
        return ("inductor",) + DEFAULT_ORDER_CPU
    if p.device == "cuda":
        order = DEFAULT_ORDER_HOPPER if p.capability >= (9, 0) else DEFAULT_ORDER_CUDA
        # check_inductor keeps ALiBi / window (flex is reached only when forced) and mask
        # tensors with Inductor; structural causal / no-mask attention goes to SDPA.
        return ("inductor",) + order
    return ("explicit",)


def _expand(name: str, p: AttentionProblem) -> list[str]:
    """Option names to backends: 'flash' on CPU means ATen's CPU flash kernel."""
    if name == "flash" and p.device == "cpu":
        return ["cpu_flash"]
    if name == "auto":
        return list(default_order(p))
    return [_NAME_MAP.get(name, name)]


@dataclass(frozen=True)
class Choice:
    backend: str
    reason: str
    forced_failed: str = ""  # the forced/preferred backend that was impossible, and why


def choose(p: AttentionProblem, backend: str = "auto", order: str = "") -> Choice:
    """Pick the backend for ``p``: forced -> order -> default order; explicit always works."""
    preferred: list[str] = []
    if backend != "auto":
        preferred = _expand(backend, p)
    elif order:
        for name in order.split(","):
            preferred += _expand(name.strip(), p)
    fallback = list(default_order(p)) + ["explicit"]
    if preferred:  # a user who names kernels wants attention fused: never fall back to "unfused"
        fallback = [f for f in fallback if f != "inductor"]
    failed = ""
    for i, name in enumerate(preferred + fallback):
        ok, why = CHECKERS[name](p)
        if ok:
            return Choice(name, why, failed)
        if backend != "auto" and i < len(preferred) and not failed:
            failed = f"{backend} impossible: {why}"
    return Choice("explicit", "nothing else applies", failed)
