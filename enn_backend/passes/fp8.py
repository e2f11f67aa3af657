"""FP8 pass (option ``fp8``): eligible GEMMs -> ``enn::fp8_mm``, a dynamically scaled FP8 GEMM.

Runs on the joint graph (training: forward + backward, before AOT Autograd partitions it;
inference: the forward) and rewrites every ``aten.mm`` and plain ``aten.addmm`` (a ``[N]`` bias,
``alpha = beta = 1``) that passes the rules below, forward and backward alike: a linear layer's
forward GEMM and its two gradient GEMMs are three GEMMs of the graph, each rewritten on its own.
The op scales each operand along its own contraction dimension on every call, so a backward GEMM
quantizes the gradient and the saved activation or weight as torchao's recipes do, and the
backward graph stays consistent with the forward whatever AOT Autograd saves between them.

Formats per operand (``custom_ops.fp8.formats_for``): e4m3, except an operand that is a gradient
under ``tensorwise`` (e5m2). An operand is a gradient when it depends on a tangent input of the
joint graph. Results in the GEMM's own dtype (autocast's), fp32 accumulation.

Rules, in the order they are checked (the first that fails is the GEMM's recorded reason):

1. *device*: the recipe's GEMM runs here. CUDA needs compute capability 8.9 or later (FP8 tensor
   cores: Ada, Hopper) and a torch whose ``_scaled_mm`` runs the recipe (probed once per device,
   dtype and recipe on a 16 x 16 x 16 GEMM). CPU is eligible where torch's CPU ``_scaled_mm``
   runs (probed the same way): it gives FP8's numerics, not its speed (it is a reference
   kernel), which is what tests on CPU need. Elsewhere the option is a no-op, recorded once per
   compiled unit as a ``pass_skipped`` fallback with the reason, and logged as a warning.
2. *dtype*: both operands (and the bias) bf16, fp16 or fp32, the same.
3. *layer*: the GEMMs of the first and the last layer (module path of the forward GEMMs, in
   graph order) stay in their dtype -- the embedding-side and output-side projections are where
   FP8's error costs most accuracy, as torchao and Transformer Engine recommend -- and so do
   those of modules whose path matches a glob of ``fp8_exclude``. A layer's backward GEMMs go
   with its forward GEMM. The first and last layers are those of the compiled graph: a model
   split by graph breaks has first and last layers per graph.
4. *shape*: sizes known at compile time, and M, K and N multiples of 16 (the FP8 tensor-core
   GEMM's layout rule; ``_scaled_mm`` refuses other shapes on CUDA).
5. *pays* (CUDA): FP8 halves the GEMM's ``2 M N K / F`` seconds, and the dynamic casts cost about
   3 bytes per operand element (the amax read fuses into the producer; the cast reads bf16 and
   writes FP8) at the memory bandwidth ``BW``. They pay when ``M N K / (M K + K N) >=
   3 F / BW``: 512 for an H100 (about 600 TFLOP/s bf16 achieved, 3.35 TB/s). A 2048 x 2048 linear
   over 2048 tokens has 1024. On CPU no minimum: there the rewrite is for its numerics.

Every GEMM's decision is a kernel choice in the report (``fp8`` or its dtype, and why), with
its role, formats, scale granularity, shape and module. The pinned path of ``enn::fp8_mm`` is
the GEMM it replaced, in its own dtype (``custom_ops.fp8``): a guard fault demotes that GEMM.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from enn_backend.custom_ops import fp8 as F8

from .. import blame, compat
from ..report import FallbackKind
from ..fx_utils import insert, is_call, val
from .manager import EnnPass, PassContext

log = logging.getLogger(__name__)

aten = torch.ops.aten

MULTIPLE = 16  # M, K and N: the FP8 GEMM's layout rule
MIN_INTENSITY_CUDA = 512  # M N K / (M K + K N) where the dynamic casts pay (module doc, rule 5)
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm89) and Hopper (sm90) on
_META_KEYS = ("stack_trace", "nn_module_stack", "fwd_nn_module_stack", "source_fn_stack", "seq_nr",
              "partitioner_tag", "original_aten", "from_node")


@dataclass(frozen=True)
class Gemm:
    """One GEMM of the graph as the pass sees it."""

    node: fx.Node
    a: fx.Node
    b: fx.Node
    bias: Any  # fx.Node or None
    module: str  # the layer: module path of the forward GEMM it belongs to
    a_is_grad: bool
    b_is_grad: bool

    @property
    def role(self) -> str:
        return "backward" if (self.a_is_grad or self.b_is_grad) else "forward"

    @property
    def mnk(self) -> tuple[Any, Any, Any]:
        a, b = val(self.a), val(self.b)
        return a.shape[0], b.shape[1], a.shape[1]


def find_gemm(n: fx.Node, grads: set[fx.Node]) -> Gemm | None:
    """``n`` as a GEMM the pass may rewrite (``mm``, or ``addmm`` with a ``[N]`` bias), or None."""
    if is_call(n, aten.mm.default) and len(n.args) == 2 and not n.kwargs:
        a, b, bias = n.args[0], n.args[1], None
    elif (is_call(n, aten.addmm.default) and len(n.args) == 3
          and n.kwargs.get("beta", 1) == 1 and n.kwargs.get("alpha", 1) == 1):
        bias, a, b = n.args
        bv = val(bias)
        if not isinstance(bv, torch.Tensor) or bv.dim() != 1:
            return None
    else:
        return None
    if not (isinstance(val(a), torch.Tensor) and isinstance(val(b), torch.Tensor)):
        return None
    return Gemm(n, a, b, bias, blame.site(n).get("module", ""), a in grads, b in grads)


def gradient_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The nodes that depend on a tangent input (AOT Autograd's ``tangents_*`` placeholders)."""
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if (n.op == "placeholder" and n.name.startswith("tangents")) or any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


