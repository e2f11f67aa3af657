"""What a kernel choice is keyed by: :class:`ChoiceKey`.

A measured choice holds for one op on one problem on one machine with one software stack, so its
key names all of them: the op, the problem's dimensions and layout, the epilogue, the dtype, the
device (name, SM, memory), the workspace limit, and the torch / Triton / cuBLAS / cuDNN versions.
Any part that differs makes another key (``tests/test_registry.py`` changes each in turn).

A key is plain data: it is written as JSON, and its :meth:`ChoiceKey.digest` (a hash of that JSON)
names it in the cache file and in torch.compiler's cache artifacts.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import platform
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

KEY_VERSION = 1  # bump when the meaning of a field changes: older entries then never match


@dataclass(frozen=True)
class DeviceInfo:
    """The device a choice was measured on."""

    name: str  # "NVIDIA H100 80GB HBM3", or the CPU's model name
    sm: str  # "9.0" on CUDA; the CPU's vector ISA ("AVX512", ...) elsewhere
    memory_mb: int  # the device's memory (CUDA); 0 on CPU


@dataclass(frozen=True)
class ChoiceKey:
    """Everything a measured kernel choice depends on."""

    op: str  # the registry's op: "gemm_epilogue" | "attention"
    dims: tuple[int, ...]  # the problem's sizes, in the op's order (GEMM: M, N, K)
    layout: str  # how the operands lie in memory (contiguity / transposes), as the op spells it
    epilogue: str  # what is fused after the kernel ("gelu_tanh+bias", "residual", "causal", ...)
    dtype: str
    device: DeviceInfo
    workspace: str  # the workspace limit the vendor library runs under (CUBLAS_WORKSPACE_CONFIG)
    versions: tuple[tuple[str, str], ...]  # (library, version): torch, triton, cublas, cudnn
    key_version: int = KEY_VERSION

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["dims"] = list(self.dims)
        data["versions"] = [list(v) for v in self.versions]
        return data

    def digest(self) -> str:
        """A hash of the key's JSON: the key's name in the cache file and in cache artifacts."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    @classmethod
    def from_json(cls, data: Any) -> "ChoiceKey":
        """The key ``data`` describes; ValueError naming the first field that is missing or of the wrong type."""
        if not isinstance(data, dict):
            raise ValueError("key: not an object")
        names = {f.name for f in fields(cls)}
        if set(data) != names:
            raise ValueError(f"key: fields {sorted(data)} are not {sorted(names)}")
        dev = data["device"]
        if not (isinstance(dev, dict) and set(dev) == {"name", "sm", "memory_mb"} and isinstance(dev["name"], str)
                and isinstance(dev["sm"], str) and type(dev["memory_mb"]) is int):
            raise ValueError("key: bad device")
        if not (isinstance(data["dims"], list) and all(type(d) is int and d >= 0 for d in data["dims"])):
            raise ValueError("key: dims must be non-negative integers")
        for name in ("op", "layout", "epilogue", "dtype", "workspace"):
            if not isinstance(data[name], str):
                raise ValueError(f"key: {name} must be a string")
        vs = data["versions"]
        if not (isinstance(vs, list) and all(isinstance(v, list) and len(v) == 2 and all(isinstance(s, str) for s in v)
                                             for v in vs)):
            raise ValueError("key: versions must be [library, version] pairs")
        if type(data["key_version"]) is not int:
            raise ValueError("key: key_version must be an integer")
        return cls(op=data["op"], dims=tuple(data["dims"]), layout=data["layout"], epilogue=data["epilogue"],
                   dtype=data["dtype"], device=DeviceInfo(**dev), workspace=data["workspace"],
                   versions=tuple((a, b) for a, b in vs), key_version=data["key_version"])


@functools.lru_cache(maxsize=8)
def device_info(device_type: str, index: int = 0) -> DeviceInfo:
    """Name, SM and memory of ``device_type`` (read once per process)."""
    if device_type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(index)
        return DeviceInfo(props.name, f"{props.major}.{props.minor}", int(props.total_memory // 2**20))
    if device_type == "cpu":
        return DeviceInfo(_cpu_name(), str(torch.backends.cpu.get_cpu_capability()), 0)
    return DeviceInfo(device_type, "", 0)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _dist_version(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


@functools.lru_cache(maxsize=1)
def library_versions() -> tuple[tuple[str, str], ...]:
    """The versions a kernel's speed depends on. cuBLAS: its wheel's version where pip installed
    one, else the CUDA toolkit torch was built with (which ships it); cuDNN: what torch loaded."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    cublas = _dist_version("nvidia-cublas-cu13", "nvidia-cublas-cu12", "nvidia-cublas")
    if not cublas and torch.version.cuda:
        cublas = f"cuda-{torch.version.cuda}"
    return (("torch", torch.__version__), ("triton", _dist_version("triton", "pytorch-triton")),
            ("cublas", cublas), ("cudnn", str(cudnn or "")))


def workspace_limit(device_type: str) -> str:
    """The cuBLAS workspace setting (``CUBLAS_WORKSPACE_CONFIG``); empty off CUDA or when unset."""
    return os.environ.get("CUBLAS_WORKSPACE_CONFIG", "") if device_type == "cuda" else ""


def choice_key(op: str, dims: tuple[int, ...], layout: str, epilogue: str, dtype: str, device_type: str) -> ChoiceKey:
    """The key of a choice made on this machine, with this process's libraries."""
    return ChoiceKey(op=op, dims=tuple(dims), layout=layout, epilogue=epilogue, dtype=dtype,
                     device=device_info(device_type), workspace=workspace_limit(device_type),
                     versions=library_versions())
