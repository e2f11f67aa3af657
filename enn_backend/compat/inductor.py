"""Inductor's entry points, config, lowering table and caches, as enn reaches them."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import typing
from typing import Any, Callable, Iterator

import torch
import torch.fx

from torch._inductor import config as inductor_config
from torch._inductor import compile_fx as _compile_fx_module
from torch._inductor.compile_fx import compile_fx_inner  # noqa: F401
from torch._inductor.decomposition import select_decomp_table  # noqa: F401
from torch._dynamo.utils import counters as dynamo_counters
from torch._inductor.fx_passes.post_grad import remove_noop_ops  # noqa: F401
from torch._inductor.pattern_matcher import stable_topological_sort  # noqa: F401
from torch._inductor.utils import BoxedBool

try:  # 2.6+: passes must be CustomGraphPass objects with a uuid() or the FX cache is bypassed
    from torch._inductor.custom_graph_pass import CustomGraphPass
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


def real_inputs_at_hand() -> bool:
    """Whether compile_fx holds the real inputs of the graph being compiled (``V.real_inputs``),
    which the C++ wrapper's kernels are tuned on where Inductor needs them
    (:func:`~enn_backend.compat.versions.cpp_wrapper_tunes_on_real_inputs`). They are at hand
    while compile_fx compiles a forward or inference graph, and in a compile enn runs on a
    graph's first call (:func:`real_inputs`); not in a backward's compile, which AOT Autograd
    runs on fake inputs, nor in the guard's recompiles."""
    from torch._inductor.virtualized import NullHandler, V

    return not isinstance(V.real_inputs, NullHandler)


@contextlib.contextmanager
def real_inputs(args: list) -> Iterator[None]:
    """Hand ``args`` -- a graph's inputs, in its placeholder order -- to the compile of that graph
    as compile_fx hands a forward's (``V.real_inputs``). Inductor prepends the tracing context's
    lifted parameters to them (``params_flat``, the forward's first inputs), which belong to no
    other graph: only for a graph whose context lifts none (:func:`lifts_params`)."""
    from torch._inductor.virtualized import V

    with V.set_real_inputs(args):
        yield


# The values, outside enn's compile_fx call, of the config keys compile_fx changes for a C++
# wrapper (None outside such a call): see cpp_wrapper_config.
_OUTSIDE_CPP_WRAPPER: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "enn_outside_cpp_wrapper_config", default=None)


def _cpp_wrapper_config() -> dict[str, Any]:
    """``get_cpp_wrapper_config()``: what compile_fx patches around a graph with a C++ wrapper
    (kernel binaries kept for the wrapper to load, autotuning at compile time, ...)."""
    with inductor_config.patch({"triton.cudagraphs": False}):  # its only side effect is a log on that
        return _compile_fx_module.get_cpp_wrapper_config()


def compile_fx(gm: torch.fx.GraphModule, example_inputs: Any, *, config_patches: dict | None = None,
               **kwargs: Any) -> Any:
    """torch's compile_fx, for enn's units. It remembers what the keys of the C++ wrapper's
    config hold outside it (with ``config_patches``), so that a graph enn builds with the Python
    wrapper inside a compile_fx that set the C++ wrapper's config gets them back
    (:func:`cpp_wrapper_config`)."""
    patches = dict(config_patches or {})
    outside = {k: patches.get(k, _config_value(k)) for k in _cpp_wrapper_config()}
    token = _OUTSIDE_CPP_WRAPPER.set(outside)
    try:
        return _compile_fx_module.compile_fx(gm, example_inputs, config_patches=config_patches, **kwargs)
    finally:
        _OUTSIDE_CPP_WRAPPER.reset(token)


def _config_value(key: str) -> Any:
    obj: Any = inductor_config
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


