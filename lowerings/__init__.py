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

import torch

from enn_backend import compat

# op -> lowering(*args, **kwargs) returning Inductor IR
LOWERINGS: dict[Any, Callable[..., Any]] = {}


def register(op: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: add a lowering for ``op`` to enn's table."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        LOWERINGS[op] = fn
        return fn

    return deco


def _load_all() -> None:
    """Import the modules that fill LOWERINGS (each registers its ops)."""
    import enn_backend.custom_ops  # noqa: F401  (the ops must exist first)

    from . import faults  # noqa: F401
    from . import precision  # noqa: F401
    from . import gemm  # noqa: F401

    try:
        from . import attention  # noqa: F401
    except ImportError:
        pass


@contextlib.contextmanager
def enn_lowerings(enabled: bool = True) -> Iterator[None]:
    """Install enn's lowerings for the duration of one compile."""
    if enabled:
        _load_all()
    with compat.inductor_lowerings_patched(LOWERINGS if enabled else {}):
        yield


def lowering_sources() -> list[str]:
    """Files whose content decides enn's lowerings (hashed into pass uuids)."""
    import glob
    import os

    return sorted(glob.glob(os.path.join(os.path.dirname(__file__), "*.py")))
