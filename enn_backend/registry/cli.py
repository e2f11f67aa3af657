"""``python -m enn_backend registry list|clear``: the kernel choices enn measured and cached."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

from ..options import Options, OptionsError
from . import cache as C


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m enn_backend registry",
        description="List or clear the kernel choices enn measured (option measure_ms, or mode='max-autotune') and "
                    f"cached in {C.FILE_NAME}: one per op, problem, dtype, device and library versions.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{list,clear}")
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--cache-dir", metavar="DIR",
                       help=f"the folder holding {C.FILE_NAME} (default: ENN_CACHE_DIR, else ~/.cache/enn)")
    ls = sub.add_parser("list", parents=[where], help="list the cached choices (op, dims, epilogue, dtype, device, kernel, times)")
    ls.add_argument("--json", action="store_true", help="print the entries as JSON")
    cl = sub.add_parser("clear", parents=[where], help="remove every cached choice, or those of one op (--op)")
    cl.add_argument("--op", metavar="OP", help="remove only the choices of this op (gemm_epilogue, attention)")
    args = p.parse_args(argv)
    folder = args.cache_dir
    if not folder:
        try:
            folder = Options.from_sources().resolved_cache_dir()
        except OptionsError as exc:
            print(f"enn registry: {exc}", file=sys.stderr)
            return 2
    if os.path.exists(folder) and not os.path.isdir(folder):
        print(f"enn registry: {folder} is not a folder", file=sys.stderr)
        return 2
    cache = C.ChoiceCache(os.path.join(folder, C.FILE_NAME))
    if args.command == "clear":
        if not os.path.exists(cache.path or ""):
            print(f"no kernel choices in {cache.path}: nothing to clear")
            return 0
        try:
            gone = cache.clear(None if args.op is None else (lambda e: e.key.op == args.op))
        except OSError as exc:
            print(f"enn registry: cannot write {cache.path}: {exc}", file=sys.stderr)
            return 2
        print(f"removed {len(gone)} kernel choice{'' if len(gone) == 1 else 's'} from {cache.path}")
        return 0
    entries = cache.entries()
    if args.json:
        print(json.dumps({"path": cache.path, "entries": [e.to_json() for e in entries]}, indent=2))
        return 0
    if not entries:
        print(f"no kernel choices in {cache.path}")
        return 0
    now = time.time()
    rows = [("OP", "DIMS", "EPILOGUE", "DTYPE", "DEVICE", "KERNEL", "AGE", "TIMES (ms)")]
    for e in entries:
        k = e.key
        times = ", ".join(f"{name} {ms:.4g}" for name, ms in sorted(e.timings_ms, key=lambda t: t[1]))
        rows.append((k.op, "x".join(map(str, k.dims)), k.epilogue, k.dtype, f"{k.device.name} ({k.device.sm})",
                     e.kernel, f"{int((now - e.time) // 60)}m", times))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    print(f"kernel choices {cache.path} (each applies only on the device and library versions that measured it)")
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    print(f"{len(entries)} choice{'' if len(entries) == 1 else 's'}. Clear: python -m enn_backend registry clear"
          + (f" --cache-dir {shlex.quote(folder)}" if args.cache_dir else ""))
    return 0
