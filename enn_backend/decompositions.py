"""enn's decomposition table, layered on Inductor's.

:func:`decomposition_table` returns Inductor's table plus enn's entries. The result is
an :class:`EnnDecompTable`: on torch 2.13 the table given to ``compile_fx`` is pickled
into the FX graph cache key, and a table of arbitrary functions would make every
compile bypass the cache ("Cannot produce stable cache key"). This dict pickles as a
module-level loader plus a key string, so the cache keeps working.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

from . import compat

# op -> decomposition; filled by enn_backend.passes.precision_decomps at import (see its docstring
# for the table of entries, why each exists and what it costs).
ENN_DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {}


def _enn_entries(precision: bool) -> dict[Any, Callable[..., Any]]:
    if not precision:
        return {}
    from .passes import precision_decomps  # noqa: F401  (fills ENN_DECOMPOSITIONS)

    return dict(ENN_DECOMPOSITIONS)


class EnnDecompTable(dict):
    def __init__(self, table: dict, precision: bool) -> None:
        super().__init__(table)
        self.precision = precision

    def __reduce__(self) -> tuple:
        from .passes.manager import source_hash

        key = hashlib.sha256(f"{compat.TORCH_VERSION}|{self.precision}|{source_hash()}".encode()).hexdigest()
        return (load_decomposition_table, (self.precision, key))


def load_decomposition_table(precision: bool, key: str = "") -> EnnDecompTable:
    """Rebuild the table (the pickle loader; ``key`` only identifies its content)."""
    return decomposition_table(precision)


def decomposition_table(precision: bool = True) -> EnnDecompTable:
    return EnnDecompTable({**compat.select_decomp_table(), **_enn_entries(precision)}, precision)
