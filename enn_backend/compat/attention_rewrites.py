"""Inductor's own attention rewrites, kept off enn's compiles (enn owns attention)."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections import defaultdict
from typing import Any, Iterator

import torch

# --- Inductor's own attention rewrites (enn owns attention) -------------------------------
# Inductor's joint-graph pass registers its attention patterns (fx_passes/fuse_attention.py,
# `_sfdp_pattern_*`: 27 on 2.11, 30 on 2.13 / 2.15, 117 - 126 registered variants) into
# `joint_graph.patterns`, each rewriting to SDPA. Their checks miss semantics:
# pytorch/pytorch#196468 (open; wrong on 2.11 - 2.14, right on 2.15): a softmax over another axis
# than the keys' is rewritten as attention and returns values off by ~3. Under enn, enn's
# attention pass alone decides what is attention, so Inductor's patterns are kept off enn's
# compiles on every version. No Inductor config switches them off alone (checked 2.11 - 2.15;
# `pattern_matcher=False` also drops every other pattern pass), so for the length of one enn
# compile, in the compiling thread, `joint_graph.patterns` applies a copy of itself without them.
# An entry is Inductor's attention pattern when the check `register_replacement` made for it
# closes over a `replace_fn` defined in fuse_attention (2.11 - 2.15). Covered by
# tests/test_upstream_corpus.py and minifier_repros/repro_upstream_196468_*.py.
_ATTENTION_MODULE = "torch._inductor.fx_passes.fuse_attention"
_attention_off: list[int] = []  # idents of the threads inside an enn compile (nesting repeats one)
_attention_warned: list[bool] = []


def _replace_fn(entry: Any) -> Any:
    check = getattr(entry, "extra_check", None)
    names = getattr(getattr(check, "__code__", None), "co_freevars", ())
    if "replace_fn" not in names or check.__closure__ is None:
        return None
    return check.__closure__[names.index("replace_fn")].cell_contents


def is_inductor_attention_rewrite(entry: Any) -> bool:
    """Is this pattern-matcher entry one of Inductor's attention rewrites (fuse_attention)?"""
    return getattr(_replace_fn(entry), "__module__", None) == _ATTENTION_MODULE


def _joint_patterns() -> Any:
    from torch._inductor.fx_passes import joint_graph

    return joint_graph.patterns


def inductor_attention_rewrites(registry: Any = None) -> int:
    """How many of Inductor's attention rewrites ``registry`` (the joint-graph patterns) holds."""
    registry = _joint_patterns() if registry is None else registry
    return sum(is_inductor_attention_rewrite(e) for entries in registry.patterns.values() for e in entries)


def _without_attention(registry: Any) -> Any:
    """A copy of the pattern pass ``registry`` without Inductor's attention rewrites."""
    kept = type(registry).__new__(type(registry))
    kept.__dict__.update({k: v for k, v in registry.__dict__.items() if k != "apply"})
    kept.patterns = defaultdict(list)
    for key, entries in registry.patterns.items():
        keep = [e for e in entries if not is_inductor_attention_rewrite(e)]
        if keep:
            kept.patterns[key] = keep
    return kept


def _warn_if_unrecognized(registry: Any) -> None:
    info = getattr(getattr(sys.modules.get(_ATTENTION_MODULE), "_sfdp_init", None), "cache_info", None)
    registered = info is not None and info().currsize > 0  # Inductor has registered its patterns
    if registered and not _attention_warned and inductor_attention_rewrites(registry) == 0:
        _attention_warned.append(True)
        logging.getLogger("enn_backend").warning(
            "enn: torch %s registered Inductor's attention patterns in a form enn does not recognize; "
            "they may rewrite graphs enn's attention matcher declined (pytorch/pytorch#196468)",
            torch.__version__)


def _apply(gm: Any) -> int:
    registry = _joint_patterns()
    if threading.get_ident() not in _attention_off:
        return type(registry).apply(registry, gm)  # another thread's compile (plain Inductor)
    _warn_if_unrecognized(registry)
    return _without_attention(registry).apply(gm)


@contextlib.contextmanager
def inductor_attention_rewrites_off() -> Iterator[None]:
    """Within this context, compiles in this thread run Inductor's joint-graph patterns
    without its attention rewrites; other threads' compiles still see them all."""
    registry = _joint_patterns()
    registry.apply = _apply  # an instance attribute over the class's method, while any enn compile runs
    _attention_off.append(threading.get_ident())
    try:
        yield
    finally:
        _attention_off.remove(threading.get_ident())
        if not _attention_off:
            registry.__dict__.pop("apply", None)
