"""The JSON sidecar enn keeps per graph in AOT Autograd's cache, and how it travels.

:mod:`.aot_cache` writes one per clean compiled graph, keyed by the graph's FX graph cache
key, beside Inductor's cache (``<inductor cache>/enn/aot/<key>.json``), and reads it on an
AOTAutograd cache hit. Every sidecar written or used is also recorded as a cache artifact
(type ``enn_aot_graph``), so ``torch.compiler.save_cache_artifacts()`` carries it with the
AOT Autograd and Inductor entries it belongs to; ``load_cache_artifacts()`` checks it as a
hit checks a sidecar and writes it into this process's Inductor cache folder (atomically).
A process must have imported enn's backend (``torch.compile(..., backend="enn")`` does)
before it loads. An invalid artifact is logged and skipped: its graph is compiled again.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

from . import compat
from .blame import SITE_FIELDS
from .report import Count, FallbackKind, atomic_write_text, report

log = logging.getLogger(__name__)

ARTIFACT = "enn_aot_graph"  # the type of enn's sidecars in torch.compiler's cache artifacts
_FX_KEY = re.compile(r"[A-Za-z0-9_-]{1,128}")  # an FX graph cache key; a sidecar's file name

FORMAT = "enn-aot-graph"
VERSION = 2
PHASES = ("forward", "backward", "inference")
# compile-time fallbacks that describe a clean compile (what a pass declined), replayed on a hit
REPLAYED = frozenset({FallbackKind.PASS_SKIPPED.value, FallbackKind.KERNEL_CHOICE.value,
                      FallbackKind.PRECISION_SKIPPED.value})
RECORD_FIELDS = ("nodes", "compute_nodes", "compiled_nodes", "fusions", "kernel_choices", "promotions", "counters")
FALLBACK_FIELDS = ("kind", "node", "phase", "reason", "action", "sites")


def sidecar_path(fx_key: str) -> str:
    return os.path.join(compat.inductor_cache_dir(), "enn", "aot", f"{fx_key}.json")


def write_sidecar(fx_key: str, data: dict[str, Any]) -> None:
    """Write a graph's sidecar (atomically; OSError when it cannot be written)."""
    atomic_write_text(sidecar_path(fx_key), json.dumps(data, indent=1))
    _travel(fx_key, data)


def _travel(fx_key: str, data: dict[str, Any]) -> None:
    compat.record_cache_artifact(ARTIFACT, fx_key, json.dumps(data, indent=1).encode())


def read_sidecar(fx_key: str) -> dict[str, Any] | None:
    """The sidecar of a cached graph, or None (missing; corrupt or foreign: logged)."""
    path = sidecar_path(fx_key)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        _validate(data, fx_key)
    except Exception as exc:  # noqa: BLE001 - any corruption is survivable: the graph is compiled again
        log.warning("enn: ignoring %s (%s: %s); the graph is compiled instead of loaded from the cache",
                    path, type(exc).__name__, exc)
        report().count(Count.AOT_CACHE_CORRUPT_SIDECAR)
        return None
    _travel(fx_key, data)
    return data


def _validate(d: Any, fx_key: str) -> None:
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ValueError(what)

    need(isinstance(d, dict) and d.get("format") == FORMAT and d.get("version") == VERSION,
         "not an enn AOT sidecar of this version")
    need(d.get("key") == fx_key and d.get("phase") in PHASES, "key or phase does not match")
    need(isinstance(d.get("graph_key"), str) and all(isinstance(k, str) for k in d.get("node_keys", [None])), "bad keys")
    need(all(isinstance(i, int) for i in d.get("mutated", [None])) and isinstance(d.get("random"), bool), "bad fast-path data")
    need(all(isinstance(i, int) for i in d.get("kernel_state", [])), "bad kernel-state outputs")
    rec = d.get("record")
    need(isinstance(rec, dict) and set(rec) == set(RECORD_FIELDS), "bad record")
    fallbacks = list(d.get("fallbacks") or [])
    unit = d.get("unit")
    if d["phase"] != "backward":
        need(isinstance(unit, dict) and isinstance(unit.get("assumed"), dict), "bad unit data")
        need(all(k.isdigit() and isinstance(v, str) for k, v in unit["assumed"].items()), "bad buffer digests")
        fallbacks += unit.get("fallbacks") or []
    need(all(isinstance(f, dict) and set(f) == set(FALLBACK_FIELDS) and f["kind"] in REPLAYED for f in fallbacks),
         "bad fallbacks")
    need(all(isinstance(f["sites"], list) and all(_valid_site(s) for s in f["sites"]) for f in fallbacks), "bad sites")


def _valid_site(s: Any) -> bool:
    return isinstance(s, dict) and "node" in s and all(k in SITE_FIELDS and type(v) is SITE_FIELDS[k] for k, v in s.items())


def _load_artifact(key: str, content: bytes) -> None:
    """torch.compiler.load_cache_artifacts(): check one travelling sidecar and write it."""
    if not _FX_KEY.fullmatch(key):
        raise ValueError("not an FX graph cache key")
    data = json.loads(content.decode())
    _validate(data, key)
    atomic_write_text(sidecar_path(key), json.dumps(data, indent=1))


compat.register_cache_artifact(ARTIFACT, _load_artifact, lambda: report().count(Count.CACHE_ARTIFACTS_IGNORED))
