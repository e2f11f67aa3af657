"""The measurement tools beside the suite: scripts in the checkout's ``bench/`` folder, each asking
one kind of question the suite's tables do not (a variant of enn, a compile phase, the guard's
cost, a kernel at given shapes).

    python -m enn_backend bench --tool NAME [ARGS...]    # the same as: python bench/NAME.py [ARGS...]
    python -m enn_backend bench --tool NAME --help       # the tool's own options

The front door runs the script in a new Python process with ARGS as they are: each tool keeps
its own options, and its results and printed commands are what ``python bench/NAME.py`` gives.
The tools time with :mod:`.timing` and :mod:`.steps` and compile with :mod:`.backends` where they
time a model step. Every script in ``bench/`` is either listed here or named in
``bench/README.md`` with the reason it stays (``tests/test_bench_front_door.py`` checks it).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

# name (bench/<name>.py) -> (where it runs, what it measures). Kept in the order of bench/README.md.
TOOLS: dict[str, tuple[str, str]] = {
    "gpu_real_gaps": ("GPU", "real-suite workloads under variants of enn and Inductor"),
    "gpu_warm_start": ("GPU", "cold and warm start per variant, a new process each"),
    "gpu_first_compile": ("GPU", "a process's first compile: C++ compiler, precompiled header"),
    "gpu_compile_profile": ("GPU", "one workload's cold compile per compiler phase"),
    "compile_breakdown": ("CPU/GPU", "cold first call per workload, enn vs Inductor, by phase"),
    "guard_overhead": ("CPU/GPU", "the guard's cost per mode against guard off and Inductor"),
    "host_tax": ("CPU/GPU", "the guard's host cost per call on a call-bound graph"),
    "host_profile": ("CPU/GPU", "where a step's host time goes, enn against Inductor"),
    "gpu_decode_cudagraphs": ("GPU", "a decode-sized HF LLaMA step under CUDA graphs"),
    "gpu_host_bound": ("GPU", "CUDA graphs: state after N steps, dynamic padding, HF generate"),
    "gpu_llama_long": ("GPU", "HF LLaMA at long context, training or prefill"),
    "gpu_attention": ("GPU", "causal and ALiBi attention against the best direct call"),
    "gpu_attention_size": ("GPU", "when fusing a small padded attention pays, by size"),
    "gpu_epilogue": ("GPU", "linear + bias + activation: enn's epilogue against Inductor"),
    "gemm_registry": ("GPU/CPU", "GEMM epilogues: the measured kernel choice against the rules' and Inductor"),
    "gpu_precision": ("GPU", "the precision guards: step-time cost and stress cases"),
    "gpu_fp8_llama": ("GPU", "an HF LLaMA training step with fp8 off / rowwise / tensorwise"),
    "gpu_fp8_training": ("GPU/CPU", "FP8 loss curves against bf16's spread, one-layer faults, the guard's cost with FP8"),
    "gpu_blocks_depth": ("GPU", "first step and step time against depth (2, 8, 32 layers): Inductor, enn, enn with blocks"),
    "inductor_rewrites_cost": ("CPU/GPU", "what keeping Inductor's attention rewrites off costs"),
    "distributed": ("CPU/GPUs", "DDP and FSDP2 with faults on one rank (own launcher)"),
}


def bench_folder() -> Path | None:
    """The ``bench/`` folder of the checkout this package was imported from (an editable
    install), else the working directory's; None when neither holds the tools."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        folder = root / "bench"
        if all((folder / f"{name}.py").is_file() for name in TOOLS):
            return folder
    return None


def help_text() -> str:
    """The tools section of ``python -m enn_backend bench --help`` and ``--list``."""
    lines = ["tools: --tool NAME [ARGS...] runs bench/NAME.py with ARGS (--tool NAME --help: its options;",
             "bench/README.md: what each measures and how to run it)"]
    lines += [f"  {name:<23} {where:<9}{what}" for name, (where, what) in TOOLS.items()]
    return "\n".join(lines)


def command(name: str, args: list[str]) -> list[str]:
    """The command line ``--tool NAME ARGS`` runs (ValueError: unknown tool or no checkout)."""
    if name not in TOOLS:
        raise ValueError(f"unknown tool {name!r}\n\n{help_text()}")
    folder = bench_folder()
    if folder is None:
        raise ValueError("the tools are scripts in a checkout's bench/ folder: run this from a checkout "
                         "of enn (installed with pip install -e .)")
    return [sys.executable, str(folder / f"{name}.py"), *args]


def run(name: str, args: list[str]) -> int:
    """Run one tool in a new process; its exit status (2: unknown tool or no checkout)."""
    if args[:1] == ["--"]:
        args = args[1:]
    try:
        cmd = command(name, args)
    except ValueError as exc:
        print(f"enn bench --tool: {exc}", file=sys.stderr)
        return 2
    shown = os.path.relpath(cmd[1])
    shown = cmd[1] if shown.startswith("..") else shown
    print(f"enn bench: {shlex.join(['python', shown, *args])}", file=sys.stderr, flush=True)
    return subprocess.call(cmd)
