"""Which kernel runs a GEMM epilogue: :class:`GemmKernel`, a checker per kernel, the rules that
order them, and :data:`POLICY`, the registry's table (``enn_backend.registry.select``).

Epilogue families (:data:`FAMILIES`), what is fused after ``x @ weight.T``:

``bias``       ``+ bias``                       (``enn::gemm_bias_act`` with ``act="none"``)
``relu``       ``relu(. + bias)``               (``act="relu"``; the bias is optional, as below)
``gelu``       exact (erf) GELU                 (``act="gelu"``)
``gelu_tanh``  the tanh approximation of GELU   (``act="gelu_tanh"``; never swapped with ``gelu``)
``silu``       ``silu(. + bias)``               (``act="silu"``)
``residual``   ``. + bias + residual``          (``enn::gemm_residual``: the vendor GEMM's ``beta * C``)

Kernels:

``cublaslt``  CUDA, relu and gelu_tanh with a bias: ``torch._addmm_activation`` (cuBLASLt GEMM with
              the bias + activation epilogue). cuBLASLt's GELU is the tanh approximation, so exact
              GELU never goes here. H200, bf16 8192x4096x4096 linear+bias+GELU: 0.406 ms vs
              Inductor 0.449 ms (``bench/gpu_epilogue.py``).
``onednn``    CPU, ``mkldnn._linear_pointwise``: oneDNN's GEMM with a post-op for every activation
              here (none, relu, erf and tanh GELU, swish).
``addmm``     ``residual``: ``aten.addmm(residual (+ bias), x, weight.T)``, the residual read in the
              GEMM's epilogue (``beta * C``) instead of a second pass over the output.
``inductor``  the un-fused path, behind every choice: Inductor's GEMM and its fused pointwise kernel
              (eager and the safe path: the ATen composite). Its checker accepts every problem.

Rules (:func:`default_order`, calibrated on the CPU numbers of :data:`CPU_MEASUREMENTS` and the
H200 row above): CUDA relu / gelu_tanh with a bias -> cuBLASLt; CPU bf16 / fp16 -> oneDNN where
it has native GEMMs; CPU fp32 -> Inductor (oneDNN measured equal or slower: it reorders the
unpacked fp32 weight each call); ``bias`` alone -> Inductor, whose ``addmm`` already is the vendor
GEMM's bias epilogue; ``residual`` without a bias -> ``addmm`` (one pass over the output saved),
with a bias -> Inductor (adding the bias to the residual first costs the pass ``addmm`` saves).
Gates shared by the fused kernels: a known family, a dtype of fp32 / bf16 / fp16 with a bias of
the same dtype, no max-autotune (Inductor then benchmarks its own GEMM templates with the
epilogue fused, and enn does not pre-empt that), and the family not forced un-fused
(option ``epilogue_off``). With ``measure_ms`` the eligible kernels are timed on the real shapes
(:func:`runner`; ``inductor`` is timed as its eager equivalent, the vendor GEMM + one pointwise op)
and the fastest wins unless the rule's choice is within the noise margin.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from enn_backend import compat
from enn_backend.options import EPILOGUE_FAMILIES
from enn_backend.registry import Measurement, Policy, Selection, choice_key, select

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")  # what the pass fingerprints after a GEMM
EPILOGUE_ACTS = ("none",) + ACTIVATIONS  # what enn::gemm_bias_act takes
FAMILIES = ("bias",) + ACTIVATIONS + ("residual",)
assert FAMILIES == EPILOGUE_FAMILIES, "options.EPILOGUE_FAMILIES lists the same families"
LOW_PRECISION = (torch.bfloat16, torch.float16)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Reference activations (the eager composite, the safe path and the pass's fingerprints).
ACT_FN: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "none": lambda y: y,
    "relu": torch.relu,
    "gelu": lambda y: F.gelu(y, approximate="none"),
    "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
    "silu": F.silu,
}

# oneDNN post-op spelling of each activation: (attr, scalars, algorithm)
ONEDNN_POSTOP = {
    "none": ("none", [], ""),
    "relu": ("relu", [], None),
    "gelu": ("gelu", [], "none"),
    "gelu_tanh": ("gelu", [], "tanh"),
    "silu": ("swish", [], None),
}

# CPU timings behind the oneDNN rule: median microseconds per call of a compiled
# act(F.linear(x, w, b)) under no_grad, torch 2.13 CPU, 1 thread, Xeon with AVX512-BF16 + AMX,
# shared machine (noise +-15%). Columns: inductor = backend="inductor"; enn_off = enn with
# epilogue=False; enn = enn with the oneDNN fused kernel; guard off.
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


class GemmKernel(str, enum.Enum):
    """Every GEMM epilogue kernel enn knows, by the name reports and the ops' ``kernel`` argument use."""

    CUBLASLT = "cublaslt"
    ONEDNN = "onednn"
    ADDMM = "addmm"
    INDUCTOR = "inductor"  # un-fused: Inductor's GEMM + fused pointwise (eager: the ATen composite)

    def __str__(self) -> str:
        return self.value


