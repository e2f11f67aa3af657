"""``enn::fault``: the fault-injection op behind ``ENN_FAULT_INJECT``.

enn plants ``enn::fault(x, kind)`` right after each matching node of a graph it
compiles, so the fault lives inside the compiled artifact, exactly where a broken
kernel's output would be. The eager copy of the graph never contains it.

kind: ``raise`` (a RuntimeError at run time), ``nan`` / ``inf`` (the node's output
replaced by NaN / +Inf), ``compile`` (the op's Inductor lowering raises; see
enn_backend.lowerings).
"""

from __future__ import annotations

import torch

KINDS = ("raise", "nan", "inf", "compile")


class InjectedFault(RuntimeError):
    """Raised by an injected ``raise`` or ``compile`` fault."""


@torch.library.custom_op("enn::fault", mutates_args=())
def fault(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Return ``x`` spoiled as ``kind`` says (or raise)."""
    if kind == "raise":
        raise InjectedFault("enn injected fault: kernel raised (ENN_FAULT_INJECT)")
    if kind == "nan":
        return torch.full_like(x, float("nan"))
    if kind == "inf":
        return torch.full_like(x, float("inf"))
    if kind == "compile":  # only reachable when run eagerly outside Inductor
        return x.clone()
    raise ValueError(f"enn::fault: unknown kind {kind!r}; valid: {', '.join(KINDS)}")


@fault.register_fake
def _fault_fake(x: torch.Tensor, kind: str) -> torch.Tensor:
    return torch.empty_like(x)
