"""A repro's inputs: described as JSON-able metadata (:func:`input_meta`), saved and loaded
(``torch.load(weights_only=True)``), or regenerated from the metadata (:func:`regenerate`).

The repro writer (:mod:`.repro`) describes them; a repro script loads them (through
:mod:`.replay`, whose names the scripts import).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Sequence

import torch


def input_meta(x: Any) -> dict[str, Any]:
    """JSON-able description of one graph input, enough to regenerate it."""
    if isinstance(x, torch.Tensor):
        meta: dict[str, Any] = {
            "kind": "tensor",
            "shape": list(x.shape),
            "stride": list(x.stride()),
            "dtype": str(x.dtype).removeprefix("torch."),
            "device": str(x.device),
        }
        if x.numel() and not x.is_floating_point() and not x.is_complex():
            meta["min"] = int(x.min())
            meta["max"] = int(x.max())
        return meta
    if isinstance(x, bool) or x is None or isinstance(x, (int, float)):
        return {"kind": "scalar", "value": x}
    if isinstance(x, torch.SymInt):
        return {"kind": "scalar", "value": int(x)}
    raise TypeError(f"enn repro: cannot describe an input of type {type(x).__name__}")


def regenerate(meta: Sequence[dict[str, Any]], seed: int = 0) -> list[Any]:
    """Inputs rebuilt from metadata: seeded random values of the recorded shape, stride and dtype.

    Integer tensors are drawn from the recorded [min, max] so that indices stay in range.
    """
    gen = torch.Generator().manual_seed(seed)
    out: list[Any] = []
    for m in meta:
        if m["kind"] == "scalar":
            out.append(m["value"])
            continue
        dtype = getattr(torch, m["dtype"])
        shape, stride = m["shape"], m["stride"]
        extent = 1 + sum((s - 1) * st for s, st in zip(shape, stride) if s > 0) if all(shape) else 0
        if dtype.is_floating_point or dtype.is_complex:
            flat = torch.randn(extent, generator=gen, dtype=torch.float64).to(dtype)
        elif dtype == torch.bool:
            flat = torch.randint(0, 2, (extent,), generator=gen).bool()
        else:
            lo, hi = m.get("min", 0), m.get("max", 1)
            flat = torch.randint(lo, hi + 1, (extent,), generator=gen, dtype=torch.int64).to(dtype)
        out.append(flat.as_strided(shape, stride).to(m["device"]))
    return out


def load_inputs(path: str, meta: Sequence[dict[str, Any]]) -> list[Any]:
    """The saved real inputs (``torch.load(weights_only=True)``), else regenerated ones."""
    if "--regenerate" not in sys.argv and os.path.exists(path):
        data = torch.load(path, weights_only=True)
        return list(data["inputs"])
    print(f"enn repro: {os.path.basename(path)} not used; regenerating inputs from metadata (seed 0)")
    return regenerate(meta)


def load_constants(module: torch.nn.Module, path: str, meta: dict[str, dict[str, Any]]) -> torch.nn.Module:
    """Register the graph's tensor constants (``get_attr`` targets) as buffers of ``module``."""
    if not meta:
        return module
    saved = torch.load(path, weights_only=True)["constants"] if os.path.exists(path) else {}
    for name, m in meta.items():
        value = saved[name] if name in saved else regenerate([m])[0]
        owner = module
        *parents, leaf = name.split(".")
        for p in parents:
            owner = getattr(owner, p)
        owner.register_buffer(leaf, value)
    return module


def clone_input(x: Any) -> Any:
    """A copy with the same size, stride and values (compiled code checks strides)."""
    if not isinstance(x, torch.Tensor):
        return x
    out = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)
    with torch.no_grad():
        out.copy_(x)
    return out
