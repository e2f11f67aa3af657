"""``python -m enn_backend report FILE``, ``minify REPRO`` and ``state list|clear``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from typing import Any

from ..guard import kernel_state as K
from ..options import Options, OptionsError
from ..report import format_report
from .minify import MinifyError, minify, write_corpus


def format_full_report(data: dict[str, Any]) -> str:
    """The report table (enn_backend.report.format_report) plus guard events and repro scripts."""
    lines = [format_report(data)]
    repros = [(g["id"], e["repro"]) for g in data.get("graphs", []) for e in g.get("events", []) if "repro" in e]
    if repros:
        lines.append("repro scripts (run one: python <path>; shrink it: python -m enn_backend minify <path>):")
        lines += [f"  {gid}: {path}" for gid, path in repros]
    counters = data.get("counters") or {}
    if counters:
        lines.append("counters: " + ", ".join(f"{k}={v}" for k, v in sorted(counters.items())))
    return "\n".join(lines)


def report_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m enn_backend report",
                                description="Pretty-print a report saved with enn_backend.report().save(path).")
    p.add_argument("file", help="the saved report (JSON)")
    p.add_argument("--json", action="store_true", help="print the JSON itself (validated), not the table")
    args = p.parse_args(argv)
    try:
        with open(args.file) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        print(f"enn report: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    if not isinstance(data, dict) or data.get("format") != "enn-report":
        print(f"enn report: {args.file} is not an enn report (expected \"format\": \"enn-report\")", file=sys.stderr)
        return 2
    print(json.dumps(data, indent=2) if args.json else format_full_report(data))
    return 0


def _shown(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def minify_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m enn_backend minify",
                                description="Shrink an enn repro (folder or repro.py) to the smallest graph that "
                                            "still fails the same way; writes <folder>/minified/repro.py.")
    p.add_argument("repro", help="a repro folder written by enn, or its repro.py")
    p.add_argument("--any", action="store_true", help="accept any failure kind, not only the original one")
    p.add_argument("--out", help="folder for the minimized repro (default: <repro folder>/minified)")
    p.add_argument("--max-granularity", type=int, help="torch minifier's max_granularity (a power of two)")
    p.add_argument("--verbose", action="store_true", help="show torch minifier's progress")
    p.add_argument("--corpus", metavar="PATH",
                   help="also write the minimized repro as a self-contained minifier_repros/repro_*.py test")
    p.add_argument("--corpus-doc", default="", help="what the fault is and where it came from (the corpus file's docstring)")
    args = p.parse_args(argv)
    try:
        res = minify(args.repro, any_failure=args.any, max_granularity=args.max_granularity, out=args.out,
                     verbose=args.verbose)
        if args.corpus:
            print(f"wrote {_shown(write_corpus(res.path, args.corpus, args.corpus_doc))}")
    except MinifyError as exc:
        print(f"enn minify: {exc}", file=sys.stderr)
        return 2
    print(f"enn minify: {res.kind} reproduces with {res.ops_after} of {res.ops_before} ops "
          f"({res.checks} check{'s' if res.checks != 1 else ''}, {res.seconds:.1f}s)")
    print(f"wrote {_shown(res.path)}")
    return 0


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{max(int(seconds), 0)}s"


def state_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m enn_backend state",
        description="List or clear enn's kernel state: the kernels the guard pinned to eager (and the graphs it moved "
                    "to fp32) after they faulted. Every later compile of the same kernel on this machine's cache folder, "
                    "torch and enn version starts with the pin, until the entry expires "
                    f"({K.MAX_AGE_DAYS} days after its last fault) or is cleared.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{list,clear}")
    where = argparse.ArgumentParser(add_help=False)
    place = where.add_mutually_exclusive_group()
    place.add_argument("--cache-dir", metavar="DIR",
                       help=f"the folder holding {K.FILE_NAME} (default: ENN_CACHE_DIR, else ~/.cache/enn)")
    place.add_argument("--file", metavar="PATH",
                       help="a state file of its own (a run with injected faults keeps its pins in one, beside "
                            f"{K.FILE_NAME}: `list` names them)")
    ls = sub.add_parser("list", parents=[where], help="list the entries (key, action, fails, age, status, reason, torch, machine)")
    ls.add_argument("--json", action="store_true", help="print the entries as JSON")
    cl = sub.add_parser("clear", parents=[where], help="remove every entry, or those whose key contains --key")
    cl.add_argument("--key", metavar="TEXT", help="remove only the entries whose key contains TEXT")
    args = p.parse_args(argv)
    if args.file:
        if os.path.isdir(args.file):
            print(f"enn state: {args.file} is a folder (--cache-dir names a folder, --file a state file)", file=sys.stderr)
            return 2
        return _state_command(args, K.KernelState(os.path.abspath(args.file)), others=[])
    folder = args.cache_dir
    if not folder:
        try:
            folder = Options.from_sources().resolved_cache_dir()
        except OptionsError as exc:
            print(f"enn state: {exc}", file=sys.stderr)
            return 2
    if os.path.exists(folder) and not os.path.isdir(folder):
        print(f"enn state: {folder} is not a folder", file=sys.stderr)
        return 2
    state = K.KernelState(os.path.join(folder, K.FILE_NAME))
    return _state_command(args, state, others=K.other_state_files(folder))


def _state_command(args: argparse.Namespace, state: K.KernelState, others: list[str]) -> int:
    """``state list`` / ``state clear`` on ``state``'s file; ``others``: the folder's other state
    files (of runs with injected faults), named by ``list``."""
    now = time.time()

    if args.command == "clear":
        if not os.path.exists(state.path):
            if args.key is not None:  # as for a file none of whose keys match
                print(f"enn state: no entry's key contains {args.key!r}: no kernel state in {state.path}", file=sys.stderr)
                return 1
            print(f"no kernel state in {state.path}: nothing to clear")
            return 0
        try:
            gone = state.clear(None if args.key is None else (lambda e: args.key in e.key))
        except OSError as exc:
            print(f"enn state: cannot write {state.path}: {exc}", file=sys.stderr)
            return 2
        if args.key is not None and not gone:
            print(f"enn state: no entry's key contains {args.key!r} in {state.path}", file=sys.stderr)
            return 1
        print(f"removed {len(gone)} entr{'y' if len(gone) == 1 else 'ies'} from {state.path}")
        for e in gone:
            print(f"  {e.key} ({e.action}, torch {e.torch_version})")
        return 0

    entries = sorted(state.entries(), key=lambda e: (e.status(now) != "in force", -e.last_time))
    if args.json:
        torch_version, enn_version = K.current_versions()
        print(json.dumps({"path": state.path, "torch_version": torch_version, "enn_version": enn_version,
                          "max_age_days": K.MAX_AGE_DAYS,
                          "entries": [{**asdict(e), "age_s": round(now - e.last_time, 1), "status": e.status(now)}
                                      for e in entries]}, indent=2))
        return 0
    also = [(path, len(K.KernelState(path).entries())) for path in others]
    also = [(path, n) for path, n in also if n]
    if not entries:
        print(f"no kernel state in {state.path}")
        _name_others(also)
        return 0
    rows = [("KEY", "ACTION", "FAILS", "AGE", "STATUS", "TORCH", "MACHINE", "REASON")]
    rows += [(e.key, e.action, str(e.fail_count), _age(now - e.last_time), e.status(now), e.torch_version, e.machine,
              (e.reason or e.last_exc_msg)[:60]) for e in entries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    print(f"kernel state {state.path} (age: since the last fault; entries expire after {K.MAX_AGE_DAYS} days "
          "and apply only to the torch and enn version that wrote them)")
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    in_force = sum(e.status(now) == "in force" for e in entries)
    print(f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, {in_force} in force. "
          f"Clear: {K.state_command(state, 'clear')} (one kernel: {K.state_command(state, 'clear', entries[0].key)})")
    _name_others(also)
    return 0


def _name_others(also: list[tuple[str, int]]) -> None:
    for path, n in also:
        print(f"also {n} entr{'y' if n == 1 else 'ies'} of a run with injected faults (fault_inject) in {path}: "
              f"{K.state_command(K.KernelState(path), 'list')}")
