"""Inductor lowerings for enn's ops (installed as ``enn_backend.lowerings``).

Lowerings are data: :data:`LOWERINGS` maps an op to a function that builds Inductor
IR for it. They are installed into Inductor's global table only inside
:func:`enn_lowerings`, i.e. only while enn compiles a graph; ``backend="inductor"``
in the same process never sees them. An enn op with no entry here becomes an extern
kernel call (Inductor's implicit fallback), which is always correct.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import enn_backend.custom_ops  # noqa: F401  (registers the ops the lowerings name)
from enn_backend import compat

from . import faults, fp8, gemm, precision

# op -> lowering(*args, **kwargs) returning Inductor IR; one module per family of enn ops
LOWERINGS: dict[Any, Callable[..., Any]] = {**faults.LOWERINGS, **precision.LOWERINGS, **gemm.LOWERINGS,
                                             **fp8.LOWERINGS}


@contextlib.contextmanager
def enn_lowerings(enabled: bool = True) -> Iterator[None]:
    """Install enn's lowerings for the duration of one compile."""
    with compat.inductor_lowerings_patched(LOWERINGS if enabled else {}):
        yield
