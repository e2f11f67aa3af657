"""Whether a graph's host work pays for Inductor's C++ wrapper and combo kernels, decided per graph.

Both options shorten the host's work per kernel launched -- the C++ wrapper launches each kernel
from C++ instead of one Python call, combo kernels launch fewer kernels -- and both cost compile
time: a C++ build of every wrapper, combined kernels that are autotuned. They pay back only on a
graph whose step waits on the host. The rule (:func:`choose`):

    host_us   = kernels x PYTHON_WRAPPER_US_PER_KERNEL     (the Python wrapper's launch work)
    host-bound  where  host_us >= share x device_us        (the predicted kernel time)
    share     = HOST_SHARE for a training graph, HOST_SHARE_INFERENCE for an inference graph
    a host-bound graph gets enn's launch-saving defaults; any other is built without them.

Whatever the rule says, a graph holding an op the C++ wrapper cannot call
(:func:`cpp_wrapper_refusal`: the RNG-state wrappers of a random op replayed under activation
checkpointing) is built with the Python wrapper, decided before the build.

An inference graph is a step on its own: its launch work shows as idle time as soon as it
outgrows its kernels. A forward or backward graph of a training step launches while the other
half's kernels (and the optimizer's) are still queued, so more of its launch work hides behind
them; the line sits higher.

The rule is applied where :data:`APPLIED` is set, as it is by default. A graph built without
the C++ wrapper inside a compile_fx that set the C++ wrapper's config is built with Inductor's
own config for the Python wrapper (``compat.cpp_wrapper_config``): the one GPU run that applied
the rule without that (H200, torch 2.11; bench/results/gpu-h200/real_build_rule_2026-11-28.md)
measured the decoders it moved to the Python wrapper at 0.81-0.86x Inductor's step time, their
kernels built with launchers meant for a C++ wrapper. What the rule costs and saves is measured
side by side by ``bench/compile_breakdown.py`` (variant ``enn host rule off``: enn's
launch-saving defaults on every graph) and the real-model bench.

``kernels`` and ``device_us`` are estimated from the graph (:func:`estimate`): a kernel for each
GEMM, convolution, attention or other non-pointwise op, and one per chain of pointwise ops (the
chain Inductor fuses); its time from a roofline of the op's FLOPs and the bytes it writes and
reads. The estimate sees the graph before Inductor fuses it and assumes peak rates, so it
predicts fewer microseconds than the kernels take: a graph near the line counts as host-bound,
as every graph did before this rule. Calibrated on the real-model suite, H100 and H200, torch
2.11 (bench/HISTORY.md: ViT, ResNet-18 and T5 training gain 1.35-1.44x from the C++ wrapper at
3.8-9 ms of kernel time and 170-400 launches a step; GPU-bound steps neither gain nor lose;
bench/results/gpu-h200/compile_guard_variants_2026-11-28.log: ViT's graphs, host-bound by the
step's 50-60% idle time, predict 0.046-0.051 kernels per microsecond of kernel time, GPT-2's and
LLaMA's, GPU-bound at 1-3% idle, 0.009-0.024: the line falls between 11 and 20 us per kernel).
Inference, H200 (bench/results/gpu-h200/real_infer_2026-11-28.md): BERT's graphs predict 0.027-0.028
kernels per microsecond and idle 31-42% of the step under the Python wrapper (3-4% with the C++
wrapper, 1.25-1.6x, gpu-h100/real_suite_c.md); GPT-2's predicts 0.022 and idles 3%, the decoders'
0.010 and idle 4-7%: the line for inference falls between 0.022 and 0.027 kernels per microsecond.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from . import compat

APPLIED = True  # see the module's docstring
PYTHON_WRAPPER_US_PER_KERNEL = 15.0  # the Python wrapper's host work per launch, with its share of the step's (2.11)
HOST_SHARE = 0.5  # host-bound: the launch work is at least this share of the kernel time (training graphs)
HOST_SHARE_INFERENCE = 0.35  # the same for an inference graph, a step on its own
PEAK_FLOPS = {torch.bfloat16: 4e14, torch.float16: 4e14}  # per second, tensor cores (H100 class)
PEAK_FLOPS_OTHER = 5e13  # other dtypes
BYTES_PER_S = 2.5e12  # device memory (H100 class)
# the options that save launches (graph_compiler.INDUCTOR_DEFAULTS / COMPILE_FX_DEFAULTS)
LAUNCH_SAVING = ("cpp_wrapper", "combo_kernels", "combo_kernel_per_subkernel_blocks", "combo_kernels_pointwise_only")

_aten = torch.ops.aten
_MM = {_aten.mm.default, _aten.bmm.default, _aten.addmm.default, _aten.baddbmm.default}
_EXTERN_PREFIXES = ("aten.convolution", "aten._scaled_dot_product", "aten._flash_attention", "aten._efficient_attention",
                    "aten._cudnn_attention", "enn.")


@dataclass(frozen=True)
class HostEstimate:
    """A graph's predicted launches and kernel time, and what the rule makes of them."""

    kernels: int
    device_us: float
    inference: bool = False  # a graph that is a whole step (no other half of a training step)

    @property
    def host_us(self) -> float:
        return self.kernels * PYTHON_WRAPPER_US_PER_KERNEL

    @property
    def host_bound(self) -> bool:
        return choose(self.kernels, self.device_us, self.inference)

    def reason(self) -> str:
        verdict = "host-bound" if self.host_bound else "not host-bound"
        what = "an inference graph" if self.inference else "a training graph"
        return (f"{verdict}: ~{self.kernels} kernels x {PYTHON_WRAPPER_US_PER_KERNEL:g} us = {self.host_us:.0f} us of "
                f"launch work against ~{self.device_us:.0f} us of predicted kernel time (the line for {what}: "
                f"{share(self.inference):g}x)")


