"""``enn::gemm_bias_act(x, weight, bias, act)``: ``act(x @ weight.T + bias)`` in one op.

``x`` is ``[..., K]``, ``weight`` is ``[N, K]`` (the ``nn.Linear`` layout), ``bias`` is
``[N]`` or ``None``; the result is ``[..., N]`` in the dtype of ``x``.

Activations (:data:`ACTIVATIONS`): ``relu``, ``gelu`` (exact, erf), ``gelu_tanh`` (the
tanh approximation) and ``silu``. The two GELUs differ by up to ~5e-4 and are never
interchanged.

Which kernel runs is decided by :func:`select_kernel`, a pure function of the problem
(device, dtype, activation, bias) and the hardware capabilities. The pass
(``enn_backend.passes.epilogue``), the lowering (``enn_backend.lowerings.gemm``) and
the eager implementation below all call it, so they always agree. Kernels:

``cublaslt``  CUDA, relu and gelu_tanh: ``torch._addmm_activation`` (cuBLASLt GEMM with
              the bias + activation epilogue; the pre-activation never reaches memory).
              cuBLASLt's GELU epilogue is the tanh approximation (and so is
              ``_addmm_activation(use_gelu=True)`` on CUDA), so exact GELU never goes here.
              H200, bf16 8192x4096x4096 linear+bias+GELU: 0.406 ms vs Inductor 0.449 ms
              (ANCHORS.md; ``bench/gpu_epilogue.py`` re-measures it).
``onednn``    CPU, bf16 (and fp16 where oneDNN supports it): ``mkldnn._linear_pointwise``,
              oneDNN's GEMM with a post-op for every activation here (erf and tanh GELU,
              relu, swish). See :data:`CPU_MEASUREMENTS` for the numbers behind the rule.
``aten``      the reference composite ``act(F.linear(x, weight, bias))``: what runs when no
              fused kernel applies, and the last step of the eager ladder.

:func:`select_kernel` returns ``inductor`` when no fused kernel beats what Inductor does
on its own (an extern GEMM + one fused pointwise kernel), and always under max-autotune,
where Inductor benchmarks its GEMM templates (activation fused as their epilogue) against
the vendor GEMM itself: the pass then leaves the graph alone and the lowering emits
Inductor IR (``aten`` in eager).

Autograd: the backward needs the pre-activation's derivative. For relu it is read off
the output (``out > 0``), so nothing extra is kept. For gelu, gelu_tanh and silu the op
does not return the pre-activation; the backward recomputes it with one extra GEMM
(``F.linear(x, weight, bias)``) instead of keeping an ``[M, N]`` tensor alive between
forward and backward. That is a memory-for-compute trade (3 GEMMs in backward instead of
2). enn's pass never relies on it: it rewrites a training graph only where the backward
does not read the pre-activation (see the pass).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from enn_backend import compat
from enn_backend.report import FallbackKind, report

from .pinned import register_safe_path

log = logging.getLogger(__name__)

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
LOW_PRECISION = (torch.bfloat16, torch.float16)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Reference activations (also the eager composite and the pass's fingerprints).
ACT_FN = {
    "relu": torch.relu,
    "gelu": lambda y: F.gelu(y, approximate="none"),
    "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
    "silu": F.silu,
}

# oneDNN post-op spelling of each activation: (attr, scalars, algorithm)
ONEDNN_POSTOP = {
    "relu": ("relu", [], None),
    "gelu": ("gelu", [], "none"),
    "gelu_tanh": ("gelu", [], "tanh"),
    "silu": ("swish", [], None),
}

# CPU timings behind the onednn rule: median microseconds per call of a compiled
# act(F.linear(x, w, b)) under no_grad, torch 2.13 CPU, 1 thread, Xeon with AVX512-BF16 + AMX,
# machine shared with other jobs (noise +-15%, worse at 1024^3). Columns:
#   inductor = backend="inductor";  enn_off = enn with epilogue=False;  enn = enn with the
#   oneDNN fused kernel (fp32 forced on for the measurement). enn ran with guard="off" to
#   compare kernels, not the guard.
# (dtype, M, N, K): {act: (inductor, enn_off, enn)}
CPU_MEASUREMENTS = {
    ("bf16", 256, 512, 512): {"relu": (274, 214, 187), "gelu": (306, 297, 187),
                              "gelu_tanh": (444, 472, 261), "silu": (279, 270, 244)},
    ("bf16", 64, 256, 256): {"relu": (55, 55, 51), "gelu": (64, 64, 65),
                             "gelu_tanh": (82, 99, 62), "silu": (61, 68, 61)},
    ("bf16", 1024, 1024, 1024): {"relu": (2747, 4298, 1887), "gelu": (6600, 6612, 6217),
                                 "gelu_tanh": (7770, 7928, 6676), "silu": (6476, 6680, 6295)},
    ("fp32", 256, 512, 512): {"relu": (948, 976, 943), "gelu": (1084, 1102, 1036),
                              "gelu_tanh": (1291, 1282, 1052), "silu": (1031, 1021, 1018)},
    ("fp32", 64, 256, 256): {"relu": (68, 74, 94), "gelu": (81, 78, 100),
                             "gelu_tanh": (94, 95, 98), "silu": (75, 73, 94)},
}
# Reading: bf16 fused is never slower and up to 1.7x faster -> onednn. fp32 fused is equal at
# 256x512x512 (except tanh-GELU, 1.2x) and 20-40% slower at 64x256x256 (oneDNN reorders the
# unpacked fp32 weight on every call) -> fp32 stays with Inductor.

# --------------------------------------------------------------------------- policy
@dataclass(frozen=True)
class HwCaps:
    """What the machine offers the fused kernels."""

    device_type: str
    cublaslt: bool = False  # torch._addmm_activation on this CUDA device
    onednn: bool = False  # mkldnn._linear_pointwise usable
    onednn_bf16: bool = False  # oneDNN has native bf16 GEMM here (AVX512-BF16 / AMX)
    onednn_fp16: bool = False  # oneDNN has native fp16 GEMM here (AVX512-FP16 / AMX-FP16)


@dataclass(frozen=True)
class GemmProblem:
    """The metadata a kernel choice depends on."""

    device_type: str
    dtype: torch.dtype
    act: str
    has_bias: bool
    bias_dtype_matches: bool = True
    autotune: bool = False  # Inductor's max-autotune (GEMM templates) is on


@dataclass(frozen=True)
class KernelChoice:
    kernel: str  # cublaslt | onednn | inductor
    reason: str
    actionable: bool = False  # the user could change something to get a fused kernel


@functools.lru_cache(maxsize=8)
def hw_caps(device_type: str) -> HwCaps:
    """Capabilities of ``device_type`` (read once per process)."""
    if device_type == "cuda":
        return HwCaps("cuda", cublaslt=torch.cuda.is_available())
    if device_type == "cpu":
        onednn = bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        bf16 = fp16 = False
        if onednn:
            try:
                bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
                fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
            except (AttributeError, RuntimeError):
                pass
        return HwCaps("cpu", onednn=onednn, onednn_bf16=bf16, onednn_fp16=fp16)
    return HwCaps(device_type)


def check_activation(act: str) -> tuple[bool, str]:
    if act in ACTIVATIONS:
        return True, f"activation {act}"
    return False, f"activation {act!r} is not one of {', '.join(ACTIVATIONS)}"


def check_dtype(p: GemmProblem) -> tuple[bool, str]:
    if p.dtype not in SUPPORTED_DTYPES:
        return False, f"dtype {p.dtype} is not fp32/bf16/fp16"
    if not p.bias_dtype_matches:
        return False, "bias dtype differs from the GEMM dtype (the add would promote)"
    return True, f"dtype {p.dtype}"


def check_not_autotuning(p: GemmProblem) -> tuple[bool, str]:
    """Under max-autotune Inductor benchmarks its GEMM templates, with the activation fused
    as their epilogue, against the vendor GEMM: enn does not pre-empt that measured choice."""
    if p.autotune:
        return False, "max-autotune: Inductor autotunes GEMM templates with the activation as epilogue"
    return True, "no autotuning"


def check_cublaslt(p: GemmProblem, caps: HwCaps) -> tuple[bool, str]:
    """torch._addmm_activation on CUDA: relu or tanh-GELU epilogue, needs a bias vector."""
    if p.device_type != "cuda" or not caps.cublaslt:
        return False, "not a CUDA device"
    if p.act not in ("relu", "gelu_tanh"):
        return False, (f"cuBLASLt has no {p.act} epilogue (its GELU is the tanh approximation); "
                       "Inductor's GEMM + one fused pointwise kernel is as fast as anything enn has")
    if not p.has_bias:
        return False, "no bias: _addmm_activation needs a bias vector; Inductor's mm + fused activation instead"
    return True, f"cuBLASLt GEMM with bias+{p.act} epilogue (torch._addmm_activation)"


def check_onednn(p: GemmProblem, caps: HwCaps) -> tuple[bool, str]:
    """mkldnn._linear_pointwise on CPU: only where it measured faster than Inductor."""
    if p.device_type != "cpu" or not caps.onednn:
        return False, "oneDNN not available"
    if p.dtype == torch.bfloat16:
        if not caps.onednn_bf16:
            return False, "this CPU has no native bf16 GEMM in oneDNN"
        return True, (f"oneDNN bf16 GEMM with {p.act} post-op: 1.1-3x faster than Inductor's addmm + "
                      "C++ pointwise, measured on CPU")
    if p.dtype == torch.float16:
        if not caps.onednn_fp16:
            return False, "this CPU has no native fp16 GEMM in oneDNN"
        return True, f"oneDNN fp16 GEMM with {p.act} post-op"
    return False, ("fp32 on CPU: oneDNN's fused GEMM measured within noise of Inductor's addmm + fused "
                   "C++ pointwise; Inductor keeps it")


def select_kernel(p: GemmProblem, caps: HwCaps | None = None) -> KernelChoice:
    """The kernel for ``p``: a fused one where it beats Inductor, else ``inductor``."""
    caps = caps if caps is not None else hw_caps(p.device_type)
    ok, why = check_activation(p.act)
    if not ok:
        return KernelChoice("inductor", why)
    ok, why = check_dtype(p)
    if not ok:
        return KernelChoice("inductor", why, actionable=not p.bias_dtype_matches)
    ok, why = check_not_autotuning(p)
    if not ok:
        return KernelChoice("inductor", why)
    if p.device_type == "cuda":
        ok, why = check_cublaslt(p, caps)
        if ok:
            return KernelChoice("cublaslt", why)
        # exact GELU: approximate="tanh" would get the cuBLASLt epilogue; worth telling the user
        return KernelChoice("inductor", why, actionable=p.act == "gelu" and p.has_bias)
    if p.device_type == "cpu":
        ok, why = check_onednn(p, caps)
        if ok:
            return KernelChoice("onednn", why)
        return KernelChoice("inductor", why, actionable=p.dtype == torch.float16)
    return KernelChoice("inductor", f"no fused kernel for device {p.device_type!r}")


def autotuning() -> bool:
    """Whether Inductor's GEMM autotuning is on in the current (patched) Inductor config."""
    config = compat.inductor_config
    return bool(config.max_autotune or config.max_autotune_gemm)


