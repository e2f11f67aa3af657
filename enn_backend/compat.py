"""Every private torch import enn uses, and every version branch, in one place.

enn supports torch 2.11 to 2.15 (pyproject.toml): the suite runs on 2.13.0 and 2.14.1 in CI
(CPU), on 2.15.0 (CPU) by hand and on 2.11 (CUDA, the lent GPU machine). Each workaround says
which torch versions need it and when it can go; each upstream behaviour a test states is a
named predicate below, with its versions, the upstream reason and the test that covers it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import sys
import threading
import typing
from typing import Any, Callable, Iterator

import torch
import torch.fx

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

# --- Upstream behaviour that tests state, by version -------------------------------------
def cpp_emulates_precision_casts() -> bool:
    """torch >= 2.13: Inductor's C++ (CPU) code honours ``emulate_precision_casts``, rounding
    each intermediate to the low-precision dtype as eager does; 2.11 and 2.12 emit the same CPU
    code with it on or off (``codegen/cpp.py`` reads the flag from 2.13: checked in the 2.11,
    2.12.1 and 2.13.0 sources; 2.11 measured). Triton code honours it on every supported torch.
    Covered by tests/test_precision.py::test_emulate_precision_casts_matches_eager_bitwise."""
    return TORCH_VERSION >= (2, 13)


def emulate_precision_casts_rounds_python_scalars() -> bool:
    """torch >= 2.15: under ``emulate_precision_casts`` Inductor's C++ code rounds a Python
    scalar operand of a bf16 op to bf16 (``static_cast<at::BFloat16>(0.33)``; 2.13 and 2.14.1
    emit ``static_cast<float>(0.33)``), where eager multiplies by the scalar in fp32: the
    result is no longer eager's bit for bit (it differs from eager in more elements than
    without emulation). Tensor operands still match eager exactly on every version.
    Covered by tests/test_precision.py::test_emulate_precision_casts_matches_eager_bitwise."""
    return TORCH_VERSION >= (2, 15)


def inductor_compiles_nan_amax() -> bool:
    """torch >= 2.14: Inductor compiles ``amax`` over a NaN-filled constant (pytorch/pytorch
    #188225 fixed); 2.13 raises "ValueError: The argument 'nan' is not comparable" (index
    propagation calls sympy's max on nan). Covered by
    minifier_repros/repro_upstream_188225_amax_nan_constant.py."""
    return TORCH_VERSION >= (2, 14)


# --- Inductor entry points ---------------------------------------------------------
from torch._inductor import config as inductor_config  # noqa: E402
from torch._inductor.compile_fx import compile_fx, compile_fx_inner  # noqa: E402
from torch._inductor.decomposition import select_decomp_table  # noqa: E402
from torch._functorch import config as functorch_config  # noqa: E402
from torch._guards import TracingContext, tracing  # noqa: E402
from torch._dynamo.utils import counters as dynamo_counters  # noqa: E402
from torch._inductor.fx_passes.post_grad import remove_noop_ops  # noqa: E402
from torch._inductor.pattern_matcher import stable_topological_sort  # noqa: E402

try:  # 2.6+: passes must be CustomGraphPass objects with a uuid() or the FX cache is bypassed
    from torch._inductor.custom_graph_pass import CustomGraphPass  # noqa: E402
except ImportError:  # pragma: no cover - torch < 2.6
    class CustomGraphPass:  # type: ignore[no-redef]
        def uuid(self) -> Any:
            return None


def mode_config_patches(mode: str) -> dict[str, Any]:
    """Inductor config patches for a torch.compile ``mode=`` value (its Inductor meaning)."""
    if mode in (None, "", "default"):
        return {}
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


@functools.cache
def inductor_option_types() -> dict[str, Any]:
    """Inductor's config keys as ``torch.compile(backend="inductor", options=...)`` takes them
    (nested ones dotted: ``"triton.cudagraphs"``), each with the class a value must be an
    instance of, or None where the declared type is no plain class (``int | None``,
    ``list[str]``): the check of ``_TorchCompileInductorWrapper.apply_options``
    (torch/__init__.py, the same on 2.11 to 2.15)."""
    return {name: (kind if typing.get_origin(kind := inductor_config.get_type(name)) is None else None)
            for name in inductor_config.get_config_copy()}


def inductor_config_patches(mode: str, options: Any) -> dict[str, Any]:
    """Inductor's config for an enn compile: ``mode``'s patches, then the Inductor keys of
    ``options=`` (``(key, value)`` pairs, enn_backend.options.Options.inductor), which win
    where both set a key."""
    return {**mode_config_patches(mode), **dict(options)}


def inductor_compile_fx(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
    """Inductor's own compile_fx (the exact path of ``backend="inductor"``)."""
    return compile_fx(gm, example_inputs, **kwargs)


def copy_dynamo_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a Dynamo-captured graph that AOT Autograd still recognizes as Dynamo's.

    ``fx.GraphModule(gm, deepcopy(gm.graph))`` keeps the nodes but drops what Dynamo hands
    AOT Autograd outside them (torch 2.13, ``_aot_autograd/frontend_utils.py``): ``gm.meta``
    (``dynamo_compile_id``), ``gm._param_name_to_source`` and each placeholder's
    ``_dynamo_source``. Without them AOT Autograd knows no static inputs (parameters and
    buffers): the min-cut partitioner then saves views of the weights and masks computed
    from buffers instead of the weights themselves (nanoGPT's training forward ran 0.64 vs
    0.47 ms on CPU), and CUDA graphs would treat parameters as inputs to copy.
    """
    import copy

    new = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    new.meta.update(gm.meta)
    for attr in ("_param_name_to_source", "_source_to_user_stacks", "compile_subgraph_reason"):
        if hasattr(gm, attr):
            setattr(new, attr, getattr(gm, attr))
    old_ph = gm.graph.find_nodes(op="placeholder")
    new_ph = new.graph.find_nodes(op="placeholder")
    for old, node in zip(old_ph, new_ph):
        if hasattr(old, "_dynamo_source"):
            node._dynamo_source = old._dynamo_source  # type: ignore[attr-defined]
    return new


@contextlib.contextmanager
def no_aot_autograd_cache() -> Iterator[None]:
    """Compile without the AOTAutograd cache (the FX graph cache stays on)."""
    with functorch_config.patch(enable_autograd_cache=False):
        yield


@contextlib.contextmanager
def saved_tensors_kept() -> Iterator[None]:
    """Compile so that a backward graph never writes into its inputs.

    AOT Autograd *donates* the saved tensors of a backward graph (``donated_buffer``, on by
    default since torch 2.6) and Inductor may then reuse their memory for the backward's own
    buffers. The guard re-runs a faulty backward eagerly on the very inputs the compiled call
    received, so under a guard they must still hold what they held. Without donation the
    saved tensors are still freed as soon as they are dead (AOT clears the autograd context's
    references before the call), so the cost is buffer reuse only, not a longer lifetime.
    Covered by tests/test_guard.py::test_backward_rerun_reads_the_inputs_it_was_given.
    """
    with functorch_config.patch(donated_buffer=False):
        yield


def donated_inputs() -> list[int]:
    """Indices of the backward graph's inputs that AOT Autograd donated to Inductor (asked
    inside ``inner_compile`` of a backward graph; empty when nothing is donated)."""
    from torch._inductor.utils import get_donated_idxs

    return list(get_donated_idxs() or [])


def compile_lock() -> Any:
    """Dynamo's compile lock (an RLock): Inductor's compile is not thread-safe, and the guard
    recompiles graphs at run time, possibly while another thread compiles a frame."""
    from torch._dynamo.convert_frame import compile_lock

    return compile_lock


# --- AOTAutograd cache hits (enn_backend/aot_cache.py) ------------------------------------
# A hit skips ``inner_compile``, where enn wraps each graph in its guard. Every hit goes
# through ``GenericAOTAutogradResult.wrap_post_compile`` (checked on 2.11 and 2.13), which loads the
# forward and backward artifacts and passes each through its part's ``post_compile``: for
# the length of one enn compile, enn sees the entry there and wraps what each part's
# ``post_compile`` returns. Where that method is missing, or entries are bundled (they carry
# no FX graph keys), enn compiles without the AOTAutograd cache, as it did before.
try:
    from torch._functorch._aot_autograd.aot_autograd_result import GenericAOTAutogradResult as _AOTResult  # noqa: E402
    from torch._functorch._aot_autograd.autograd_cache import FXGraphCacheMiss  # noqa: E402
    from torch._functorch._aot_autograd.autograd_cache import should_bundle_autograd_cache  # noqa: E402

    _AOT_WRAP = _AOTResult.__dict__.get("wrap_post_compile")
except ImportError:  # pragma: no cover - a torch without it (older, or moved)
    _AOTResult, _AOT_WRAP = None, None

    class FXGraphCacheMiss(Exception):  # type: ignore[no-redef]
        pass

    def should_bundle_autograd_cache() -> bool:  # type: ignore[misc]
        return True

_AOT_HANDLERS: list[Callable[..., Any]] = []


def aot_cache_usable() -> bool:
    """Can enn take AOTAutograd cache hits here (and is the cache switched on)?"""
    return (_AOT_WRAP is not None and bool(functorch_config.enable_autograd_cache)
            and not should_bundle_autograd_cache())


def _wrap_post_compile(entry: Any, *args: Any, **kwargs: Any) -> Any:
    if not _AOT_HANDLERS:
        return _AOT_WRAP(entry, *args, **kwargs)
    return _AOT_HANDLERS[-1](entry, lambda: _AOT_WRAP(entry, *args, **kwargs))


@contextlib.contextmanager
def aot_cache_hits(handler: Callable[[Any, Callable[[], Any]], Any]) -> Iterator[None]:
    """Within this context an AOTAutograd cache hit goes through ``handler(entry, load)``.

    ``load()`` builds the compiled function from the entry (see :func:`aot_entry_load` to
    wrap its graphs); the handler returns that function, or raises :class:`FXGraphCacheMiss`
    to refuse the entry (AOT Autograd then compiles as on a miss).
    """
    if not aot_cache_usable():
        with no_aot_autograd_cache():
            yield
        return
    _AOT_HANDLERS.append(handler)
    patched = _AOTResult.__dict__.get("wrap_post_compile") is _wrap_post_compile
    if not patched:
        _AOTResult.wrap_post_compile = _wrap_post_compile
    try:
        yield
    finally:
        _AOT_HANDLERS.pop()
        if not patched:
            _AOTResult.wrap_post_compile = _AOT_WRAP


def aot_entry_load(entry: Any, load: Callable[[], Any], wrap_forward: Callable[[Any], Any],
                   wrap_backward: Callable[[Any], Any]) -> Any:
    """``load()``, with the entry's loaded forward (or inference) and backward graphs passed
    through ``wrap_forward`` / ``wrap_backward`` before AOT Autograd builds on them."""
    parts = [(entry.compiled_fw, wrap_forward)]
    if entry.compiled_bw is not None:
        parts.append((entry.compiled_bw, wrap_backward))
    for part, wrap in parts:
        post_compile = part.post_compile
        part.post_compile = lambda result, fx_config, _p=post_compile, _w=wrap: _w(_p(result, fx_config))
    try:
        return load()
    finally:
        for part, _ in parts:
            part.__dict__.pop("post_compile", None)


def aot_entry_graph_keys(entry: Any) -> tuple[str | None, str | None]:
    """The FX graph cache keys of an AOTAutograd cache entry's forward and backward."""
    def key(part: Any) -> str | None:
        info = getattr(part, "fx_graph_cache_info", None)
        return info[0] if isinstance(info, tuple) and info and isinstance(info[0], str) else None

    return key(entry.compiled_fw), key(entry.compiled_bw) if entry.compiled_bw is not None else None


