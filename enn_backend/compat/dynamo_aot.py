"""Dynamo's and AOT Autograd's internals enn relies on: the captured graph's copy, AOT Autograd's
config (its cache, donated buffers, lazy backward), AOTAutograd cache hits, the tracing context,
the compile lock, Dynamo's control-flow exceptions, and Dynamo's driver for split graphs."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.fx

from torch._functorch import config as functorch_config
from torch._guards import TracingContext, tracing

from .tracing import fake_mode_of


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
    references before the call), so the cost is buffer reuse only, not a longer lifetime; but
    that can be one large buffer at the backward's peak: where the loss is computed inside the
    graph, the saved logits' memory is not reused for their gradient (HF BERT's masked-LM loss
    from ``labels=``, H200: 1620 MiB at the peak against Inductor's 1130).
    Covered by tests/test_guard_reference.py::test_backward_rerun_reads_the_inputs_it_was_given.
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
    from torch._functorch._aot_autograd.aot_autograd_result import GenericAOTAutogradResult as _AOTResult
    from torch._functorch._aot_autograd.autograd_cache import FXGraphCacheMiss
    from torch._functorch._aot_autograd.autograd_cache import should_bundle_autograd_cache

    _AOT_WRAP = _AOTResult.__dict__.get("wrap_post_compile")
except ImportError:  # pragma: no cover - a torch without it (older, or moved)
    _AOTResult, _AOT_WRAP = None, None

    class FXGraphCacheMiss(Exception):  # type: ignore[no-redef]
        pass

    def should_bundle_autograd_cache() -> bool:  # type: ignore[misc]
        return True

# Process-wide: the handlers of the enn compiles in progress, innermost last; pushed and popped
# under Dynamo's compile lock, which every compile holds.
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


def forward_results(ctx: Any) -> int | None:
    """How many leading outputs of the training forward graph compiled under ``ctx`` are results
    its caller receives (the inputs it writes, the user's outputs, their bases); the outputs
    after them are saved for the backward. None where AOT Autograd's metadata does not say
    (torch 2.11 – 2.15: ``ViewAndMutationMeta.num_forward_returns``)."""
    n = getattr(getattr(ctx, "fw_metadata", None), "num_forward_returns", None)
    return n if isinstance(n, int) else None


def aot_metadata(ctx: Any) -> Any:
    """AOT Autograd's view-and-mutation metadata of the unit just compiled under ``ctx`` (the
    tracing context: ``fw_metadata``), or None."""
    return getattr(ctx, "fw_metadata", None)


def mutated_flat_inputs(metadata: Any, n_flat: int) -> list[int] | None:
    """Indices of AOT Autograd's flat inputs -- the module's parameters and buffers (as
    ``named_parameters`` / ``named_buffers`` list them, duplicates kept), then the graph's inputs
    -- that the compiled unit writes into: data, metadata or storage. From functionalization, not
    op schemas: it sees a BatchNorm's running statistics, foreach updates, writes through views.
    ``metadata``: a ``ViewAndMutationMeta`` (its ``input_info``, 2.11 - 2.15). None where it is
    missing or lists another number of inputs (AOT Autograd deduplicated them, or made a
    synthetic base): the caller must then assume any input may be written."""
    info = getattr(metadata, "input_info", None)
    if info is None or len(info) != n_flat:
        return None
    return [i for i, a in enumerate(info)
            if a.mutates_data or a.mutates_metadata or getattr(a, "mutation_inductor_storage_resize", False)]


def is_aot_backward_node(node: Any) -> bool:
    """Is ``node`` (an autograd graph node) the backward of a call of AOT Autograd's compiled
    function? Its ``torch.autograd.Function`` is ``CompiledFunction`` (``_aot_autograd/
    runtime_wrappers.py``, 2.11 - 2.15), so its node is named ``CompiledFunctionBackward``."""
    return type(node).__name__ == "CompiledFunctionBackward"


@contextlib.contextmanager
def tracing_context(ctx: Any) -> Iterator[None]:
    """Re-enter the tracing context a graph was first compiled under (for recompiles)."""
    if ctx is None:
        yield
        return
    with tracing(ctx):
        yield


def is_dynamo_control_flow(exc: BaseException) -> bool:
    """Exceptions Dynamo uses to steer compilation (restart analysis, skip frame, graph
    break, user error). They must reach Dynamo untouched: they are not compile failures.
    Seen on 2.13: dynamic shapes raise TensorifyScalarRestartAnalysis from inside AOT."""
    from torch._dynamo import exc as dexc

    if not isinstance(exc, dexc.TorchDynamoException):
        return False
    return not isinstance(exc, (dexc.BackendCompilerFailed, dexc.InternalTorchDynamoError, dexc.TorchRuntimeError))


# Whether AOT Autograd saves a cache entry only for compiled graphs whose FX graph key is set
# (2.13+: ``_should_save_cache`` tests ``is not None``); before, it tests ``hasattr`` and then
# asserts the key is not None -- and Inductor's compiled graphs carry the attribute as a
# dataclass field, so a graph enn must keep out of the cache is handed over wrapped instead.
try:
    from torch._functorch._aot_autograd.graph_compile import _should_save_cache as _SAVE_CHECK
except ImportError:
    _SAVE_CHECK = None


def keep_out_of_aot_cache(compiled: Any) -> Any:
    """``compiled`` (a boxed compiled graph) such that AOT Autograd saves no cache entry for it."""
    if _SAVE_CHECK is not None:
        compiled._fx_graph_cache_key = None
        return compiled

    def uncached(args: list) -> Any:
        return compiled(args)

    uncached._boxed_call = True  # type: ignore[attr-defined]
    return uncached


def compile_split(gm: torch.fx.GraphModule, partition_of: Callable[[torch.fx.Node], int], example_inputs: list,
                  compile_fn: Callable[[torch.fx.GraphModule, list], Callable[..., Any]],
                  reuse_fn: Callable[[torch.fx.GraphModule, list], tuple[Callable[..., Any], Any] | None] | None = None,
                  ) -> torch.fx.GraphModule:
    """``gm`` cut into submodules by ``partition_of`` (torch.fx's ``split_module``, nodes kept in
    order), each compiled by ``compile_fn(submodule, example_inputs)`` through Dynamo's driver for
    split graphs (``SubmodCompiler``, DDPOptimizer's: each submodule's inputs are fake tensors
    with the strides the previous compiled submodule really returns; AOT Autograd's metadata is
    kept per submodule for the lazy backward compiles); the split graph module calling them.
    Each submodule keeps Dynamo's metadata (``_dynamo_source`` of its placeholders, ``gm.meta``),
    so AOT Autograd still knows the parameters and buffers among its inputs.

    ``reuse_fn(submodule, fake_inputs)``, asked first for each submodule, may return a callable
    compiled for an earlier submodule, which then runs this one (it takes the submodule's inputs
    and returns its outputs as a tuple, as ``compile_fn``'s callables do), and the fake outputs
    it returns for these inputs, which the next submodules are compiled for. Such a submodule
    is not traced, and its backward is the earlier one's: AOT Autograd compiles each backward
    lazily, on its first call, taking the forward's metadata from a stack that holds one entry
    per traced submodule, in the order the backward calls reach them -- the reverse of the
    forward's order of each callable's last use (which is the forward's order where no callable
    is reused, as DDPOptimizer has it)."""
    from torch._dynamo.backends.distributed import SubmodCompiler, propagate_dynamo_source, propagate_metadata
    from torch._dynamo.utils import _disable_saved_tensors_hooks_during_tracing, to_fake_tensor
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.passes.split_module import split_module

    class Reusing(SubmodCompiler):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.calls: list[int] = []  # per submodule in forward order: id of the callable that runs it
            self.metadata: dict[int, Any] = {}  # id of a traced submodule's callable -> its forward's metadata

        def run_node(self, n: torch.fx.Node) -> Any:
            if n.op != "call_module":
                return super().run_node(n)
            args, _ = self.fetch_args_kwargs_from_env(n)
            fake = [to_fake_tensor(a, self.fake_mode) if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor)
                    else a for a in args]
            sub = self.fetch_attr(str(n.target))
            hit = reuse_fn(sub, fake) if reuse_fn is not None else None
            if hit is not None:
                fn, out = hit
                single = not isinstance(sub.graph.find_nodes(op="output")[0].args[0], tuple)
                self.module.delete_submodule(n.target)
                n.target = "compiled_" + str(n.target)
                self.module.add_submodule(n.target, _TakeOutputs(fn, single))
                self.calls.append(id(fn))
                return out[0] if single else out
            ctx = TracingContext.try_get()
            ddp = getattr(ctx, "ddp_optimizer_ctx", None)
            traced = len(ddp.metadata_per_bucket) if ddp is not None else 0
            out = super().run_node(n)
            fn = self.module.get_submodule(str(n.target)).submod
            self.calls.append(id(fn))
            if ddp is not None and len(ddp.metadata_per_bucket) > traced:
                self.metadata[id(fn)] = ddp.metadata_per_bucket[-1]
            return out

    split = split_module(gm, None, partition_of, keep_original_order=True)
    propagate_dynamo_source(gm, split)
    propagate_metadata(gm, split)
    driver = Reusing(split, compile_fn, fake_mode_of(example_inputs))
    with _disable_saved_tensors_hooks_during_tracing():
        driver.run(*example_inputs)
    ddp = getattr(TracingContext.try_get(), "ddp_optimizer_ctx", None)
    if ddp is not None and len(set(driver.calls)) < len(driver.calls):
        backward_order: list[int] = []  # each traced callable at its last use in the forward, last first
        for c in reversed(driver.calls):
            if c in driver.metadata and c not in backward_order:
                backward_order.append(c)
        ddp.metadata_per_bucket = [driver.metadata[c] for c in reversed(backward_order)]
        ddp.curr_bucket = len(ddp.metadata_per_bucket) - 1
    split.recompile()
    return split


class _TakeOutputs(torch.nn.Module):
    """A reused callable in the split graph: its outputs as the submodule returns them (Dynamo's
    driver wraps its own compiled submodules alike: a single output is not a tuple)."""

    def __init__(self, fn: Callable[..., Any], single: bool) -> None:
        super().__init__()
        self.submod, self.single = fn, single

    def forward(self, *args: Any) -> Any:
        out = self.submod(*args)
        return out[0] if self.single and isinstance(out, (tuple, list)) else out


def dynamo_compile_id(gm: torch.fx.GraphModule) -> tuple[int, int] | None:
    """(frame id, compiles of that frame before this one) of a graph Dynamo captured -- ``[0/3]``
    in Dynamo's logs is (0, 3) -- or None where torch does not say. ``gm.meta["dynamo_compile_id"]``
    (a ``torch._guards.CompileId``) on the supported versions; the compile context as a fallback."""
    cid = gm.meta.get("dynamo_compile_id")
    if cid is None:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
    frame, nth = getattr(cid, "frame_id", None), getattr(cid, "frame_compile_id", None)
    return None if frame is None or nth is None else (int(frame), int(nth))


def dynamo_compile_context() -> Any:
    """The compile Dynamo is running now (a ``torch._guards.CompileContext``: one per compile of a
    frame, shared by every graph that compile hands to the backend), or None outside one."""
    from torch._guards import CompileContext

    try_get = getattr(CompileContext, "try_get", None)
    return try_get() if try_get is not None else None


def dynamo_source_name(node: torch.fx.Node) -> str | None:
    """Where Dynamo took a placeholder's value from, as its guards name it (``L['kwargs']['input_ids']``)."""
    src = getattr(node, "_dynamo_source", None)
    if src is None:
        return None
    name = src.name  # a method up to torch 2.14, a property in later versions
    return str(name() if callable(name) else name)


def recompile_limit() -> int:
    """Dynamo's limit on compiles of one frame, past which it runs the frame eagerly for new guards
    (``recompile_limit``; ``cache_size_limit`` in older versions)."""
    cfg = torch._dynamo.config
    limit = getattr(cfg, "recompile_limit", None)
    return int(limit if limit is not None else cfg.cache_size_limit)