FUSED = (GemmKernel.CUBLASLT, GemmKernel.ONEDNN, GemmKernel.ADDMM)


@dataclass(frozen=True)
class HwCaps:
    """What the machine offers the fused kernels."""

    device_type: str
    cublaslt: bool = False  # torch._addmm_activation on this CUDA device
    onednn: bool = False  # mkldnn._linear_pointwise usable
    onednn_bf16: bool = False  # oneDNN has native bf16 GEMM here (AVX512-BF16 / AMX)
    onednn_fp16: bool = False  # oneDNN has native fp16 GEMM here (AVX512-FP16 / AMX-FP16)


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


@dataclass(frozen=True)
class GemmProblem:
    """The metadata a GEMM epilogue's kernel choice depends on."""

    device_type: str
    dtype: torch.dtype
    act: str  # one of EPILOGUE_ACTS ("none" for the bias and residual families)
    has_bias: bool
    bias_dtype_matches: bool = True
    autotune: bool = False  # Inductor's max-autotune (GEMM templates) is on
    m: Optional[int] = None  # rows of x (all leading dims); None: not a fixed size
    n: Optional[int] = None
    k: Optional[int] = None
    residual: bool = False  # the residual family: + a full [M, N] tensor
    unfused: bool = False  # the family is forced onto the un-fused path (option epilogue_off)
    layout: str = ""  # how x and weight lie in memory (the choice key's layout)
    caps: Optional[HwCaps] = None  # None: this machine's (hw_caps)

    @property
    def family(self) -> str:
        if self.residual:
            return "residual"
        return "bias" if self.act == "none" else self.act

    @property
    def hw(self) -> HwCaps:
        return self.caps if self.caps is not None else hw_caps(self.device_type)


@dataclass(frozen=True)
class KernelChoice:
    kernel: GemmKernel
    reason: str
    actionable: bool = False  # the user could change something to get a fused kernel
    how: str = "rule"  # rule | measured | cached | fallback (the registry's Selection.how)
    timings_ms: tuple[tuple[str, float], ...] = ()


# --------------------------------------------------------------------------- checkers
def _gates(p: GemmProblem) -> tuple[bool, str]:
    """What every fused kernel needs: a known family, a supported dtype, no max-autotune, not forced off."""
    if p.act not in EPILOGUE_ACTS or (p.residual and p.act != "none"):
        return False, f"activation {p.act!r} is not one of {', '.join(ACTIVATIONS)}"
    if p.unfused:
        return False, f"epilogue_off names {p.family}: the un-fused path is forced"
    if p.dtype not in SUPPORTED_DTYPES:
        return False, f"dtype {p.dtype} is not fp32/bf16/fp16"
    if not p.bias_dtype_matches:
        return False, "bias dtype differs from the GEMM dtype (the add would promote)"
    if p.autotune:
        return False, "max-autotune: Inductor autotunes GEMM templates with the epilogue fused"
    return True, ""


def check_cublaslt(p: GemmProblem) -> tuple[bool, str]:
    """torch._addmm_activation on CUDA: relu or tanh-GELU epilogue, needs a bias vector."""
    ok, why = _gates(p)
    if not ok:
        return False, why
    if p.device_type != "cuda" or not p.hw.cublaslt:
        return False, "not a CUDA device"
    if p.residual or p.act not in ("relu", "gelu_tanh"):
        return False, (f"cuBLASLt has no {p.family} epilogue here (its GELU is the tanh approximation); "
                       "Inductor's GEMM + one fused pointwise kernel is as fast as anything enn has")
    if not p.has_bias:
        return False, "no bias: _addmm_activation needs a bias vector; Inductor's mm + fused activation instead"
    return True, f"cuBLASLt GEMM with bias+{p.act} epilogue (torch._addmm_activation)"


