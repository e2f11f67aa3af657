"""enn's per-graph log line and structured (TORCH_TRACE) artifact.

enn logs through the ``enn_backend.*`` logger hierarchy (one logger per module).
Switch it on with torch's own variable, using the package name:

    TORCH_LOGS="enn_backend"    info: one line per compiled graph, plus fallbacks
    TORCH_LOGS="+enn_backend"   debug: also per-pass match counts and timings
                                (ENN_DEBUG_GRAPHS=1 adds the graph after each pass)

torch accepts any importable module name in TORCH_LOGS; a name that is not
importable (``enn``, or ``enn_backend`` without enn installed) makes ``import torch``
raise. Plain ``logging.getLogger("enn_backend").setLevel(logging.INFO)`` works too.

With ``TORCH_TRACE=<dir>`` every compiled graph's report record is also written
as a JSON artifact named ``enn_graph_report`` that tlparse shows.

After a guarded graph's first call, one more info line says where its compile time
went, by phase (enn_backend.compile_time), also written as the artifact
``enn_compile_time``; enn's own compile work is among torch's compile events
(``enn_backend.compile_unit``, ``enn_backend.compile_graph``, ``enn_backend.passes``),
which tlparse's perfetto trace shows.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from typing import Any

from .. import compat
from ..blame import describe_all, location

log = logging.getLogger(__name__)

ARTIFACT_NAME = "enn_graph_report"
COMPILE_TIME_ARTIFACT = "enn_compile_time"


def graph_line(rec: Any) -> str:
    """One line that says what enn did to a compiled graph (a report GraphRecord); its ops are
    counted as the report counts them, and its pinned ops named by their sites."""
    fus = ",".join(f"{k}={v}" for k, v in sorted(rec.fusions.items())) or "none"
    kernels = _kernels(rec.kernel_choices)
    falls = [e for e in rec.events if "kind" in e]
    fallbacks = ",".join(e["kind"] for e in falls) or "none"
    pinned = [rec.sites.get(n) or {"node": n} for n in rec.pinned]
    return (
        f"enn graph {rec.id}: path={rec.path}{' (from AOTAutograd cache)' if rec.from_cache else ''} ops={rec.compute_nodes} compiled={rec.compiled_nodes} "
        f"fusions={fus} kernels={kernels} fp32={len(rec.promotions)} fallbacks={fallbacks} pinned={len(pinned)} "
        f"compile={rec.compile_time_s:.2f}s" + (f"; pinned: {describe_all(pinned)}" if pinned else "")
    )


def _kernels(choices: list[dict[str, Any]], limit: int = 3) -> str:
    """Kernel choices by kernel, each with where it runs as the report names it (the module
    path, else the source line, else the graph node): ``flash:2 [h.0.attn, h.1.attn]``."""
    by: dict[str, list[str]] = {}
    for c in choices:
        site = c.get("site") or {}
        by.setdefault(c.get("choice", "?"), []).append(site.get("module") or location(site) or c.get("node", "?"))
    return ",".join(f"{k}:{len(v)} [{', '.join(v[:limit])}{f', and {len(v) - limit} more' if len(v) > limit else ''}]"
                    for k, v in by.items()) or "none"


def log_compiled_graph(rec: Any) -> None:
    """Log the graph's line at info level and emit its record as a TORCH_TRACE artifact."""
    if log.isEnabledFor(logging.INFO):
        log.info("%s", graph_line(rec))
    compat.trace_structured_artifact(ARTIFACT_NAME, lambda: json.dumps(asdict(rec), default=str))


def compile_time_line(rec: Any) -> str:
    """One line that says where a graph's compile time (its first call included) went."""
    phases = sorted(rec.compile_phases.items(), key=lambda kv: -kv[1])
    parts = ", ".join(f"{k} {v:.2f}" for k, v in phases if v >= 0.005) or "none"
    return f"enn compile time {rec.id}: {sum(rec.compile_phases.values()):.2f}s: {parts}"


def log_compile_time(rec: Any) -> None:
    """Log the graph's compile-time line at info level and emit it as a TORCH_TRACE artifact."""
    if log.isEnabledFor(logging.INFO):
        log.info("%s", compile_time_line(rec))
    compat.trace_structured_artifact(COMPILE_TIME_ARTIFACT, lambda: json.dumps(
        {"graph": rec.id, "unit": rec.unit, "phase": rec.phase, "seconds": rec.compile_phases,
         "build_choices": rec.build_choices}, default=str))
