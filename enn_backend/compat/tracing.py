"""Tracing and debugging tools: make_fx, AOT's joint trace, the FX minifier, structured trace
artifacts, fake-tensor mode, size hints, the dispatcher's op names."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx

# --- Debugging tools (enn_backend.debug) ------------------------------------------------
# Checked on 2.11 and 2.13: trace_structured (since 2.3), make_fx, fx_minifier.minifier
# (signature with save_dir/offload_to_disk/skip_sanity/max_granularity since 2.1), and
# torch._C._dispatch_get_all_op_names all exist unchanged.


def trace_structured_artifact(name: str, payload_fn: Callable[[], str]) -> None:
    """Write a JSON artifact into the TORCH_TRACE log (shown by tlparse); free when off."""
    try:
        from torch._logging import trace_structured
    except ImportError:  # pragma: no cover - torch < 2.3
        return
    trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": "json"}, payload_fn=payload_fn)


def make_fx(fn: Callable[..., Any], tracing_mode: str = "fake") -> Callable[..., torch.fx.GraphModule]:
    """ATen-level tracing; real tensor constants of the module (get_attr) are allowed."""
    from torch.fx.experimental.proxy_tensor import make_fx as _make_fx

    return _make_fx(fn, tracing_mode=tracing_mode, _allow_non_fake_inputs=True)


def fx_minifier(gm: torch.fx.GraphModule, inputs: list, module_fails: Callable[..., bool], **kwargs: Any) -> Any:
    """torch's delta-debugging FX minifier; ``dump_state`` is silenced (enn writes its own repro)."""
    from torch._functorch.fx_minifier import minifier

    return minifier(gm, inputs, module_fails, dump_state=lambda *a, **k: None, **kwargs)


def registered_op_names(namespace: str) -> list[str]:
    """Qualified names (``enn::pinned``) of every op registered in ``namespace``."""
    prefix = namespace + "::"
    return sorted({n for n in torch._C._dispatch_get_all_op_names() if n.startswith(prefix)})


# --- Real tensors while a FakeTensorMode is active (passes/epilogue.py) -----------------
# Joint-graph passes run inside AOT Autograd's FakeTensorMode. The epilogue pass evaluates
# small real float64 probes; torch._subclasses.fake_tensor.unset_fake_temporarily exists,
# unchanged, from 2.1 through 2.13 (checked in the 2.11 and 2.13 sources).


def real_tensor_mode() -> Any:
    """Context manager: ops on real tensors run for real even inside a FakeTensorMode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def size_hint(s: Any) -> int:
    """A concrete example value for a size, WITHOUT installing a guard on it.

    ``int(symint)`` specializes the compiled graph to that size (a recompile for every
    new sequence length under ``dynamic=True``); the hint is the value seen at trace time.
    Returns 0 for a symbolic size without a hint.
    """
    if isinstance(s, torch.SymInt):
        hint = s.node.hint
        return int(hint) if hint is not None else 0
    return int(s)


def detect_fake_mode(tensors: list) -> Any:
    """The FakeTensorMode the given (fake) tensors belong to, or None."""
    from torch._guards import detect_fake_mode as detect

    return detect(tensors)


def fake_mode_of(example_inputs: list) -> Any:
    """The fake mode a compile's inputs belong to (the tracing context's), else a new one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return detect_fake_mode(example_inputs) or FakeTensorMode()


def is_fake(t: Any) -> bool:
    """Whether ``t`` is a FakeTensor (no data to read)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def joint_fwd_bwd(fn: Callable[..., Any], args: list) -> torch.fx.GraphModule:
    """AOT Autograd's joint forward + backward graph of ``fn`` (how Inductor traces training replacements)."""
    from torch._inductor.pattern_matcher import joint_fwd_bwd as trace

    return trace(fn, args)
