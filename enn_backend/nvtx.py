"""Named ranges for profilers: NVTX on CUDA, and the same name as a ``torch.profiler`` record.

A range is named ``enn/<kind>/<kernel> <module path>``: ``enn/attention/cudnn model.layers.3.self_attn``,
``enn/pinned/aten.addmm model.mlp.up``, ``enn/fp32/graph g0``. Kinds: ``attention``,
``attention_backward``, ``epilogue``, ``pinned``, ``fp32`` (a graph re-run in fp32), ``eager``
(an eager-run unit).

Rules:

- Off unless asked for (option ``nvtx`` / ``ENN_NVTX=1``): callers pass the option's value, and
  :func:`maybe_range` then returns a shared null context, so a disabled range costs one call.
- On CUDA (when CUDA is initialized) the range is ``torch.cuda.nvtx.range_push/pop``, which Nsight
  Systems and ``ncu --nvtx`` show; everywhere it is also a ``torch.profiler.record_function`` of the
  same name, which ``torch.profiler`` shows (and tests read on CPU).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager, Iterator, TypeVar

import torch

KINDS = ("attention", "attention_backward", "epilogue", "pinned", "fp32", "eager")
_OFF: ContextManager[None] = contextlib.nullcontext()

F = TypeVar("F", bound=Callable[..., Any])


def range_name(kind: str, kernel: str, module_path: str = "") -> str:
    """``enn/<kind>/<kernel> <module path>`` (without the path when there is none)."""
    if kind not in KINDS:
        raise ValueError(f"enn nvtx: kind {kind!r} is not one of {', '.join(KINDS)}")
    name = f"enn/{kind}/{kernel}"
    return f"{name} {module_path}" if module_path else name


@contextlib.contextmanager
def named_range(name: str) -> Iterator[None]:
    """An NVTX range (when CUDA is initialized) and a profiler record, both called ``name``."""
    nvtx = torch.cuda.is_available() and torch.cuda.is_initialized()
    if nvtx:
        torch.cuda.nvtx.range_push(name)
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        if nvtx:
            torch.cuda.nvtx.range_pop()


def maybe_range(enabled: bool, kind: str, kernel: str, module_path: str = "") -> ContextManager[None]:
    """:func:`named_range` of ``range_name(kind, kernel, module_path)`` when ``enabled``, else a null context.

    The guard's hooks: ``with nvtx.maybe_range(opts.nvtx, "fp32", "graph", unit): ...`` around an
    fp32 retry, ``"eager"`` around an eager-run unit."""
    return named_range(range_name(kind, kernel, module_path)) if enabled else _OFF


def wrap(fn: F, enabled: bool, kind: str, kernel: str, module_path: str = "") -> F:
    """``fn`` running inside its range when ``enabled``; ``fn`` itself otherwise (nothing added)."""
    if not enabled:
        return fn
    name = range_name(kind, kernel, module_path)

    @functools.wraps(fn)
    def ranged(*args: Any, **kwargs: Any) -> Any:
        with named_range(name):
            return fn(*args, **kwargs)

    return ranged  # type: ignore[return-value]
