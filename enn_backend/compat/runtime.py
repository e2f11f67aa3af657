"""What the guard probes at run time: torch.distributed, CUDA, Triton."""

from __future__ import annotations

import torch

# --- torch.distributed, probed on every guarded call (guard/runtime.py) ------------------
# ``dist.is_initialized()`` is ``_world.default_pg is not None`` read through two properties
# (torch 2.6-2.13); the guard asks on every call of every graph, where the properties' Python
# calls cost ~0.5 us on a small CPU graph. Read the attribute they return instead.
try:
    from torch.distributed.distributed_c10d import _world as _c10d_world

    if not hasattr(_c10d_world, "_default_pg"):  # pragma: no cover - a torch that renamed it
        _c10d_world = None
except ImportError:  # pragma: no cover - torch built without distributed
    _c10d_world = None


def dist_initialized() -> bool:
    """``torch.distributed.is_initialized()``, cheaply."""
    if _c10d_world is not None:
        return _c10d_world._default_pg is not None
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def is_cuda_available() -> bool:
    return torch.cuda.is_available()


def triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except Exception:  # noqa: BLE001 - optional dependency
        return None
