"""Constant masks evaluated at compile time (:class:`Constants`), and the band they form.

A mask built from constants (``tril``, ``triu``, ``arange`` compares, LLaMA's additive ``triu`` of
``finfo.min``) or read from a module buffer (nanoGPT's ``tril``) is evaluated on real tensors --
at two probe lengths under dynamic shapes -- and read as no mask, causal, or a sliding-window band.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.fx as fx

from ... import compat
from ...fx_utils import graph_order, is_call, val
from ..manager import ModuleState

log = logging.getLogger(__name__)
aten = torch.ops.aten

_EVAL_LIMIT = 1 << 26  # largest constant mask evaluated at compile time (elements)
PROBES = (16, 23)  # sizes at which a dynamic-shape mask is evaluated (two, so a structure is not a coincidence)


# ----------------------------------------------------------------------------- constant evaluation
def _is_size_symbol(x: fx.Node) -> bool:
    return (x.op == "placeholder" and isinstance(val(x), torch.SymInt)) or is_call(x, aten.sym_size.int)


class Constants:
    """Evaluates subgraphs that depend on constants only, on real tensors, and remembers which
    module buffers (:class:`ModuleState`) the evaluations read: ``reads``, (input index, tensor)."""

    def __init__(self, state: Optional[ModuleState]) -> None:
        self.state = state
        self.reads: list[tuple[int, torch.Tensor]] = []

    def value(self, n: fx.Node, probe: Optional[int] = None) -> Optional[torch.Tensor]:
        """``n`` evaluated (small, static shapes) as a CPU tensor, or None when it is not a constant.

        With ``probe``, symbolic sizes (SymInt placeholders, ``sym_size``) are allowed and each
        of them is evaluated as ``probe``: the mask a dynamic-shape graph builds from its sizes,
        seen at that size. A module buffer counts as a constant (its compile-time value).
        """
        buffers: dict[fx.Node, tuple[int, torch.Tensor]] = {}
        attrs: dict[fx.Node, torch.Tensor] = {}  # tensor constants the traced code made (HF's torch.tensor(0.0))
        order: list[fx.Node] = []
        seen: set[fx.Node] = set()
        stack = [n]
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            if _is_size_symbol(x):
                if probe is None:
                    return None
                order.append(x)
                continue
            if x.op == "placeholder" and self.state is not None:
                got = self.state.value_of(x)
                if got is None or got[1].numel() > _EVAL_LIMIT:
                    return None
                buffers[x] = got
                continue
            if x.op == "get_attr":
                c = getattr(x.graph.owning_module, str(x.target), None)
                if not isinstance(c, torch.Tensor) or c.numel() > _EVAL_LIMIT:
                    return None
                attrs[x] = c
                continue
            if x.op != "call_function":
                return None
            v = val(x)
            if isinstance(v, torch.Tensor):
                if probe is None and any(not isinstance(s, int) for s in v.shape):
                    return None
                if all(isinstance(s, int) for s in v.shape) and v.numel() > _EVAL_LIMIT:
                    return None
            if torch.Tag.nondeterministic_seeded in getattr(x.target, "tags", ()):
                return None
            order.append(x)
            stack.extend(x.all_input_nodes)
        env: dict[fx.Node, Any] = {}
        try:
            with compat.real_tensor_mode():  # joint passes run inside a FakeTensorMode
                for x in sorted(order + list(buffers) + list(attrs), key=graph_order(n.graph)):
                    if _is_size_symbol(x):
                        env[x] = probe
                    elif x in buffers:
                        env[x] = buffers[x][1]
                    elif x in attrs:
                        env[x] = attrs[x]
                    else:
                        env[x] = x.target(*fx.map_arg(x.args, env.__getitem__), **fx.map_arg(x.kwargs, env.__getitem__))
                out = env[n]
                if type(out) is not torch.Tensor:
                    return None  # a FakeTensor means fake mode was active
                # values are read for their structure, next to CPU tensors, whatever the graph's
                # device (copied here: outside this block the pass's fake mode would take the copy)
                out = out.cpu()
        except Exception as exc:  # noqa: BLE001 - an op that will not run on real tensors: not constant
            log.debug("enn attention: constant mask %s not evaluated: %s", n.name, exc)
            return None
        self.reads.extend(buffers.values())
        return out




# ----------------------------------------------------------------------------- structure of constant masks
class Dims(NamedTuple):
    """The sizes a recognizer compares a constant with: query / key lengths (ints, or SymInts under
    dynamic shapes) and query heads."""

    tq: Any
    tk: Any
    heads: int


def band_of(keep: torch.Tensor, tq: int, tk: int) -> Optional[tuple[str, int]]:
    """('none'|'causal'|'window', w) if the keep-mask is that structure for every batch/head."""
    if keep.dim() < 2 or keep.shape[-2:] not in ((tq, tk),):
        return None
    flat = keep.reshape(-1, tq, tk)
    first = flat[0]
    if not bool((flat == first).all()):
        return None
    if bool(first.all()):
        return "none", 0
    i = torch.arange(tq, device=keep.device).view(tq, 1)
    j = torch.arange(tk, device=keep.device).view(1, tk)
    causal = j <= i
    if not bool((first & ~causal).any()):
        # a band: keys i - w < j <= i for some w >= 1 (w = 0 masks every key: no band)
        w = int(first.sum(-1).max())
        if w == 0:
            return None
        band = causal & (i - j < w)
        if bool((first == band).all()):
            return ("causal", 0) if w >= tk else ("window", w)
    return None


def constant_band(node: fx.Node, dims: Dims, ev: Constants,
               keep_of: Callable[[torch.Tensor], Optional[torch.Tensor]]) -> Optional[tuple[str, int]]:
    """('none'|'causal'|'window', w) of a constant mask; ``keep_of(value)`` turns its value into a
    boolean keep-mask (or None). For symbolic Tq / Tk the mask is evaluated at two probe sizes
    and must have the same structure at both."""
    tq, tk = dims.tq, dims.tk
    if isinstance(tq, int) and isinstance(tk, int):
        cv = ev.value(node)
        keep = keep_of(cv) if cv is not None else None
        return band_of(keep, tq, tk) if keep is not None else None
    if not (isinstance(tq, torch.SymInt) and isinstance(tk, torch.SymInt) and str(tq) == str(tk)):
        return None  # only square masks over one symbolic length
    seen = set()
    for p in PROBES:
        cv = ev.value(node, probe=p)
        keep = keep_of(cv) if cv is not None else None
        cls = band_of(keep, p, p) if keep is not None else None
        if cls is None or (cls[0] == "window" and cls[1] >= p):
            return None
        seen.add(cls)
    return seen.pop() if len(seen) == 1 else None

