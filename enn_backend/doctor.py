"""``python -m enn_backend doctor``: what enn sees on this machine.

Prints torch / Triton versions, devices and their capabilities, which attention
kernels are usable here, the options in effect (ENN_* variables included), the cache
directories, and whether Dynamo resolves ``backend="enn"`` through the entry point.
Exits non-zero if something enn needs is broken.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
import time

import torch

from . import __version__, compat
from .guard import kernel_state as K
from .options import Options, OptionsError


def _attention_backends(device: torch.device) -> list[tuple[str, bool, str]]:
    rows = [("math (SDPA)", True, "always available")]
    if device.type == "cuda":
        cuda = torch.backends.cuda
        rows.append(("flash (SDPA)", bool(getattr(cuda, "is_flash_attention_available", lambda: False)()), "sm80+, fp16/bf16"))
        rows.append(("efficient (SDPA)", True, "memory-efficient kernel"))
        rows.append(("cudnn (SDPA)", torch.backends.cudnn.is_available(), f"cuDNN {torch.backends.cudnn.version()}"))
    else:
        rows.append(("flash (SDPA, CPU)", True, "CPU flash-attention kernel"))
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401

        rows.append(("FlexAttention", True, "compiled through Inductor" + ("" if device.type == "cuda" else " (CPU: inference only)")))
    except ImportError as exc:
        rows.append(("FlexAttention", False, str(exc)))
    return rows


def _writable(folder: str) -> bool:
    """Whether enn can write into ``folder``: the folder, or the nearest existing folder above it
    (enn creates the missing ones, as a new user's ``~/.cache/enn``), is writable."""
    path = os.path.abspath(folder)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return os.path.isdir(path) and os.access(path, os.W_OK)


def _kernel_state(opts: Options) -> str:
    """How many pins from earlier faults the next compile starts with, and how to clear them."""
    path = K.state_path(opts)
    if path is None:
        return "kernel state: kept in memory, per process (persist is off, or fault_inject without cache_dir)"
    broken = K.unreadable(path)
    if broken:
        return (f"kernel state: UNREADABLE {path} ({broken}): enn reads no pins from it; "
                f"start it afresh: {K.state_command(K.KernelState(path), 'clear')}")
    state, now = K.KernelState(path), time.time()
    entries = state.entries()
    in_force = [e for e in entries if e.status(now) == "in force"]
    pinned = sum(e.action == "pinned" for e in in_force)
    line = (f"kernel state: {len(in_force)} pin(s) in force ({pinned} kernel(s) run eagerly, "
            f"{len(in_force) - pinned} graph(s) in fp32) in {path}")
    if len(entries) > len(in_force):
        line += f"; {len(entries) - len(in_force)} more expired or of another torch/enn version (not applied)"
    if entries:
        line += f"\n    list them: {K.state_command(state, 'list')}\n    clear them: {K.state_command(state, 'clear')}"
    return line


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m enn_backend doctor", description="What enn sees on this machine: torch and Triton versions, devices, usable attention kernels, the options in effect, cache folders, kernel state, and whether backend='enn' resolves.",
                            epilog="Exit status: 0 ok, 1 a problem found (see the output), 2 bad arguments.").parse_args(argv)
    ok = True
    print(f"enn {__version__}  (python {platform.python_version()}, {platform.machine()})")
    print(f"torch {torch.__version__}  triton {compat.triton_version() or 'not installed'}")
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    for d in devices:
        if d.type == "cuda":
            p = torch.cuda.get_device_properties(d)
            print(f"device {d}: {p.name}, sm{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
        else:
            print(f"device cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads")
        for name, usable, note in _attention_backends(d):
            print(f"    attention {name:<18} {'yes' if usable else 'no ':<4} {note}")
    try:
        opts = Options.from_sources()
        changed = {k: v for k, v in opts.to_dict().items() if v != getattr(Options(), k)}
        print(f"options in effect: {changed or 'defaults'}")
        cache = opts.resolved_cache_dir()
        print(f"enn cache dir: {cache} ({'writable' if _writable(cache) else 'NOT writable: kernel state will not persist'})")
        state_line = _kernel_state(opts)
        print(state_line)
        ok &= "UNREADABLE" not in state_line
        repros = os.path.abspath(opts.resolved_repro_dir())
        print(f"enn repro dir: {repros} ({'writable' if _writable(repros) else 'NOT writable: no repro scripts'})")
    except OptionsError as exc:
        ok = False
        print(f"options: ERROR {exc}")
    print(f"inductor cache dir: {compat.inductor_cache_dir()}")
    print("warm starts from AOTAutograd's cache: "
          + ("yes (graphs loaded from it are guarded and reported)" if compat.aot_cache_usable()
             else "no (the cache is off, bundled, or this torch lacks the hook): warm starts trace again"))
    eps = importlib.metadata.entry_points(group="torch_dynamo_backends")
    ep = next((e for e in eps if e.name == "enn"), None)
    print(f"entry point torch_dynamo_backends:enn -> {ep.value if ep else 'MISSING (is enn installed with pip?)'}")
    ok &= ep is not None
    listed = "enn" in torch._dynamo.list_backends()
    print(f"torch._dynamo.list_backends() lists enn: {'yes' if listed else 'NO'}")
    ok &= listed
    try:
        fn = torch._dynamo.lookup_backend("enn")
        print(f"backend='enn' resolves to {fn.__module__}.{fn.__qualname__}")
    except Exception as exc:  # noqa: BLE001
        ok = False
        print(f"backend='enn' does NOT resolve: {type(exc).__name__}: {exc}")
    print("status:", "ok" if ok else "PROBLEMS FOUND (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
