"""``python -m enn_backend <command>``: enn's command line.

Each command lives in its own module and exposes ``main(argv) -> int``:

  doctor    versions, devices, attention backends, cache dir, entry point   (enn_backend.doctor)
  demo      compile a small GPT, train + infer, compare with eager/inductor (enn_backend.demo)
  report    pretty-print a saved report JSON                                (enn_backend.debug.cli)
  minify    shrink a repro script to the smallest failing graph             (enn_backend.debug.cli)
  bench     benchmark and accuracy suite                                    (enn_backend.bench.cli)
  state     list or clear kernel state (kernels pinned after a fault)       (enn_backend.debug.cli)
  registry  list or clear the kernel choices enn measured                   (enn_backend.registry.cli)
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

from . import __version__

COMMANDS = {
    "doctor": ("enn_backend.doctor", "main", "check this machine: versions, devices, kernels, cache, entry point"),
    "demo": ("enn_backend.demo", "main", "compile a small GPT with enn, train and infer, compare with eager and inductor"),
    "report": ("enn_backend.debug.cli", "report_main", "pretty-print a saved enn report (JSON)"),
    "minify": ("enn_backend.debug.cli", "minify_main", "shrink an enn repro script to the smallest failing graph"),
    "bench": ("enn_backend.bench.cli", "main", "run the benchmark and accuracy suite"),
    "state": ("enn_backend.debug.cli", "state_main", "list or clear kernel state: kernels pinned to eager after a fault"),
    "registry": ("enn_backend.registry.cli", "main", "list or clear the kernel choices enn measured and cached"),
}


def usage() -> str:
    lines = ["usage: python -m enn_backend <command> [args]   (<command> --help: its arguments)",
             "       python -m enn_backend --version", "", "commands:"]
    lines += [f"  {name:<9} {doc}" for name, (_, _, doc) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run one command; exit status 0 ok, 1 the command found a problem, 2 bad arguments or
    files, 128 + SIGPIPE when the reader of the output went away (``| head``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        print(f"enn_backend {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"enn: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    try:
        status = int(getattr(importlib.import_module(module), func)(rest) or 0)
        sys.stdout.flush()  # a closed pipe raises here, not in the interpreter's exit
    except BrokenPipeError:
        # The reader stopped reading: stop quietly, as a Unix tool killed by SIGPIPE does.
        # stdout goes to /dev/null so that the interpreter's final flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    return status
