"""What the ``repro_upstream_*.py`` scripts share: compile a function with enn's defaults and list
every way its result differs from eager (values, dtypes, shapes, in-place mutations of the
inputs, gradients).

Each script is one public upstream issue where Inductor on a supported torch returns finite
wrong results without an error. It builds its graph inline, says which torch versions it
expects wrong under Inductor and which enn mechanism covers it, and has one test:
``backend="enn"`` with default options returns what eager returns.

    python minifier_repros/repro_upstream_<issue>_<slug>.py   eager vs inductor vs enn, one line
                                                              each; exit 1 while enn differs
    pytest minifier_repros/repro_upstream_<issue>_<slug>.py   enn must return eager's result

Mechanisms: ``attention`` (enn keeps Inductor's attention rewrites off its compiles,
compat.inductor_attention_rewrites_off), ``known_bad`` (compat.KNOWN_MISCOMPILES: the node is
pinned to its eager kernel up front), ``nonfinite`` (the guard's NaN/Inf check), ``value_check``
(the guard compares sampled compiled calls with a reference run: enn's eager copy of each graph,
and the graph Dynamo handed over for the whole unit), ``none`` (enn cannot see it; the script says
what the user gets).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import pytest
import torch

from enn_backend import compat

MECHANISMS = ("attention", "known_bad", "nonfinite", "value_check", "none")


def inductor_wrong(fixed_in: tuple[int, int] | None) -> bool:
    """Is Inductor expected wrong on this torch (``fixed_in``: first release found right)?"""
    return fixed_in is None or compat.TORCH_VERSION < fixed_in


# Cases no enn mechanism covers yet (issue #18), marked strict: once one passes, its mark must go.
# ``why``: one line, what the guard's value check (guard="values" included) misses in this case.
def awaiting_value_check(fixed_in: tuple[int, int] | None, why: str) -> Any:
    return pytest.mark.xfail(inductor_wrong(fixed_in), strict=True, raises=AssertionError,
                             reason=f"the guard's value check does not catch this case yet (issue #18): {why}")


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone().requires_grad_(x.requires_grad)  # clone keeps the memory format
    return x


def _flat(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def run(fn: Callable[..., Any], inputs: Sequence[Any], grad: bool) -> dict[str, list[Any]]:
    """Call ``fn``; with ``grad``, back-propagate a fixed cotangent through its float outputs."""
    inputs = [_clone(x) for x in inputs]
    outs = _flat(fn(*inputs))
    if grad:
        g = torch.Generator().manual_seed(1)
        pairs = [(o, torch.randn(o.shape, generator=g, dtype=o.dtype)) for o in outs
                 if isinstance(o, torch.Tensor) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs])
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    return {"output": [o.detach() if isinstance(o, torch.Tensor) else o for o in outs],
            "input after the call": [x.detach() for x in tensors],
            "gradient of input": [x.grad for x in tensors if x.requires_grad]}


def differences(got: dict[str, list[Any]], want: dict[str, list[Any]]) -> list[str]:
    """Every difference between two :func:`run` results (``want`` is eager's)."""
    out = []
    for what, wants in want.items():
        gots = got[what]
        if len(gots) != len(wants):
            out.append(f"{len(gots)} {what}s, eager has {len(wants)}")
            continue
        for i, (g, w) in enumerate(zip(gots, wants)):
            where = f"{what} {i}"
            if not isinstance(w, torch.Tensor) or not isinstance(g, torch.Tensor):
                if g != w:
                    out.append(f"{where}: {g!r}, eager {w!r}")
            elif g.dtype != w.dtype or g.shape != w.shape:
                out.append(f"{where}: {g.dtype}{list(g.shape)}, eager {w.dtype}{list(w.shape)}")
            elif w.is_floating_point() or w.is_complex():
                if not torch.allclose(g, w, rtol=1e-4, atol=1e-5, equal_nan=True):
                    err = (g.double() - w.double()).abs().nan_to_num(float("inf")).max().item()
                    out.append(f"{where}: max |compiled - eager| = {err:.3g}")
            elif not torch.equal(g, w):
                out.append(f"{where}: {int((g != w).sum())} of {w.numel()} elements differ")
    return out


def check(fn: Callable[..., Any], make_inputs: Callable[[], Sequence[Any]], *, grad: bool = False,
          backend: str = "enn", options: dict[str, Any] | None = None) -> list[str]:
    """How ``torch.compile(fn, backend=backend)`` differs from eager on ``make_inputs()``."""
    inputs = make_inputs()
    want = run(fn, inputs, grad)
    torch._dynamo.reset()
    kwargs = {"options": options} if options else {}
    return differences(run(torch.compile(fn, backend=backend, **kwargs), inputs, grad), want)


def main(fn: Callable[..., Any], make_inputs: Callable[[], Sequence[Any]], *, grad: bool = False,
         fixed_in: tuple[int, int] | None = None) -> int:
    """Script mode: one line for Inductor and one for enn; exit 1 while enn differs from eager."""
    print(f"torch {torch.__version__}: Inductor is expected {'wrong' if inductor_wrong(fixed_in) else 'right'} here")
    status = 0
    for backend in ("inductor", "enn"):
        diffs = check(fn, make_inputs, grad=grad, backend=backend)
        print(f"{backend:9s}", "equals eager" if not diffs else "; ".join(diffs))
        status = 1 if backend == "enn" and diffs else status
    return status