@contextlib.contextmanager
def eager_backward_compile() -> Iterator[None]:
    """Trace with AOTAutograd's cache off and the backward graph handed over at once."""
    with functorch_config.patch(enable_autograd_cache=False, force_non_lazy_backward_lowering=True):
        yield


def current_tracing_context() -> Any:
    return TracingContext.try_get()


@contextlib.contextmanager
def tracing_context(ctx: Any) -> Iterator[None]:
    """Re-enter the tracing context a graph was first compiled under (for recompiles)."""
    if ctx is None:
        yield
        return
    with tracing(ctx):
        yield


def hash_files(paths: list[str]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def fx_graph_cache_counters() -> dict[str, int]:
    c = dynamo_counters["inductor"]
    return {"hit": c.get("fxgraph_cache_hit", 0), "miss": c.get("fxgraph_cache_miss", 0), "bypass": c.get("fxgraph_cache_bypass", 0)}


@contextlib.contextmanager
def inductor_lowerings_patched(extra: dict[Any, Callable[..., Any]]) -> Iterator[None]:
    """Install lowerings for enn's own ops only while enn compiles.

    Inductor keeps lowerings in one global dict; enn adds entries on enter and
    restores the dict on exit, so ``backend="inductor"`` never sees them.
    """
    from torch._inductor import lowering as L

    saved = {op: L.lowerings.get(op, _MISSING) for op in extra}
    before = set(L.lowerings)
    L.lowerings.update(extra)
    try:
        yield
    finally:
        for op, old in saved.items():
            if old is _MISSING:
                L.lowerings.pop(op, None)
            else:
                L.lowerings[op] = old
        # Inductor registers an implicit fallback lowering for every unknown custom op it
        # meets (enn::pinned, enn::fault, ...): take enn's out again, keep the table as found.
        for op in set(L.lowerings) - before:
            if getattr(op, "namespace", None) == "enn":
                L.lowerings.pop(op, None)
                L.fallbacks.discard(op)


_MISSING = object()


def fallback_lowering(op: Any) -> Callable[..., Any]:
    """Inductor's extern-kernel fallback for ``op`` (what an op without a lowering gets)."""
    from torch._inductor import lowering as L

    return L.fallback_handler(op, add_to_fallback_set=False)


def is_cuda_available() -> bool:
    return torch.cuda.is_available()


def triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except Exception:  # noqa: BLE001 - optional dependency
        return None


def is_dynamo_control_flow(exc: BaseException) -> bool:
    """Exceptions Dynamo uses to steer compilation (restart analysis, skip frame, graph
    break, user error). They must reach Dynamo untouched: they are not compile failures.
    Seen on 2.13: dynamic shapes raise TensorifyScalarRestartAnalysis from inside AOT."""
    from torch._dynamo import exc as dexc

    if not isinstance(exc, dexc.TorchDynamoException):
        return False
    return not isinstance(exc, (dexc.BackendCompilerFailed, dexc.InternalTorchDynamoError, dexc.TorchRuntimeError))


# --- torch.distributed, probed on every guarded call (guard/runtime.py) ------------------
# ``dist.is_initialized()`` is ``_world.default_pg is not None`` read through two properties
# (torch 2.6-2.13); the guard asks on every call of every graph, where the properties' Python
# calls cost ~0.5 us on a small CPU graph. Read the attribute they return instead.
try:
    from torch.distributed.distributed_c10d import _world as _c10d_world  # noqa: E402

    if not hasattr(_c10d_world, "_default_pg"):  # pragma: no cover - a torch that renamed it
        _c10d_world = None
except ImportError:  # pragma: no cover - torch built without distributed
    _c10d_world = None


def dist_initialized() -> bool:
    """``torch.distributed.is_initialized()``, cheaply."""
    if _c10d_world is not None:
        return _c10d_world._default_pg is not None
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


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


# --- Inductor IR builders for enn's lowerings (lowerings/precision.py) -------------------
# torch._inductor.lowering.lowerings is a private dict of op -> IR builder, unchanged
# from 2.0 through 2.13. enn composes these builders; it never writes to the dict here.


def inductor_lowering(op: Any) -> Callable[..., Any]:
    """Inductor's own lowering (IR builder) of an ATen/prims op."""
    from torch._inductor import lowering as L

    return L.lowerings[op]


# --- Benchmark suite (enn_backend.bench) ------------------------------------------------
# torch._inductor.utils.clear_inductor_caches exists from 2.1 to 2.13 (from 2.8 an alias of
# clear_caches); checked in the 2.11 and 2.13 sources. Covered by tests/test_bench.py.


def clear_inductor_memory_caches() -> None:
    """Forget Inductor's in-memory caches of compiled code (the disk caches are untouched).

    The benchmark gives each backend its own cache folder so that one backend's
    compiled kernels never make another's "cold" compile look fast.
    """
    from torch._inductor import utils

    (getattr(utils, "clear_caches", None) or utils.clear_inductor_caches)()


# --- Real tensors while a FakeTensorMode is active (passes/epilogue.py) -----------------
# Joint-graph passes run inside AOT Autograd's FakeTensorMode. The epilogue pass evaluates
# small real float64 probes; torch._subclasses.fake_tensor.unset_fake_temporarily exists,
# unchanged, from 2.1 through 2.13 (checked in the 2.11 and 2.13 sources).


def real_tensor_mode() -> Any:
    """Context manager: ops on real tensors run for real even inside a FakeTensorMode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def inductor_cache_dir() -> str:
    """Inductor's cache folder (``TORCHINDUCTOR_CACHE_DIR`` or its default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


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


# ----------------------------------------------------------------------------- FlexAttention
# FlexAttention's higher-order op and the private helpers enn's attention pass builds it with
# (enn_backend/passes/attention_flex.py). Their signatures are the same in torch 2.11 and 2.13;
# the block-mask tuple is not (13 vs 17 entries), so enn always builds it with BlockMask.
def flex_attention_hop() -> Any:
    from torch._higher_order_ops.flex_attention import flex_attention

    return flex_attention


def flex_kernel_options(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_lse: bool) -> dict:
    """The kernel options the public ``flex_attention`` would pass its HOP for these inputs."""
    from torch.nn.attention.flex_attention import _apply_kernel_options

    return dict(_apply_kernel_options(q, k, v, return_lse, None))


def flex_dense_to_ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks per row, their column indices first) of a dense block mask, as BlockMask stores them."""
    from torch.nn.attention.flex_attention import _dense_to_ordered

    return _dense_to_ordered(dense)


def joint_fwd_bwd(fn: Callable[..., Any], args: list) -> torch.fx.GraphModule:
    """AOT Autograd's joint forward + backward graph of ``fn`` (how Inductor traces training replacements)."""
    from torch._inductor.pattern_matcher import joint_fwd_bwd as trace

    return trace(fn, args)


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
    from collections import defaultdict

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
    import threading

    registry = _joint_patterns()
    registry.apply = _apply  # an instance attribute over the class's method, while any enn compile runs
    _attention_off.append(threading.get_ident())
    try:
        yield
    finally:
        _attention_off.remove(threading.get_ident())
        if not _attention_off:
            registry.__dict__.pop("apply", None)


