"""``enn::fault``: the fault-injection op behind ``ENN_FAULT_INJECT``.

enn plants ``enn::fault(x, kind)`` right after each matching node of a graph it
compiles, so the fault lives inside the compiled artifact, exactly where a broken
kernel's output would be. The eager copy of the graph never contains it.

kind: ``raise`` (a RuntimeError at run time), ``nan`` / ``inf`` (the node's output
replaced by NaN / +Inf), ``scale<f>`` (the node's output times ``f``: finite, wrong), ``compile`` (the op's Inductor lowering raises; see
enn_backend.lowerings), or ``<raise|nan|inf>@<n>#<site>``: an intermittent fault that
strikes on every n-th call counted at ``site`` (one planted node of one compiled unit,
named by enn_backend.fault_spec), and returns ``x`` unchanged (a copy) on the others;
``<kind>@<n>+#<site>``: on every call from the n-th on.
"""

from __future__ import annotations

import threading

import torch

from enn_backend.fault_spec import scale_of

KINDS = ("raise", "nan", "inf", "compile")

# Calls of each planted intermittent fault, by site. Sites are unique per compiled unit and
# planted node, so every artifact built from one graph shares its count.
_calls: dict[str, int] = {}
_calls_lock = threading.Lock()


class InjectedFault(RuntimeError):
    """Raised by an injected ``raise`` or ``compile`` fault."""


def parse_kind(kind: str) -> tuple[str, int, str, bool]:
    """``(kind, every, site, onward)`` of a planted fault's ``kind`` argument (``every`` 1: every
    call; ``onward``: every call from the ``every``-th on)."""
    base, at, rest = kind.partition("@")
    if base not in KINDS and not scale_of(base):
        raise ValueError(f"enn::fault: unknown kind {kind!r}; valid: {', '.join(KINDS)}, or <kind>@<n>[+]#<site>")
    if not at:
        return base, 1, "", False
    every, _, site = rest.partition("#")
    onward = every.endswith("+")
    every = every.removesuffix("+")
    if not every.isdigit() or int(every) < 2 or not site or base == "compile":
        raise ValueError(f"enn::fault: bad intermittent kind {kind!r}; expected <raise|nan|inf>@<n>[+]#<site>, n >= 2")
    return base, int(every), site, onward


def _strikes(every: int, site: str, onward: bool) -> bool:
    with _calls_lock:
        n = _calls[site] = _calls.get(site, 0) + 1
    return n >= every if onward else n % every == 0


@torch.library.custom_op("enn::fault", mutates_args=())
def fault(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Return ``x`` spoiled as ``kind`` says (or raise)."""
    base, every, site, onward = parse_kind(kind)
    if every > 1 and not _strikes(every, site, onward):
        return x.clone()
    if base == "raise":
        raise InjectedFault("enn injected fault: kernel raised (ENN_FAULT_INJECT)")
    if base == "nan":
        return torch.full_like(x, float("nan"))
    if base == "inf":
        return torch.full_like(x, float("inf"))
    if scale_of(base):
        return x * scale_of(base)
    return x.clone()  # "compile": only reachable when run eagerly outside Inductor


@fault.register_fake
def _fault_fake(x: torch.Tensor, kind: str) -> torch.Tensor:
    return torch.empty_like(x)