# ----------------------------------------------------------------- rule 1: the device
@functools.lru_cache(maxsize=32)
def device_support(device_type: str, index: int | None, dtype: torch.dtype, recipe: str) -> tuple[bool, str]:
    """(True, "") where ``recipe``'s FP8 GEMM with ``dtype`` results runs on the device, else
    (False, why). Probed once per process, device, dtype and recipe."""
    if device_type == "cpu":
        ok, why = F8.cpu_scaled_mm_works(dtype, recipe)
        return ok, (f"this torch's CPU _scaled_mm cannot: {why}" if not ok else "")
    if device_type != "cuda":
        return False, f"FP8 GEMMs need CUDA (compute capability 8.9+) or a CPU _scaled_mm; this device is {device_type}"
    device = torch.device("cuda", index if index is not None else torch.cuda.current_device())
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return False, f"FP8 tensor cores need compute capability 8.9 or later; {device} is sm{cap[0]}{cap[1]}"
    ok, why = F8.probe(device, dtype, recipe)
    return ok, (f"torch {torch.__version__} cannot run the {recipe} FP8 GEMM on {device}: {why}" if not ok else "")


# ----------------------------------------------------------------- rules 2-5: the GEMM
def shape_reason(m: Any, n: Any, k: Any, device_type: str) -> str:
    """Why a GEMM of these sizes stays in its dtype (rules 4 and 5), or "" when FP8 takes it."""
    if not all(isinstance(s, int) for s in (m, n, k)):
        return f"sizes M={m}, N={n}, K={k} are not fixed at compile time"
    if m % MULTIPLE or n % MULTIPLE or k % MULTIPLE:
        return f"M={m}, N={n}, K={k}: FP8 GEMMs need every size a multiple of {MULTIPLE}"
    if device_type == "cuda":
        intensity = m * n * k / (m * k + k * n)
        if intensity < MIN_INTENSITY_CUDA:
            return (f"M={m}, N={n}, K={k}: MNK/(MK+KN) = {intensity:.0f} < {MIN_INTENSITY_CUDA}: the dynamic casts "
                    "would cost more than FP8 saves")
    return ""


def excluded(module: str, globs: tuple[str, ...]) -> str:
    """The first glob of ``fp8_exclude`` that ``module`` matches, or ""."""
    return next((g for g in globs if fnmatch.fnmatchcase(module, g)), "")


