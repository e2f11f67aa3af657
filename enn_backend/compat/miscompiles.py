"""Known miscompiles: a per-torch-version table of ATen nodes Inductor computes wrong, pinned to eager."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.fx

from .versions import TORCH_VERSION

# --- Known miscompiles: ATen nodes Inductor computes wrong, pinned to eager up front ------
# Each entry: a public upstream issue where Inductor on CPU returns finite wrong values or a
# wrong dtype for one ATen node of the graph enn compiles (post AOT Autograd), while the eager
# kernel is right. Checked on torch 2.11, 2.13, 2.14 and 2.15 (CPU): `fixed_in` is the first
# release found right (None: wrong on all four; the issue is open). Each entry names the repro
# in minifier_repros/ that covers it; it goes once enn requires a torch >= its `fixed_in`.
# `devices`: where the wrong step lives. Runs were on CPU only; an entry lists "cuda" too only
# where that step is a device-independent Inductor lowering (read in torch 2.13's lowering.py,
# not run on a GPU); a CPU code-generation or CPU-only decomposition bug stays "cpu".
# The graph compiler pins what `known_miscompiles` lists before it compiles, on every guard mode
# (a pin is not a run-time check): enn_backend/graph_compiler.py, a `known_miscompile` report line.


def _val(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, torch.fx.Node) else x


def _dtype(x: Any) -> Any:
    return getattr(_val(x), "dtype", None)


def _device_type(x: Any) -> Any:
    return getattr(getattr(_val(x), "device", None), "type", None)


def _narrow_int(dtype: Any) -> bool:
    return dtype in (torch.int8, torch.uint8, torch.int16, torch.int32)


def _floor_division(n: torch.fx.Node) -> bool:
    floor = n.target is not torch.ops.aten.div.Tensor_mode or n.kwargs.get("rounding_mode") == "floor"
    return floor and bool(getattr(_dtype(n), "is_floating_point", False))


def _flattening_argreduce(n: torch.fx.Node) -> bool:
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    return dim is None and getattr(_val(n.args[0]), "ndim", 0) >= 2


@dataclasses.dataclass(frozen=True)
class KnownMiscompile:
    issue: int  # pytorch/pytorch issue number
    ops: tuple[str, ...]  # ATen overloads (str(OpOverload)) the entry may pin
    applies: Callable[[torch.fx.Node], bool]  # does this node of such an op hit the bug
    what: str  # what Inductor computes instead of eager's result
    test: str  # the repro in minifier_repros/ that covers it
    fixed_in: tuple[int, int] | None = None  # first torch release found right; None: open
    devices: tuple[str, ...] = ("cpu",)  # device types of the node's output the bug applies on


KNOWN_MISCOMPILES: tuple[KnownMiscompile, ...] = (
    KnownMiscompile(
        197895, ("aten.div.Tensor_mode", "aten.floor_divide.default"), _floor_division,
        "floating floor division is floor(a / b), one too high where the exact quotient is just "
        "below an integer (1.0 // 0.1 gives 10, eager 9)",
        "repro_upstream_197895_float_floor_division.py", devices=("cpu", "cuda")),  # lowering: div_mode
    KnownMiscompile(
        198057, ("aten.remainder.Tensor", "aten.remainder.Scalar"),
        lambda n: bool(getattr(_dtype(n), "is_floating_point", False)),
        "the vectorized floating remainder is a - floor(a / b) * b: 0 for large quotients "
        "(1e20 % 3 gives 0, eager 2), NaN for an infinite divisor",
        "repro_upstream_198057_float_remainder.py"),
    KnownMiscompile(
        198081, ("aten.any.default", "aten.any.dim", "aten.any.dims"),
        lambda n: _dtype(n.args[0]) == torch.uint8,
        "any() of a uint8 tensor returns bool, not uint8: arithmetic on it no longer wraps",
        "repro_upstream_198081_any_uint8_dtype.py", devices=("cpu", "cuda")),  # lowering: reduce_any
    KnownMiscompile(
        197091, ("aten.ldexp.Tensor",),
        lambda n: _dtype(n.args[0]) != _dtype(n),
        "ldexp's result takes the mantissa's dtype, not the promoted one (fp16 x fp32 gives fp16)",
        "repro_upstream_197091_ldexp_dtype.py", devices=("cpu", "cuda")),  # lowering: ldexp_lowering
    KnownMiscompile(
        191308, ("aten.bmm.default",), lambda n: _narrow_int(_dtype(n)),
        "an integer bmm with a size-1 row decomposes to a sum that returns int64, not the input's dtype",
        "repro_upstream_191308_int_bmm_dtype.py", fixed_in=(2, 15)),
    KnownMiscompile(
        193751, ("aten.argmax.default", "aten.argmin.default"), _flattening_argreduce,
        "argmax / argmin over all dims of a fused producer laid out channels-last returns the "
        "physical, not the logical, index",
        "repro_upstream_193751_argmax_channels_last.py", fixed_in=(2, 15)),
)


def known_miscompiles(gm: torch.fx.GraphModule, version: tuple[int, int] | None = None) -> list[tuple[str, str]]:
    """``(node name, reason)`` for each node of ``gm`` (an ATen graph with ``meta['val']``,
    as AOT Autograd hands it to Inductor) that KNOWN_MISCOMPILES says Inductor computes wrong
    on torch ``version`` (default: this one) and on the device of the node's output. The reason
    names the upstream issue."""
    version = TORCH_VERSION if version is None else version
    live = [e for e in KNOWN_MISCOMPILES if e.fixed_in is None or version < e.fixed_in]
    found = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        for e in live:
            if str(n.target) in e.ops and _device_type(n) in e.devices and e.applies(n):
                until = f"fixed in {e.fixed_in[0]}.{e.fixed_in[1]}" if e.fixed_in else "open"
                found.append((n.name, f"Inductor miscompiles {n.target} on torch {version[0]}.{version[1]}: "
                                      f"{e.what} (pytorch/pytorch#{e.issue}, {until})"))
                break
    return found
