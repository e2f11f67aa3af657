"""enn's decomposition table, layered on Inductor's.

:func:`decomposition_table` returns Inductor's table plus enn's entries
(:data:`ENN_DECOMPOSITIONS`, the entries of :mod:`.precision`; one module per concern, each
adding a dict of entries here). The result is an :class:`EnnDecompTable`: on torch 2.13 the
table given to ``compile_fx`` is pickled into the FX graph cache key, and a table of arbitrary
functions would make every compile bypass the cache ("Cannot produce stable cache key"). This
dict pickles as a module-level loader plus a key string, so the cache keeps working.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

from .. import compat
from ..passes.sources import sources_hash
from .precision import ENTRIES as PRECISION

# op -> decomposition: enn's entries (see each module's docstring for why each exists and what it costs)
ENN_DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {**PRECISION}


def source_hash() -> str:
    """A hash of the sources of enn's decomposition table (part of its cache key)."""
    return sources_hash(__name__)


class EnnDecompTable(dict):
    def __init__(self, table: dict, precision: bool) -> None:
        super().__init__(table)
        self.precision = precision

    def __reduce__(self) -> tuple:
        key = hashlib.sha256(f"{compat.TORCH_VERSION}|{self.precision}|{source_hash()}".encode()).hexdigest()
        return (load_decomposition_table, (self.precision, key))


def load_decomposition_table(precision: bool, key: str = "") -> EnnDecompTable:
    """Rebuild the table (the pickle loader; ``key`` only identifies its content)."""
    return decomposition_table(precision)


def decomposition_table(precision: bool = True) -> EnnDecompTable:
    """Inductor's table, plus enn's entries when ``precision`` (the option) is on."""
    return EnnDecompTable({**compat.select_decomp_table(), **(ENN_DECOMPOSITIONS if precision else {})}, precision)