class Fp8Pass(EnnPass):
    """mm / addmm -> enn::fp8_mm, where the rules of the module doc allow."""

    name = "fp8"
    option = "fp8"
    stage = "joint"

    def __call__(self, graph: fx.Graph, ctx: PassContext) -> int:
        recipe = self.opts.fp8
        if recipe not in F8.RECIPES:
            return 0
        grads = gradient_nodes(graph)
        gemms = [g for n in list(graph.nodes) if (g := find_gemm(n, grads)) is not None]
        if not gemms:
            return 0
        layers = list(dict.fromkeys(g.module for g in gemms if g.role == "forward"))
        ends = {layers[0]: "first", layers[-1]: "last"} if layers else {}
        if len(layers) == 1:
            ends = {layers[0]: "first and last"}
        globs = tuple(p.strip() for p in self.opts.fp8_exclude.split(",") if p.strip())
        unsupported: dict[str, list[fx.Node]] = {}
        matches = 0
        for g in gemms:
            reason = self.reason(g, recipe, ends, globs)
            dtype = str(val(g.node).dtype).removeprefix("torch.")
            where = self.where(g)
            if reason.startswith("device: "):
                unsupported.setdefault(reason, []).append(g.node)
            if reason:
                ctx.kernel_choice(g.node, dtype, f"fp8 declined: {reason}", **where)
                continue
            new = self.rewrite(graph, g, recipe)
            matches += 1
            fa, fb = F8.formats_for(recipe, g.a_is_grad, g.b_is_grad)
            scales = "per row of a, per column of b (power of 2)" if recipe == "rowwise" else "per tensor"
            ctx.kernel_choice(new, "fp8", f"{recipe} FP8 GEMM, {fa} x {fb}, scales {scales}, fp32 accumulation, "
                                          f"{dtype} result", recipe=recipe, formats=[fa, fb], scales=scales, **where)
        for reason, nodes in unsupported.items():
            if ctx.once(f"fp8: {reason}"):
                ctx.fallback(FallbackKind.PASS_SKIPPED, nodes, reason=f"fp8={recipe!r} is a no-op here: {reason[8:]}",
                             action=f"{len(nodes)} GEMM(s) stay in their own dtype", level=logging.WARNING)
        if matches:
            ctx.fusion("fp8", matches)
        log.debug("enn fp8 (%s): %d of %d GEMM(s) in FP8", recipe, matches, len(gemms))
        return matches

    def reason(self, g: Gemm, recipe: str, ends: dict[str, str], globs: tuple[str, ...]) -> str:
        """Why ``g`` stays in its dtype (a rule of the module doc), or "" when FP8 takes it."""
        a, b = val(g.a), val(g.b)
        dtype = a.dtype
        if dtype not in F8.SUPPORTED_DTYPES or b.dtype != dtype or (g.bias is not None and val(g.bias).dtype != dtype):
            return f"dtype: operands {a.dtype} x {b.dtype}; FP8 takes bf16, fp16 or fp32 operands of one dtype"
        device = val(g.node).device
        with compat.real_tensor_mode():  # the probe runs real tensors; passes run in the compile's fake mode
            ok, why = device_support(device.type, device.index, dtype, recipe)
        if not ok:
            return f"device: {why}"
        if g.module in ends:
            return f"layer: {g.module or '<root>'} is the {ends[g.module]} layer of the graph"
        glob = excluded(g.module, globs)
        if glob:
            return f"layer: {g.module} matches fp8_exclude {glob!r}"
        m, n, k = g.mnk
        why = shape_reason(m, n, k, device.type)
        return f"shape: {why}" if why else ""

    def where(self, g: Gemm) -> dict[str, Any]:
        m, n, k = g.mnk
        return {"role": g.role, "module": g.module, "mnk": [m, n, k]}

    def rewrite(self, graph: fx.Graph, g: Gemm, recipe: str) -> fx.Node:
        fa, fb = F8.formats_for(recipe, g.a_is_grad, g.b_is_grad)
        meta = {key: g.node.meta[key] for key in _META_KEYS if key in g.node.meta}
        mode = getattr(val(g.node), "fake_mode", None)
        new = insert(graph, torch.ops.enn.fp8_mm.default, (g.a, g.b, g.bias, recipe, fa, fb), before=g.node,
                     mode=mode, meta=meta)
        g.node.replace_all_uses_with(new)
        graph.erase_node(g.node)
        return new


__all__ = ["Fp8Pass", "Gemm", "device_support", "excluded", "find_gemm", "gradient_nodes", "shape_reason"]