def share(inference: bool) -> float:
    """The share of the predicted kernel time at which launch work makes a graph host-bound."""
    return HOST_SHARE_INFERENCE if inference else HOST_SHARE


def choose(kernels: int, device_us: float, inference: bool = False) -> bool:
    """Whether a graph of ``kernels`` launches and ``device_us`` of predicted kernel time is
    host-bound, so that enn's launch-saving options pay back their compile time."""
    return kernels * PYTHON_WRAPPER_US_PER_KERNEL >= share(inference) * device_us


def for_graph(defaults: dict[str, Any], estimate_: HostEstimate,
              cannot_wrap: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """enn's Inductor defaults for one graph (where the rule is :data:`APPLIED`, the
    launch-saving ones only if it is host-bound; never the C++ wrapper where ``cannot_wrap``
    says why it cannot build the graph: :func:`cpp_wrapper_refusal`), and the choice as the
    report records it."""
    kept = {k: v for k, v in defaults.items() if not APPLIED or estimate_.host_bound or k not in LAUNCH_SAVING}
    if cannot_wrap:
        kept.pop("cpp_wrapper", None)
    reason = estimate_.reason() + (f"; no C++ wrapper: {cannot_wrap}" if cannot_wrap and "cpp_wrapper" in defaults else "")
    choice = {"options": {k: bool(kept.get(k, False)) for k in ("cpp_wrapper", "combo_kernels") if k in defaults},
              "kernels": estimate_.kernels, "device_us": round(estimate_.device_us, 1), "reason": reason,
              "applied": APPLIED}
    return kept, choice


def cpp_wrapper_refusal(gm: fx.GraphModule) -> str:
    """Why Inductor's C++ wrapper cannot build ``gm`` ("" where it can): a higher-order op that
    Inductor runs as a fallback kernel, which the C++ wrapper has no call for
    (``compat.cpp_wrapper_cannot_call``). Decided before the build: such a graph would fail in
    Inductor's codegen and be built a second time."""
    cannot = compat.cpp_wrapper_cannot_call()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in cannot:
            return f"{n.name} calls {getattr(n.target, '__name__', n.target)}, a higher-order op it cannot call"
    return ""


def estimate(gm: fx.GraphModule, inference: bool = False) -> HostEstimate:
    """Predicted launches and kernel time of a post-AOT ATen graph (see the module's docstring);
    ``inference``: the graph is a whole step (no backward)."""
    kernels, seconds = 0, 0.0
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload) or _is_view(n):
            continue
        out = _bytes(n.meta.get("val"))
        if _extern(n):
            kernels += 1
            seconds += max(_flops(n) / _peak(n), (out + sum(_bytes(a.meta.get("val")) for a in _inputs(n))) / BYTES_PER_S)
        elif torch.Tag.pointwise in n.target.tags:
            if not n.users or any(_ends_chain(u) for u in n.users):
                kernels += 1
                seconds += 2 * out / BYTES_PER_S
        else:
            kernels += 1
            seconds += (out + sum(_bytes(a.meta.get("val")) for a in _inputs(n))) / BYTES_PER_S
    return HostEstimate(kernels, seconds * 1e6, inference)


def _is_view(n: fx.Node) -> bool:
    schema = n.target._schema
    return any(a.alias_info is not None and not a.alias_info.is_write for a in schema.returns)


def _extern(n: fx.Node) -> bool:
    name = str(n.target)
    return n.target in _MM or name.startswith(_EXTERN_PREFIXES)


def _ends_chain(u: fx.Node) -> bool:
    """A user that does not fuse a pointwise producer into its kernel: a GEMM, an attention
    kernel, a graph output."""
    return u.op == "output" or (u.op == "call_function" and isinstance(u.target, torch._ops.OpOverload) and _extern(u))


def _inputs(n: fx.Node) -> list[fx.Node]:
    return [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def _numel(t: torch.Tensor) -> int:
    size = 1
    for s in t.shape:
        size *= compat.size_hint(s)
    return size


def _bytes(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return _numel(v) * v.element_size()
    if isinstance(v, (list, tuple)):
        return sum(_bytes(x) for x in v)
    return 0


def _peak(n: fx.Node) -> float:
    v = n.meta.get("val")
    t = v if isinstance(v, torch.Tensor) else next((x for x in (v or ()) if isinstance(x, torch.Tensor)), None)
    return PEAK_FLOPS.get(t.dtype, PEAK_FLOPS_OTHER) if t is not None else PEAK_FLOPS_OTHER


def _flops(n: fx.Node) -> float:
    """2 x multiply-adds of a GEMM (its output's size x the reduced size), or of attention
    (QK^T and PV); other extern kernels are counted by their bytes."""
    v = n.meta.get("val")
    if n.target in _MM and isinstance(v, torch.Tensor):
        b = n.args[-1] if n.target in (_aten.addmm.default, _aten.baddbmm.default) else n.args[1]
        k = compat.size_hint(b.meta["val"].shape[-2]) if isinstance(b, fx.Node) else 1
        return 2.0 * _numel(v) * k
    if "scaled_dot_product" in str(n.target) or "attention" in str(n.target):
        q, k_ = (n.args[0], n.args[1]) if len(n.args) > 1 else (None, None)
        if isinstance(q, fx.Node) and isinstance(k_, fx.Node):
            qv, kv = q.meta.get("val"), k_.meta.get("val")
            if isinstance(qv, torch.Tensor) and isinstance(kv, torch.Tensor) and qv.dim() >= 2:
                return 4.0 * _numel(qv) * compat.size_hint(kv.shape[-2])
    return 0.0