@functools.cache
def cpp_wrapper_cannot_call() -> frozenset[Any]:
    """Higher-order ops that Inductor runs as fallback kernels and its C++ wrapper cannot call:
    its fallback codegen asserts an ``OpOverload`` (``cpp_wrapper_cpu.py``; met on torch 2.11,
    the same assert on 2.13). These are the RNG-state wrappers AOT Autograd puts around random
    ops, e.g. a dropout inside an activation-checkpointed region on CUDA
    (``graphsafe_run_with_rng_state``)."""
    from torch._prims import rng_prims

    names = ("run_and_save_rng_state", "run_with_rng_state", "graphsafe_run_with_rng_state", "run_dtensor_rng_op")
    return frozenset(op for op in (getattr(rng_prims, n, None) for n in names) if op is not None)


@contextlib.contextmanager
def cpp_wrapper_config(on: bool) -> Iterator[None]:
    """Inductor's config for a graph built with the C++ wrapper (``on``), or with the Python
    wrapper (not ``on``), whatever compile_fx set around it.

    compile_fx sets the C++ wrapper's config (``get_cpp_wrapper_config``) around every graph of
    a unit it compiles with ``cpp_wrapper``; around a backward, 2.11's compile_fx sets it only
    where ``cpp_wrapper`` was on when AOT Autograd asked, and its compile_fx_inner never does.
    A graph enn builds with the Python wrapper inside such a compile_fx gets the values those keys
    hold outside it (:func:`compile_fx`): built as ``backend="inductor"`` builds it, not with
    kernel binaries and launchers meant for a C++ wrapper."""
    config = _cpp_wrapper_config() if on else _OUTSIDE_CPP_WRAPPER.get()
    if not config:
        yield
        return
    with inductor_config.patch(config):
        yield


# Source text that marks a CPU vector kernel, which needs Inductor's vector ISA flags to build
# (torch 2.13's codecache._VEC_ISA_CPP_SOURCE_MARKERS).
_VEC_ISA_MARKERS = ("at::vec::", "prod_masked_reduce(")


def inductor_probes_vec_isa_only_for_cpu_code() -> bool:
    """Whether Inductor's C++ builds ask for the CPU's vector ISA only where the source holds a
    CPU vector kernel (``codecache._resolve_needs_vec_isa``: torch 2.13 has it, 2.11 does not)."""
    from torch._inductor import codecache

    return hasattr(codecache, "_resolve_needs_vec_isa")