# --- Known miscompiles: ATen nodes Inductor computes wrong, pinned to eager up front ------
# Each entry: a public upstream issue where Inductor on CPU returns finite wrong values or a
# wrong dtype for one ATen node of the graph enn compiles (post AOT Autograd), while the eager
# kernel is right. Checked on torch 2.11, 2.13, 2.14 and 2.15 (CPU): `fixed_in` is the first
# release found right (None: wrong on all four; the issue is open). Each entry names the repro
# in minifier_repros/ that covers it; it goes once enn requires a torch >= its `fixed_in`.
# `devices`: where the wrong step lives. Runs were on CPU only; an entry lists "cuda" too only
# where that step is a device-independent Inductor lowering (read in torch 2.13's lowering.py,
# not run on a GPU); a CPU code-generation or CPU-only decomposition bug stays "cpu".
# The graph compiler pins what `known_miscompiles` lists before it compiles, on every guard mode
# (a pin is not a run-time check): enn_backend/graph_compiler.py, a `known_miscompile` report line.


def _val(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, torch.fx.Node) else x


def _dtype(x: Any) -> Any:
    return getattr(_val(x), "dtype", None)


def _device_type(x: Any) -> Any:
    return getattr(getattr(_val(x), "device", None), "type", None)


def _narrow_int(dtype: Any) -> bool:
    return dtype in (torch.int8, torch.uint8, torch.int16, torch.int32)