def check_onednn(p: GemmProblem) -> tuple[bool, str]:
    """mkldnn._linear_pointwise on CPU: any activation, no residual, a dtype oneDNN computes natively."""
    ok, why = _gates(p)
    if not ok:
        return False, why
    if p.device_type != "cpu" or not p.hw.onednn:
        return False, "oneDNN not available"
    if p.residual:
        return False, "oneDNN's linear post-ops here take no residual tensor"
    if p.k == 0:
        return False, "K = 0: oneDNN refuses an empty reduction; the result is the bias alone"
    if p.dtype == torch.bfloat16 and not p.hw.onednn_bf16:
        return False, "this CPU has no native bf16 GEMM in oneDNN"
    if p.dtype == torch.float16 and not p.hw.onednn_fp16:
        return False, "this CPU has no native fp16 GEMM in oneDNN"
    return True, (f"oneDNN {str(p.dtype).removeprefix('torch.')} GEMM with {p.act} post-op: 1.1-3x faster than "
                  "Inductor's addmm + C++ pointwise in bf16, measured on CPU")


def check_addmm(p: GemmProblem) -> tuple[bool, str]:
    """aten.addmm with the residual as C: the residual family only."""
    ok, why = _gates(p)
    if not ok:
        return False, why
    if not p.residual:
        return False, "addmm's C operand carries a residual; this epilogue has none"
    return True, "vendor GEMM with the residual as C (beta = 1): the output is written once"


def check_inductor(p: GemmProblem) -> tuple[bool, str]:
    """The un-fused path: always possible."""
    return True, "un-fused: Inductor's GEMM + its fused pointwise kernel"


CHECKERS = {
    GemmKernel.CUBLASLT: check_cublaslt,
    GemmKernel.ONEDNN: check_onednn,
    GemmKernel.ADDMM: check_addmm,
    GemmKernel.INDUCTOR: check_inductor,
}


def default_order(p: GemmProblem) -> tuple[GemmKernel, ...]:
    """The rules: the kernels in the order they are preferred for ``p`` (see the module doc)."""
    GK = GemmKernel
    if p.residual:
        return (GK.INDUCTOR, GK.ADDMM) if p.has_bias else (GK.ADDMM, GK.INDUCTOR)
    if p.act == "none":
        return (GK.INDUCTOR, GK.ONEDNN)  # measurement alone may pick oneDNN
    if p.device_type == "cuda":
        return (GK.CUBLASLT, GK.INDUCTOR)
    if p.device_type == "cpu":
        return (GK.INDUCTOR, GK.ONEDNN) if p.dtype == torch.float32 else (GK.ONEDNN, GK.INDUCTOR)
    return (GK.INDUCTOR,)


# --------------------------------------------------------------------------- kernels
def run_cublaslt(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, act: str) -> torch.Tensor:
    return torch._addmm_activation(bias, x2, weight.t(), use_gelu=(act == "gelu_tanh"))


def run_onednn(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act: str) -> torch.Tensor:
    attr, scalars, algorithm = ONEDNN_POSTOP[act]
    b = None if bias is None else bias.contiguous()
    return torch.ops.mkldnn._linear_pointwise(x2.contiguous(), weight.contiguous(), b, attr, scalars, algorithm)


def run_aten(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act: str) -> torch.Tensor:
    return ACT_FN[act](F.linear(x2, weight, bias))


def run_addmm(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor) -> torch.Tensor:
    c = residual if bias is None else residual + bias
    return torch.addmm(c, x2, weight.t())


def run_residual_aten(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      residual: torch.Tensor) -> torch.Tensor:
    return F.linear(x2, weight, bias) + residual


# --------------------------------------------------------------------------- the registry's table
def runner(kernel: GemmKernel, p: GemmProblem) -> Optional[Callable[[], Any]]:
    """A call of ``kernel`` on random inputs of ``p``'s shapes (None: sizes unknown)."""
    if None in (p.m, p.n, p.k):
        return None
    dev = torch.device(p.device_type)
    g = torch.Generator(device=dev).manual_seed(0) if p.device_type in ("cpu", "cuda") else None
    with compat.real_tensor_mode():
        x = torch.randn(p.m, p.k, device=dev, dtype=p.dtype, generator=g)
        w = torch.randn(p.n, p.k, device=dev, dtype=p.dtype, generator=g)
        b = torch.randn(p.n, device=dev, dtype=p.dtype, generator=g) if p.has_bias else None
        r = torch.randn(p.m, p.n, device=dev, dtype=p.dtype, generator=g) if p.residual else None
    if p.residual:
        fn = run_addmm if kernel is GemmKernel.ADDMM else run_residual_aten
        return lambda: fn(x, w, b, r)
    fns = {GemmKernel.CUBLASLT: run_cublaslt, GemmKernel.ONEDNN: run_onednn, GemmKernel.INDUCTOR: run_aten}
    if kernel not in fns:
        return None
    return lambda: fns[kernel](x, w, b, p.act)


