"""Kernel state: what failed, keyed by what decides a kernel's behaviour.

A key is (op, backend, device capability, dtype, shape bucket) — not a module's
identity — so a second model, or a second process, with the same kernel on the same
hardware starts with the same knowledge. Entries record fail counts, first/last
time, the last exception and the action taken (``pinned`` or ``fp32``).

Persisted as JSON under the cache directory, written atomically. A corrupt, truncated
or foreign file is ignored with one warning: it never crashes enn and nothing in it
is executed (no pickle).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.fx as fx

from ..report import atomic_write_text
from .graph_edit import _tensors_in, _val, node_op_name

log = logging.getLogger(__name__)

FORMAT = "enn-kernel-state"
VERSION = 1


@dataclass
class KernelEntry:
    key: str
    action: str  # pinned | fp32
    fail_count: int = 0
    first_time: float = 0.0
    last_time: float = 0.0
    last_exc_type: str = ""
    last_exc_msg: str = ""


def device_capability(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm{major}{minor}"
    return device.type


def _bucket(dim: Any) -> str:
    if not isinstance(dim, int):
        return "s"  # symbolic
    b = 1
    while b < dim:
        b *= 2
    return str(b)


def node_key(n: fx.Node) -> str | None:
    ts = _tensors_in(_val(n))
    if not ts:
        return None
    t = ts[0]
    backend = "inductor-triton" if t.device.type == "cuda" else f"inductor-{t.device.type}"
    shape = "x".join(_bucket(d) for d in t.shape) or "scalar"
    return "|".join((node_op_name(n), backend, device_capability(t.device), str(t.dtype).removeprefix("torch."), shape))


def graph_key(gm: fx.GraphModule) -> str:
    """A key for a whole graph (used for fp32 pins): a hash of its code."""
    return "graph|" + hashlib.sha256(gm.code.encode()).hexdigest()[:20]


class KernelState:
    """Fail records, loaded from and saved to one JSON file."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.entries: dict[str, KernelEntry] = {}
        self._lock = threading.Lock()
        if path:
            self._load()

    def _load(self) -> None:
        assert self.path
        if not os.path.exists(self.path):
            return
        try:
            with open(self.path) as f:
                data = json.load(f)
            if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
                raise ValueError("not an enn kernel-state file of this version")
            for e in data["entries"]:
                entry = KernelEntry(**{k: e[k] for k in KernelEntry.__dataclass_fields__})
                if entry.action not in ("pinned", "fp32") or not isinstance(entry.key, str):
                    raise ValueError(f"bad entry {e!r}")
                self.entries[entry.key] = entry
        except Exception as exc:  # noqa: BLE001 - any corruption is survivable
            self.entries.clear()
            log.warning("enn: ignoring kernel state file %s (%s: %s); starting with no recorded faults", self.path, type(exc).__name__, exc)

    def lookup(self, key: str | None) -> KernelEntry | None:
        return self.entries.get(key) if key else None

    def record(self, key: str, action: str, exc: BaseException | None = None, reason: str = "") -> KernelEntry:
        now = time.time()
        with self._lock:
            e = self.entries.get(key) or KernelEntry(key=key, action=action, first_time=now)
            e.fail_count += 1
            e.last_time = now
            e.action = action
            e.last_exc_type = type(exc).__name__ if exc is not None else "NonFinite"
            e.last_exc_msg = (str(exc) if exc is not None else reason)[:500]
            self.entries[key] = e
            self._save()
        return e

    def _save(self) -> None:
        if not self.path:
            return
        data = {"format": FORMAT, "version": VERSION, "entries": [asdict(e) for e in self.entries.values()]}
        try:
            atomic_write_text(self.path, json.dumps(data, indent=1))
        except OSError as exc:
            log.warning("enn: could not persist kernel state to %s: %s", self.path, exc)


_STATES: dict[str | None, KernelState] = {}
_STATES_LOCK = threading.Lock()


def state_path(opts: Any) -> str | None:
    """The state file for these options (None when persistence is off).

    Runs with injected faults keep their state in a separate file, so a test never
    teaches a real run that a kernel is broken.
    """
    if not opts.persist:
        return None
    name = "kernel_state.json"
    if opts.fault_inject:
        name = "kernel_state-inject-" + hashlib.sha256(opts.fault_inject.encode()).hexdigest()[:12] + ".json"
    return os.path.join(opts.resolved_cache_dir(), name)


def state_for(opts: Any) -> KernelState:
    """The process-wide kernel state for these options' cache directory."""
    path = state_path(opts)
    with _STATES_LOCK:
        if path not in _STATES:
            _STATES[path] = KernelState(path)
        return _STATES[path]


def forget_loaded_states() -> None:
    """Drop in-memory states (tests; the files stay)."""
    with _STATES_LOCK:
        _STATES.clear()
