"""``torch.library.opcheck`` for every op in the ``enn`` namespace.

The ops are enumerated from torch's dispatcher after importing enn's op packages, so an op
added by anyone is covered, or this suite fails saying that it has no samples.

Convention for sample inputs: a module that defines enn ops sets, at module level,

    OPCHECK_SAMPLES = {"enn::<op>": [(args, kwargs), ...], ...}

or a zero-argument function of that name returning such a dict (to build tensors lazily).
A sample may be ``(args, kwargs, opcheck_kwargs)`` to pass options to opcheck, e.g.
``{"test_utils": (...)}`` to leave out a check that cannot apply (say why next to it).
Samples should cover what the op promises: each dtype it accepts, optional tensors
present and absent, and ``requires_grad=True`` inputs when the op has an autograd formula.
Each (op, sample) pair is one test running opcheck's schema, autograd-registration,
fake-tensor and AOT-dispatch (static + dynamic) checks.

The samples for ``enn::pinned`` and ``enn::fault`` live here: their modules are
infrastructure owned by the guard.
"""

from __future__ import annotations

import importlib
import json
import pkgutil

import pytest
import torch

import enn_backend
from enn_backend import compat


def _pinned_spec(op: str, args: list, kwargs: dict | None = None) -> str:
    return json.dumps({"op": op, "args": {"l": args}, "kwargs": kwargs or {}}, sort_keys=True)


def _local_samples() -> dict[str, list[tuple[tuple, dict]]]:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 4, generator=g), torch.randn(4, 5, generator=g)
    x = torch.randn(2, 6, generator=g)
    return {
        "enn::pinned": [
            # aten.mm(a, b): two tensors, no ints
            ((_pinned_spec("aten.mm.default", [{"t": 0}, {"t": 1}]), [a, b], []), {}),
            # aten.view(x, [s0, 3]): a size passed as an int leaf (a SymInt in a graph)
            ((_pinned_spec("aten.view.default", [{"t": 0}, {"l": [{"s": 0}, 3]}]), [x], [4]), {}),
            # aten.add(a, a, alpha=2) with a keyword argument
            ((_pinned_spec("aten.add.Tensor", [{"t": 0}, {"t": 1}], {"alpha": 2}), [a, a.clone()], []), {}),
        ],
        "enn::fault": [
            # opcheck's AOT-dispatch check compares outputs without equal_nan: NaN != NaN,
            # so that check runs on the "inf" sample; the NaN sample runs the others.
            ((x, "nan"), {}, {"test_utils": ("test_schema", "test_autograd_registration", "test_faketensor")}),
            ((x, "inf"), {}),
            ((x.to(torch.bfloat16), "compile"), {}),  # run eagerly, "compile" returns a copy
        ],
    }


def _op_modules() -> list:
    import enn_backend.custom_ops as pkg

    mods = [pkg]
    for info in pkgutil.walk_packages(pkg.__path__, prefix=pkg.__name__ + "."):
        mods.append(importlib.import_module(info.name))
    return mods


def collect_samples() -> dict[str, list[tuple[tuple, dict]]]:
    samples: dict[str, list[tuple[tuple, dict]]] = {}
    for mod in _op_modules():
        found = getattr(mod, "OPCHECK_SAMPLES", None)
        if callable(found):
            found = found()
        for name, items in (found or {}).items():
            samples.setdefault(name, []).extend(items)
    for name, items in _local_samples().items():
        samples.setdefault(name, []).extend(items)
    return samples


def _resolve(qualname: str):
    ns, name = qualname.split("::")
    return getattr(getattr(torch.ops, ns), name).default


_OPS = (_op_modules(), compat.registered_op_names("enn"))[1]
_SAMPLES = collect_samples()
_CASES = [(op, i) for op in _OPS for i in range(len(_SAMPLES.get(op, [])))]


def test_enn_ops_are_found():
    # The guard's two ops always exist; if enumeration breaks, this catches it.
    assert {"enn::pinned", "enn::fault"} <= set(_OPS), _OPS


def test_every_enn_op_has_opcheck_samples():
    missing = [op for op in _OPS if not _SAMPLES.get(op)]
    assert not missing, (
        f"enn ops without opcheck samples: {missing}. Add OPCHECK_SAMPLES = {{'enn::<op>': [(args, kwargs)]}} "
        "to the module that defines each (see tests/test_opcheck.py)."
    )


def test_samples_name_real_ops():
    unknown = sorted(set(_SAMPLES) - set(_OPS))
    assert not unknown, f"OPCHECK_SAMPLES for ops that are not registered: {unknown}"


@pytest.mark.parametrize("op,index", _CASES, ids=[f"{op}-{i}" for op, i in _CASES])
def test_opcheck(op: str, index: int):
    args, kwargs, *extra = _SAMPLES[op][index]
    torch.library.opcheck(_resolve(op), args, kwargs, **(extra[0] if extra else {}))


def test_fault_raise_kind_raises():
    # opcheck cannot run the "raise" kind (it raises by design): check it here.
    from enn_backend.custom_ops.faults import InjectedFault

    with pytest.raises(InjectedFault):
        torch.ops.enn.fault(torch.ones(2), "raise")


def test_pinned_matches_the_aten_op():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    (out,) = torch.ops.enn.pinned(_pinned_spec("aten.mm.default", [{"t": 0}, {"t": 1}]), [a, b], [])
    torch.testing.assert_close(out, a @ b)