def problem_of(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act: str) -> GemmProblem:
    return GemmProblem(
        device_type=x.device.type,
        dtype=x.dtype,
        act=act,
        has_bias=bias is not None,
        bias_dtype_matches=bias is None or bias.dtype == x.dtype,
    )


# --------------------------------------------------------------------------- kernels
def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def run_cublaslt(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, act: str) -> torch.Tensor:
    return torch._addmm_activation(bias, x2, weight.t(), use_gelu=(act == "gelu_tanh"))


def run_onednn(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act: str) -> torch.Tensor:
    attr, scalars, algorithm = ONEDNN_POSTOP[act]
    b = None if bias is None else bias.contiguous()
    return torch.ops.mkldnn._linear_pointwise(x2.contiguous(), weight.contiguous(), b, attr, scalars, algorithm)


def run_aten(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act: str) -> torch.Tensor:
    return ACT_FN[act](F.linear(x2, weight, bias))


KERNELS = {"cublaslt": run_cublaslt, "onednn": run_onednn, "aten": run_aten, "inductor": run_aten}

_FAILED: set[tuple] = set()  # process-wide: the kernels that failed here (a set add is atomic under the GIL)


def _run_with_ladder(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act: str) -> torch.Tensor:
    """Fused kernel, and on an exception the ATen composite (recorded once per key)."""
    choice = select_kernel(problem_of(x, weight, bias, act))
    x2 = _flat(x)
    key = (choice.kernel, x.device.type, x.dtype, act)
    if choice.kernel in ("cublaslt", "onednn") and key not in _FAILED:
        try:
            out = KERNELS[choice.kernel](x2, weight, bias, act)
            return out.reshape(*x.shape[:-1], weight.shape[0])
        except RuntimeError as exc:
            _FAILED.add(key)
            report().add_fallback(
                FallbackKind.EXCEPTION, node="enn::gemm_bias_act", phase="eager",
                reason=f"{choice.kernel} kernel raised {type(exc).__name__}: {str(exc).strip()[:200]}",
                action=f"ATen composite addmm + {act} for {x.device.type}/{x.dtype}/{act} from now on")
    return run_aten(x2, weight, bias, act).reshape(*x.shape[:-1], weight.shape[0])


