"""``python -m enn_backend report FILE`` and ``python -m enn_backend minify REPRO``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def format_full_report(data: dict[str, Any]) -> str:
    """The report table (enn_backend.report.format_report) plus guard events and repro scripts."""
    from ..report import format_report

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
    import os

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
    from .minify import MinifyError, minify, write_corpus

    try:
        res = minify(args.repro, any_failure=args.any, max_granularity=args.max_granularity, out=args.out,
                     verbose=args.verbose)
        if args.corpus:
            print(f"wrote {_shown(write_corpus(res.path, args.corpus, args.corpus_doc))}")
    except MinifyError as exc:
        print(f"enn minify: {exc}", file=sys.stderr)
        return 2
    print(f"enn minify: {res.kind} reproduces with {res.nodes_after} of {res.nodes_before} nodes "
          f"({res.checks} check{'s' if res.checks != 1 else ''}, {res.seconds:.1f}s)")
    print(f"wrote {_shown(res.path)}")
    return 0
