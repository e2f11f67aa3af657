"""What kernel state records faults under, and what one record holds.

A key is (op, backend, device capability, dtype, shape bucket) -- not a module's
identity -- so a second model, or a second process, with the same kernel on the same
hardware starts with the same knowledge (:func:`node_key`); a whole graph's key, for fp32
pins, is a hash of its code (:func:`graph_key`). A :class:`KernelEntry` is one record, checked
field by field when read (:func:`validated_entry`), and travels between machines as one
cache artifact (:func:`entry_artifact`); the file that holds them, its rules and its locking
are :mod:`.kernel_state`'s.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.fx as fx

from .. import __version__, blame
from ..fx_utils import tensors_in, val
from .graph_edit import node_op_name

ACTIONS = ("pinned", "fp32")
ARTIFACT = "enn_kernel_state"  # the type of enn's kernel-state artifacts in torch.compiler's cache artifacts
_ARTIFACT_FORMAT = "enn-kernel-entry"
# the files an entry may travel to: kernel_state.json, or an injected fault's own file (kernel_state.py)
_STATE_FILE = re.compile(r"kernel_state(-inject-[0-9a-f]{12})?\.json")
MAX_AGE_DAYS = 30
MAX_TEXT = 500  # characters in a string field
_FUTURE_SLACK_S = 86400.0  # clocks of machines sharing a folder may disagree by this much


@dataclass
class KernelEntry:
    key: str
    action: str  # pinned | fp32
    fail_count: int
    first_time: float
    last_time: float
    reason: str
    last_exc_type: str
    last_exc_msg: str
    torch_version: str
    enn_version: str
    machine: str

    @property
    def ident(self) -> tuple[str, str, str]:
        return (self.key, self.torch_version, self.enn_version)

    def status(self, now: float) -> str:
        """``in force``, ``expired`` or ``other version`` (written by another torch or enn)."""
        if (self.torch_version, self.enn_version) != current_versions():
            return "other version"
        return "expired" if now - self.last_time > MAX_AGE_DAYS * 86400 else "in force"


_STR_FIELDS = ("key", "reason", "last_exc_type", "last_exc_msg", "torch_version", "enn_version", "machine")
_FIELD_NAMES = tuple(f.name for f in fields(KernelEntry))


def current_versions() -> tuple[str, str]:
    """(torch, enn) versions of this process: an entry applies only under those that wrote it."""
    return torch.__version__, __version__


def validated_entry(raw: Any, now: float) -> KernelEntry:
    """The entry ``raw`` (one item of the file's ``entries``) describes; ValueError naming
    the first field that is missing, unknown, of the wrong type or out of range."""
    if not isinstance(raw, dict):
        raise ValueError(f"not an object: {raw!r:.80}")
    missing = [n for n in _FIELD_NAMES if n not in raw]
    unknown = sorted(set(raw) - set(_FIELD_NAMES))
    if missing or unknown:
        raise ValueError(f"missing fields {missing}, unknown fields {unknown}")
    for name in _STR_FIELDS:
        v = raw[name]
        if not isinstance(v, str) or len(v) > MAX_TEXT:
            raise ValueError(f"{name} must be a string of at most {MAX_TEXT} characters, got {v!r:.80}")
    for name in ("key", "torch_version", "enn_version"):
        if not raw[name]:
            raise ValueError(f"{name} is empty")
    if raw["action"] not in ACTIONS:
        raise ValueError(f"action must be one of {', '.join(ACTIONS)}, got {raw['action']!r:.80}")
    if type(raw["fail_count"]) is not int or raw["fail_count"] < 1:
        raise ValueError(f"fail_count must be a positive integer, got {raw['fail_count']!r:.80}")
    for name in ("first_time", "last_time"):
        v = raw[name]
        if type(v) not in (int, float) or not math.isfinite(v) or not 0 <= v <= now + _FUTURE_SLACK_S:
            raise ValueError(f"{name} must be seconds since the epoch, not in the future, got {v!r:.80}")
    if raw["first_time"] > raw["last_time"]:
        raise ValueError(f"first_time {raw['first_time']} is after last_time {raw['last_time']}")
    return KernelEntry(**{n: raw[n] for n in _FIELD_NAMES})


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


# Ops whose pin is a decision about one layer's numerics, not about a kernel at a shape: an FP8
# GEMM is demoted because of the values its layer quantizes. Their state is keyed by the layer
# (the module path of the forward GEMM, which a backward GEMM carries too): a pin demotes that
# layer's GEMMs, forward and backward, and not every GEMM of its shape (in a transformer, every
# layer's same projection).
LAYER_KEYED_OPS = frozenset({"enn.fp8_mm"})


def node_key(n: fx.Node) -> str | None:
    """The kernel-state key of a node: op, backend, device, dtype, and the shape (bucketed to
    powers of two) -- or, for :data:`LAYER_KEYED_OPS`, the layer."""
    ts = tensors_in(val(n))
    if not ts:
        return None
    t = ts[0]
    op = node_op_name(n)
    backend = "inductor-triton" if t.device.type == "cuda" else f"inductor-{t.device.type}"
    where = (f"layer={blame.site(n).get('module') or '<root>'}" if op in LAYER_KEYED_OPS
             else "x".join(_bucket(d) for d in t.shape) or "scalar")
    return "|".join((op, backend, device_capability(t.device), str(t.dtype).removeprefix("torch."), where))


# a device's index in a graph's code: `device(type='cuda', index=1)`, `'cuda:1'`
_DEVICE_INDEX = re.compile(r"(device\(type='\w+'), index=\d+\)|('\w+):\d+'")


def graph_key(gm: fx.GraphModule) -> str:
    """A key for a whole graph: a hash of its code, device indices left out. It names the
    graph in fp32 pins and in the ranks' exchanges (guard.ranks), where rank 1 runs on
    ``cuda:1`` the graph that rank 0 runs on ``cuda:0``: the same code, the same key."""
    code = _DEVICE_INDEX.sub(lambda m: f"{m[1]})" if m[1] else f"{m[2]}'", gm.code)
    return "graph|" + hashlib.sha256(code.encode()).hexdigest()[:20]


def entry_artifact(file_name: str, e: KernelEntry) -> tuple[str, bytes]:
    """(key, content) of the cache artifact that carries ``e``, an entry of state file ``file_name``."""
    data = {"format": _ARTIFACT_FORMAT, "version": 1, "file": file_name, "entry": asdict(e)}
    return f"{file_name}:{e.key}", json.dumps(data).encode()


def parsed_artifact(key: str, content: bytes, now: float) -> tuple[str, KernelEntry]:
    """(state file name, entry) of a cache artifact made by :func:`entry_artifact`; ValueError
    when it is not one (the file name is one of the state files' names, never a path)."""
    data = json.loads(content.decode())
    if not isinstance(data, dict) or data.get("format") != _ARTIFACT_FORMAT or data.get("version") != 1:
        raise ValueError("not an enn kernel-state artifact of this version")
    name = data.get("file")
    if not isinstance(name, str) or not _STATE_FILE.fullmatch(name):
        raise ValueError(f"bad state file name {name!r:.80}")
    e = validated_entry(data.get("entry"), now)
    if key != f"{name}:{e.key}":
        raise ValueError("the artifact's key does not match its entry")
    return name, e
