"""The kernel registry: one way every kernel choice enn makes is made.

========================  ======================================================================
``select.py``             :class:`Policy` (checkers, rules, fallback, runner, key) and :func:`select`
``key.py``                :class:`ChoiceKey`: op, dims, layout, epilogue, dtype, device, workspace, versions
``measure.py``            timing eligible candidates within a budget; the noise margin
``cache.py``              :class:`ChoiceCache`: measured choices as JSON in enn's cache folder
========================  ======================================================================

The policies live beside their kernels: GEMM epilogues in ``custom_ops/gemm_policy.py``,
attention in ``passes/attention/policy.py``. ``python -m enn_backend registry list|clear`` shows
and removes cached choices.
"""

from __future__ import annotations

from .cache import ChoiceCache, ChoiceEntry, cache_for
from .key import ChoiceKey, DeviceInfo, choice_key
from .select import Measurement, Policy, Selection, Verdict, select, verdicts

__all__ = ["ChoiceCache", "ChoiceEntry", "ChoiceKey", "DeviceInfo", "Measurement", "Policy", "Selection", "Verdict",
           "cache_for", "choice_key", "select", "verdicts"]