@contextlib.contextmanager
def device_builds_skip_vec_isa_probe() -> Iterator[None]:
    """Inductor's C++ builds of device code (the C++ wrapper of a CUDA graph) without its probe
    of the CPU's vector ISAs, where Inductor still runs that probe for every build.

    The probe (``cpu_vec_isa.valid_vec_isa_list``) compiles a test library per candidate ISA and
    loads each in a new Python process that imports torch; its answer is kept for the process
    only. torch 2.11's ``CppCodeCache.load_async`` asks for it before any C++ build, whatever
    the device: 40-45 s at the first compile of every process on the H100 host, against
    4.5 s for a whole first training step under Inductor's Python wrapper
    (bench/results/gpu-h100/first_compile.log, first_compile_profile.log). The answer only adds
    CPU arch flags and macros to the build, which code without a CPU vector kernel does not read;
    later Inductor asks only where the source holds one (``_resolve_needs_vec_isa``, torch
    2.13), and this applies that rule where Inductor lacks it. The swap of ``pick_vec_isa`` is
    process-wide, so it happens inside a compile, under Dynamo's compile lock: Inductor compiles
    one graph at a time per process. Re-entrant."""
    from torch._inductor import codecache

    current = codecache.CppCodeCache.__dict__.get("load_async")
    if (inductor_probes_vec_isa_only_for_cpu_code() or not hasattr(codecache, "pick_vec_isa")
            or not isinstance(current, classmethod) or getattr(current.__func__, "_enn_skips_probe", False)):
        yield  # Inductor decides itself, or an enclosing block already swapped it
        return
    import inspect

    from torch._inductor.cpu_vec_isa import invalid_vec_isa

    original = current.__func__
    signature = inspect.signature(original)

    def load_async(cls: type, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(cls, *args, **kwargs)
        bound.apply_defaults()
        device = str(bound.arguments.get("device_type", "cpu")).split(":")[0]
        source = "".join(s for s in (bound.arguments.get("main_code"), bound.arguments.get("optimized_code"))
                         if isinstance(s, str))
        if device == "cpu" or any(m in source for m in _VEC_ISA_MARKERS):
            return original(cls, *args, **kwargs)
        pick = codecache.pick_vec_isa
        codecache.pick_vec_isa = lambda: invalid_vec_isa
        try:
            return original(cls, *args, **kwargs)
        finally:
            codecache.pick_vec_isa = pick

    load_async._enn_skips_probe = True  # type: ignore[attr-defined]
    codecache.CppCodeCache.load_async = classmethod(load_async)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        codecache.CppCodeCache.load_async = current  # type: ignore[method-assign]


def lifts_params(tracing_ctx: Any) -> bool:
    """Whether AOT Autograd lifted module parameters into the tracing context (``params_flat``:
    Dynamo without ``inline_inbuilt_nn_modules``), which Inductor takes for a forward's first
    real inputs."""
    return bool(getattr(tracing_ctx, "params_flat", None))


def inductor_compile_fx(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
    """Inductor's own compile_fx (the exact path of ``backend="inductor"``)."""
    return _compile_fx_module.compile_fx(gm, example_inputs, **kwargs)


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


# --- Inductor IR builders for enn's lowerings (lowerings/precision.py) -------------------
# torch._inductor.lowering.lowerings is a private dict of op -> IR builder, unchanged
# from 2.0 through 2.13. enn composes these builders; it never writes to the dict here.


def inductor_lowering(op: Any) -> Callable[..., Any]:
    """Inductor's own lowering (IR builder) of an ATen/prims op."""
    from torch._inductor import lowering as L

    return L.lowerings[op]


def lowering_graph() -> Any:
    """The graph Inductor is lowering now (``V.graph``, a ``GraphLowering``): the scope of
    whatever a lowering shares between the ops of one graph."""
    from torch._inductor.virtualized import V

    return V.graph


def ir_elements(x: Any) -> Any:
    """The buffer (or storage box) whose elements the Inductor IR value ``x`` holds, each exactly
    once, or None: ``x`` reaches it through reshapes, permutations and reinterpretations that
    are permutations of a dense layout only (no slice, expand or offset), with static sizes. Any
    two such values over one storage hold the same multiset of elements (the same amax)."""
    from torch._inductor import ir

    node = x
    while not isinstance(node, (ir.StorageBox, ir.Buffer)):
        if isinstance(node, ir.ReinterpretView) and not _dense_permutation(node.layout):
            return None
        if not (isinstance(node, (ir.TensorBox, ir.PermuteView, ir.ReinterpretView)) or type(node) is ir.View):
            return None
        node = node.data
    numel = _static(x.get_numel())
    return node if numel is not None and numel == _static(node.get_numel()) else None


def _static(expr: Any) -> int | None:
    """A size or stride of the IR as an int, None where it is symbolic."""
    try:
        return int(expr)
    except TypeError:
        return None


def _dense_permutation(layout: Any) -> bool:
    """Whether an IR ``layout`` (sizes, strides, offset) is a dense layout's dimensions in some order."""
    dims = [(_static(size), _static(stride)) for size, stride in zip(layout.size, layout.stride)]
    if _static(layout.offset) != 0 or any(size is None or stride is None for size, stride in dims):
        return False
    expected = 1
    for size, stride in sorted(dims, key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


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


def without_cudagraphs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``compile_fx_inner``'s kwargs for a compile that must not be wrapped in CUDA graphs. Its
    ``cudagraphs`` box is shared by every graph of one ``compile_fx`` call (Inductor sets it to
    False to turn CUDA graphs off for them all), so it is replaced, never set."""
    return dict(kwargs, cudagraphs=BoxedBool(False))


def inductor_cache_dir() -> str:
    """Inductor's cache folder (``TORCHINDUCTOR_CACHE_DIR`` or its default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()
