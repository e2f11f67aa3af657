"""A function Dynamo compiles again for every new input size, said out loud.

Dynamo makes a dimension dynamic once it has seen a second size of it (automatic dynamic shapes),
but not everywhere: ``dynamic=False`` turns that off, and on some torch versions a tensor reached
through ``**kwargs`` stays static (pytorch#150022) -- a Hugging Face model called as
``model(input_ids=..., attention_mask=...)`` passes its inputs through such wrappers. Then every
new batch length is a new compile of seconds (and, under CUDA graphs, new recordings), and once the
function has been compiled ``recompile_limit`` times (8 by default) Dynamo runs it **eagerly** for
every size it has not compiled: not compiled, not guarded, with one warning from Dynamo. Measured
with dynamic padding (HF BERT, 20 batch lengths, torch 2.11): 8 static compiles, 12 of the 20
lengths eager (bench/HISTORY.md, "CUDA graphs on host-bound steps").

enn sees every compile of a frame: the graph's compile id says which frame it comes from and how
many times Dynamo compiled that frame before (``[0/3]``: frame 0, fourth compile, as
``TORCH_LOGS=recompiles`` prints it). A compile whose inputs are all static and match an earlier
compile of the same frame in everything but their sizes (same inputs, dtypes and ranks) is a
*size recompile*:

- each one counts in the report (``dynamo.size_recompiles``), and the first of a frame is logged
  with the inputs whose sizes changed and what to do (``dynamic=True``, or
  ``torch._dynamo.mark_dynamic`` on the input);
- the compile that reaches Dynamo's ``recompile_limit`` is a ``recompile_limit`` fallback line:
  from then on new sizes of that function run eagerly, outside enn.

Nothing here changes what is compiled or how; it only says what Dynamo did.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx as fx

from . import compat
from .report import Count, FallbackKind, report

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Inputs:
    """What a compile's inputs are, apart from their sizes (``kinds``), and their sizes."""

    kinds: tuple[tuple[str, str, int], ...]  # (name, dtype or type, rank) per input
    sizes: tuple[tuple[int, ...], ...]
    static: bool  # no symbolic size or integer among them


@dataclass
class _Frame:
    """What enn saw of one frame's compiles: each compile's number and inputs, and what it said."""

    compiles: list[tuple[int, Inputs]] = field(default_factory=list)
    first: Any = None  # Dynamo's compile context of the frame's first compile (every graph of it shares it)
    logged: bool = False  # its first size recompile was logged
    limit_said: bool = False  # its recompile_limit fallback was reported (once, whatever its graphs)


_lock = threading.Lock()
_frames: dict[int, _Frame] = {}  # by Dynamo's frame id


def inputs_of(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Inputs:
    """The inputs of a compile: each placeholder's source name (as Dynamo names it), kind and sizes."""
    names = [compat.dynamo_source_name(n) or n.name for n in gm.graph.find_nodes(op="placeholder")]
    kinds, sizes, static = [], [], True
    for name, x in zip(names, example_inputs):
        if isinstance(x, torch.Tensor):
            dims = tuple(x.shape)
            static = static and all(isinstance(d, int) for d in dims)
            kinds.append((name, str(x.dtype), len(dims)))
            sizes.append(tuple(int(d) if isinstance(d, int) else -1 for d in dims))
        else:
            static = static and not isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))
            kinds.append((name, type(x).__name__, 0))
            sizes.append(())
    return Inputs(tuple(kinds), tuple(sizes), static)


def note_compile(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Record a compile of Dynamo's graph ``gm``; report it when it is a size recompile (module doc)."""
    cid = compat.dynamo_compile_id(gm)
    if cid is None:
        return
    frame, nth = cid
    now = inputs_of(gm, example_inputs)
    limit = compat.recompile_limit()
    context = compat.dynamo_compile_context()
    with _lock:
        seen = _frames.get(frame)
        # a frame's first compile starts its history, also when the id comes again: Dynamo numbers
        # frames from 0 again after torch.compiler.reset(), whatever function they are; only the
        # graphs of one compile (split by DDPOptimizer) share a first compile's context
        if seen is None or (nth == 0 and (context is None or seen.first is not context)):
            seen = _frames[frame] = _Frame(first=context if nth == 0 else None)
        # an earlier compile of the frame (not another graph of this one) that differs in sizes only
        earlier = next((c for n, c in seen.compiles if n < nth and c.kinds == now.kinds and c.sizes != now.sizes), None)
        seen.compiles.append((nth, now))
        if earlier is None or not now.static:
            return
        first, seen.logged = not seen.logged, True
        at_limit = nth + 1 >= limit and not seen.limit_said
        seen.limit_said = seen.limit_said or at_limit
    report().count(Count.SIZE_RECOMPILES)
    changed = "; ".join([f"{k[0]} {list(a)} -> {list(b)}"
                         for k, a, b in zip(now.kinds, earlier.sizes, now.sizes) if a != b][:4])
    if first:
        log.warning("enn: Dynamo compiled frame [%d/%d] again for new sizes of static inputs (%s): each new size "
                    "compiles again, and after torch._dynamo.config.recompile_limit=%d compiles the function runs "
                    "eagerly for sizes not seen. dynamic=True in torch.compile, or torch._dynamo.mark_dynamic(tensor, "
                    "dim) on the input, compiles one graph for all sizes.", frame, nth, changed, limit)
    if at_limit:
        report().add_fallback(
            FallbackKind.RECOMPILE_LIMIT, node="<frame>", phase="compile",
            reason=(f"Dynamo compiled frame [{frame}/*] {limit} times (its recompile_limit), the last ones for new "
                    f"sizes of static inputs ({changed})"),
            action=("Dynamo runs this function eagerly (not compiled, not guarded by enn) for every size it has not "
                    "compiled; dynamic=True or torch._dynamo.mark_dynamic compiles one graph for all sizes"))


__all__ = ["Inputs", "inputs_of", "note_compile"]
