"""enn: a torch.compile backend over Inductor that never silently changes your results.

    torch.compile(model, backend="enn")            # no import needed after pip install

Inductor/Triton speed, plus: a guard around every compiled graph (forward and
backward) that catches kernel exceptions and NaN/Inf, re-runs the graph eagerly,
blames the culprit node and keeps the rest compiled; fused hand-written attention;
GEMM + bias + activation epilogues; fp32 accumulation for risky low-precision math;
and a report of every decision (:func:`report`).

Importing this package changes nothing in torch: no global config, no global lowerings.
"""

from __future__ import annotations

from .options import Options, OptionsError
from .report import FallbackKind, Report, report, reset

__version__ = "0.1.0"

__all__ = ["Options", "OptionsError", "FallbackKind", "Report", "report", "reset", "__version__"]