def _floor_division(n: torch.fx.Node) -> bool:
    floor = n.target is not torch.ops.aten.div.Tensor_mode or n.kwargs.get("rounding_mode") == "floor"
    return floor and bool(getattr(_dtype(n), "is_floating_point", False))


def _flattening_argreduce(n: torch.fx.Node) -> bool:
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    return dim is None and getattr(_val(n.args[0]), "ndim", 0) >= 2


@dataclasses.dataclass(frozen=True)
class KnownMiscompile:
    issue: int  # pytorch/pytorch issue number
    ops: tuple[str, ...]  # ATen overloads (str(OpOverload)) the entry may pin
    applies: Callable[[torch.fx.Node], bool]  # does this node of such an op hit the bug
    what: str  # what Inductor computes instead of eager's result
    test: str  # the repro in minifier_repros/ that covers it
    fixed_in: tuple[int, int] | None = None  # first torch release found right; None: open
    devices: tuple[str, ...] = ("cpu",)  # device types of the node's output the bug applies on


KNOWN_MISCOMPILES: tuple[KnownMiscompile, ...] = (
    KnownMiscompile(
        197895, ("aten.div.Tensor_mode", "aten.floor_divide.default"), _floor_division,
        "floating floor division is floor(a / b), one too high where the exact quotient is just "
        "below an integer (1.0 // 0.1 gives 10, eager 9)",
        "repro_upstream_197895_float_floor_division.py", devices=("cpu", "cuda")),  # lowering: div_mode
    KnownMiscompile(
        198057, ("aten.remainder.Tensor", "aten.remainder.Scalar"),
        lambda n: bool(getattr(_dtype(n), "is_floating_point", False)),
        "the vectorized floating remainder is a - floor(a / b) * b: 0 for large quotients "
        "(1e20 % 3 gives 0, eager 2), NaN for an infinite divisor",
        "repro_upstream_198057_float_remainder.py"),
    KnownMiscompile(
        198081, ("aten.any.default", "aten.any.dim", "aten.any.dims"),
        lambda n: _dtype(n.args[0]) == torch.uint8,
        "any() of a uint8 tensor returns bool, not uint8: arithmetic on it no longer wraps",
        "repro_upstream_198081_any_uint8_dtype.py", devices=("cpu", "cuda")),  # lowering: reduce_any
    KnownMiscompile(
        197091, ("aten.ldexp.Tensor",),
        lambda n: _dtype(n.args[0]) != _dtype(n),
        "ldexp's result takes the mantissa's dtype, not the promoted one (fp16 x fp32 gives fp16)",
        "repro_upstream_197091_ldexp_dtype.py", devices=("cpu", "cuda")),  # lowering: ldexp_lowering
    KnownMiscompile(
        191308, ("aten.bmm.default",), lambda n: _narrow_int(_dtype(n)),
        "an integer bmm with a size-1 row decomposes to a sum that returns int64, not the input's dtype",
        "repro_upstream_191308_int_bmm_dtype.py", fixed_in=(2, 15)),
    KnownMiscompile(
        193751, ("aten.argmax.default", "aten.argmin.default"), _flattening_argreduce,
        "argmax / argmin over all dims of a fused producer laid out channels-last returns the "
        "physical, not the logical, index",
        "repro_upstream_193751_argmax_channels_last.py", fixed_in=(2, 15)),
)


def known_miscompiles(gm: torch.fx.GraphModule, version: tuple[int, int] | None = None) -> list[tuple[str, str]]:
    """``(node name, reason)`` for each node of ``gm`` (an ATen graph with ``meta['val']``,
    as AOT Autograd hands it to Inductor) that KNOWN_MISCOMPILES says Inductor computes wrong
    on torch ``version`` (default: this one) and on the device of the node's output. The reason
    names the upstream issue."""
    version = TORCH_VERSION if version is None else version
    live = [e for e in KNOWN_MISCOMPILES if e.fixed_in is None or version < e.fixed_in]
    found = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        for e in live:
            if str(n.target) in e.ops and _device_type(n) in e.devices and e.applies(n):
                until = f"fixed in {e.fixed_in[0]}.{e.fixed_in[1]}" if e.fixed_in else "open"
                found.append((n.name, f"Inductor miscompiles {n.target} on torch {version[0]}.{version[1]}: "
                                      f"{e.what} (pytorch/pytorch#{e.issue}, {until})"))
                break
    return found