def choice_key_of(p: GemmProblem):
    if None in (p.m, p.n, p.k):
        return None
    epilogue = p.family + ("+bias" if p.has_bias else "")
    return choice_key("gemm_epilogue", (p.m, p.n, p.k), p.layout, epilogue, str(p.dtype).removeprefix("torch."),
                      p.device_type)


POLICY: Policy[GemmKernel, GemmProblem] = Policy(
    op="gemm_epilogue", kernels=GemmKernel, checkers=CHECKERS, order=default_order, fallback=GemmKernel.INDUCTOR,
    runner=runner, key=choice_key_of, device_type=lambda p: p.device_type)


def _unfused_first(p: GemmProblem) -> str:
    """Why :func:`default_order` puts ``inductor`` before an eligible fused kernel for ``p``."""
    if p.residual:
        return "adding the bias to the residual first costs the pass over the output that addmm saves"
    if p.act == "none":
        return "Inductor's addmm already is the vendor GEMM's bias epilogue"
    return "oneDNN's fp32 GEMM measured equal or slower than Inductor's (it reorders the unpacked weight each call)"


def _actionable(p: GemmProblem) -> bool:
    """A decline the user could act on: exact GELU on CUDA (tanh has an epilogue), fp16 on a CPU
    without fp16 GEMM, a bias in another dtype."""
    if not p.bias_dtype_matches:
        return True
    if p.unfused or p.autotune or p.dtype not in SUPPORTED_DTYPES:
        return False
    if p.device_type == "cuda":
        return p.act == "gelu" and p.has_bias
    return p.device_type == "cpu" and p.dtype == torch.float16 and not p.hw.onednn_fp16


def select_kernel(p: GemmProblem, caps: HwCaps | None = None,
                  measurement: Measurement | None = None) -> KernelChoice:
    """The kernel for ``p``: the registry's choice (rules, or measured), else ``inductor``."""
    if caps is not None:
        p = dataclasses.replace(p, caps=caps)
    s: Selection = select(POLICY, p, measurement=measurement)
    reason = s.reason
    if s.kernel is GemmKernel.INDUCTOR and s.how == "rule":
        # why the un-fused path: the rule that ranks it first, else the first fused kernel's refusal
        refused = [v for v in s.verdicts if not v.eligible]
        if len(refused) < len(s.verdicts) - 1:
            reason = f"the rules rank the un-fused path first here: {_unfused_first(p)}"
        elif refused:
            reason = refused[0].reason
    return KernelChoice(s.kernel, reason, actionable=s.kernel is GemmKernel.INDUCTOR and _actionable(p), how=s.how,
                        timings_ms=tuple(sorted(s.timings_ms.items())))


def autotuning() -> bool:
    """Whether Inductor's GEMM autotuning is on in the current (patched) Inductor config."""
    config = compat.inductor_config
    return bool(config.max_autotune or config.max_autotune_gemm)


def layout_of(x: torch.Tensor, weight: torch.Tensor) -> str:
    """``x`` and ``weight`` as the choice key spells their layout: row-major (c) or strided (s)."""
    return f"x:{'c' if x.is_contiguous() else 's'} w:{'c' if weight.is_contiguous() else 's'}"


def problem_of(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act: str,
               residual: Optional[torch.Tensor] = None) -> GemmProblem:
    """The problem of one call (eager, or a pass's fake values)."""
    m = 1
    for s in x.shape[:-1]:
        m = m * s
    sizes = [m, weight.shape[0], weight.shape[1]]
    fixed = all(isinstance(s, int) for s in sizes)
    return GemmProblem(
        device_type=x.device.type, dtype=x.dtype, act=act, has_bias=bias is not None,
        bias_dtype_matches=bias is None or bias.dtype == x.dtype,
        m=sizes[0] if fixed else None, n=sizes[1] if fixed else None, k=sizes[2] if fixed else None,
        residual=residual is not None, layout=layout_of(x, weight))