# --------------------------------------------------------------------------- the op
def _check_args(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act: str) -> None:
    torch._check(act in ACTIVATIONS, lambda: f"enn::gemm_bias_act: act must be one of {ACTIVATIONS}, got {act!r}")
    torch._check(weight.dim() == 2, lambda: "enn::gemm_bias_act: weight must be [N, K]")
    torch._check(x.dim() >= 1 and x.shape[-1] == weight.shape[1],
                 lambda: f"enn::gemm_bias_act: x[..., K] and weight[N, K] disagree: {tuple(x.shape)} vs {tuple(weight.shape)}")
    torch._check(x.dtype == weight.dtype, lambda: "enn::gemm_bias_act: x and weight dtypes differ")
    if bias is not None:
        torch._check(bias.dim() == 1 and bias.shape[0] == weight.shape[0],
                     lambda: "enn::gemm_bias_act: bias must be [N]")


@torch.library.custom_op("enn::gemm_bias_act", mutates_args=())
def gemm_bias_act(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act: str) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` with the fastest kernel for the device (see module doc)."""
    _check_args(x, weight, bias, act)
    return _run_with_ladder(x, weight, bias, act)


@gemm_bias_act.register_fake
def _gemm_bias_act_fake(x, weight, bias, act):
    _check_args(x, weight, bias, act)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, act = inputs
    ctx.act = act
    ctx.has_bias = bias is not None
    if act == "relu":
        # relu'(pre) = (out > 0): the output is all the backward needs besides x and weight
        ctx.save_for_backward(x, weight, output)
    else:
        # the pre-activation is recomputed in backward (one GEMM) rather than kept alive
        ctx.save_for_backward(x, weight, bias)


def _backward(ctx, grad):
    act = ctx.act
    if act == "relu":
        x, weight, out = ctx.saved_tensors
        g = torch.where(out > 0, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))
    else:
        x, weight, bias = ctx.saved_tensors
        pre = F.linear(x, weight, bias)
        if act == "silu":
            g = torch.ops.aten.silu_backward(grad, pre)
        else:
            g = torch.ops.aten.gelu_backward(grad, pre, approximate="tanh" if act == "gelu_tanh" else "none")
    g2 = _flat(g)
    gx = gw = gb = None
    if ctx.needs_input_grad[0]:
        gx = (g2 @ weight).reshape(x.shape)
    if ctx.needs_input_grad[1]:
        gw = g2.t() @ _flat(x)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        gb = g2.sum(0)
    return gx, gw, gb, None


gemm_bias_act.register_autograd(_backward, setup_context=_setup_context)


@register_safe_path("enn.gemm_bias_act.default")
def _safe_path(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act: str) -> torch.Tensor:
    """What a pinned enn::gemm_bias_act runs: the unfused ATen GEMM + activation."""
    return ACT_FN[act](F.linear(x, weight, bias))


def OPCHECK_SAMPLES() -> dict:
    """Samples for tests/test_opcheck.py: every activation, fp32 and bf16, 2-D and 3-D inputs,
    with and without bias, inputs that require grad (the op has an autograd formula)."""
    g = torch.Generator().manual_seed(0)

    def t(*shape, dtype=torch.float32, grad=False):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad)

    samples = []
    for dtype in (torch.float32, torch.bfloat16):
        grad = dtype == torch.float32
        for act in ACTIVATIONS:
            samples.append(((t(5, 8, dtype=dtype, grad=grad), t(6, 8, dtype=dtype, grad=grad), t(6, dtype=dtype, grad=grad), act), {}))
        samples.append(((t(2, 3, 8, dtype=dtype, grad=grad), t(6, 8, dtype=dtype, grad=grad), None, "relu"), {}))
    return {"enn::gemm_bias_act": samples}
