"""torch's compile-time events, as enn emits and reads them.

torch times its compile with ``torch._dynamo.utils.dynamo_timed`` (and ``chromium_event_timed``):
each timed block is a chromium event (start and end, in the TORCH_TRACE log, which tlparse turns
into a perfetto trace) and an entry in ``compilation_time_metrics``. enn's own compile work is
timed the same way (:func:`compile_event`), so it shows among torch's events.

enn reads the events back to say where a graph's compile time went (enn_backend.compile_time):
:class:`EventTape` records, per thread, each event as it ends -- name, start, end, whether it was
the thread's outermost event -- by observing the end events of torch's chromium event logger. The
observer is installed on that logger object (the process's one) only while some enn graph awaits
its breakdown, calls torch's own method first, and records for the threads that asked.

Checked in the 2.13.0 and 2.14.1 sources (the same ``dynamo_timed``, ``ChromiumEventLogger``
and event names) and against the 2.5-era signatures of ``log_event_end(event_name, time_ns,
metadata, start_time_ns, log_pt2_compile_event, compile_id=None)``, unchanged since; the GPU
machine's 2.11 lies between. The names in :data:`EVENT_PHASES` are torch's event names (the
``phase_name`` where one is given, else the key) on those versions; a name torch drops or renames
only makes its time count toward the phase of the event around it.
Covered by tests/test_compile_time.py.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from torch._dynamo import utils as dynamo_utils


@contextlib.contextmanager
def compile_event(name: str) -> Iterator[None]:
    """Time the block as one of torch's compile events named ``name`` (chromium trace, tlparse's
    compile-time view, ``torch._dynamo.utils.compilation_time_metrics``)."""
    with dynamo_utils.dynamo_timed(name, log_pt2_compile_event=True):
        yield


# torch's event name -> the phase (enn_backend.report.CompilePhase value) its own time counts
# toward; an event not named here counts toward the phase of the event around it. Prefixes and
# suffixes: see phase_of_event.
EVENT_PHASES: dict[str, str] = {
    # Dynamo: the frame's trace, guards and bytecode (2.13: "dynamo" wraps "entire_frame_compile")
    "dynamo": "dynamo", "entire_frame_compile": "dynamo", "_compile.compile_inner": "dynamo",
    # AOT Autograd: metadata, the joint trace, the partition, its runtime wrappers, the lazy backward
    "backend_compile": "aot_autograd", "create_aot_dispatcher_function": "aot_autograd",
    "entire_backward_compile": "aot_autograd", "backward._backward_impl": "aot_autograd",
    # enn's own compile work (enn_backend.compile_time.EVENT_*)
    "enn_backend.compile_unit": "enn", "enn_backend.compile_graph": "enn",
    "enn_backend.passes": "enn_passes",
    # Inductor's hooks running enn's passes (named after the hook)
    "pass.joint_graph_passes.joint_custom_pre_pass": "enn_passes",
    "pass.joint_graph_passes.joint_custom_post_pass": "enn_passes",
    "pass.post_grad_passes.post_grad_custom_pre_pass": "enn_passes",
    "pass.post_grad_passes.post_grad_custom_post_pass": "enn_passes",
    # Inductor: its graph passes, lowering, scheduling, code generation
    "inductor_codecache_torch_key": "inductor", "_recursive_pre_grad_passes": "inductor",
    "_recursive_joint_graph_passes": "inductor", "min_cut_rematerialization_partition": "aot_autograd",
    "inductor_compile": "inductor", "compile_fx_inner": "inductor", "fx_codegen_and_compile": "inductor",
    # kernels built: C++ compiles in this process, waits on the compile workers (Triton, C++),
    # loading the generated module
    "compile_file": "kernel_compile", "async_compile.wait": "kernel_compile",
    "async_compile.precompile": "kernel_compile", "PyCodeCache.load_by_key_path": "kernel_compile",
    # the C++ wrapper: its code and its precompiled header (its C++ build: see phase_of_event)
    "CppWrapperCpu.generate": "cpp_wrapper", "CppWrapperGpu.generate": "cpp_wrapper",
    "aoti_precompile_header": "cpp_wrapper",
    # autotuning and benchmarking (templates, fusions, combo kernels, Triton configs)
    "benchmark_fused_nodes": "autotune", "benchmark_codegened_module": "autotune",
    "collective_compute_do_bench": "autotune",
}
_AUTOTUNE_PREFIXES = ("CachingAutotuner.",)
_AUTOTUNE_SUFFIXES = ("_template_autotuning", "_template_precompiling")


def phase_of_event(name: str, parent_phase: str, parent_name: str, cpp_wrapper: bool) -> str:
    """The phase an event's own time counts toward: :data:`EVENT_PHASES`, autotuning by prefix
    and suffix, else the phase of the event around it. A C++ build (``compile_file``) right
    inside the load of a graph's generated module is its C++ wrapper's where the graph was built
    with one (its kernels' builds go through the compile workers' wait)."""
    if name == "compile_file" and cpp_wrapper and parent_name == "PyCodeCache.load_by_key_path":
        return "cpp_wrapper"
    if name in EVENT_PHASES:
        return EVENT_PHASES[name]
    if name.startswith(_AUTOTUNE_PREFIXES) or name.endswith(_AUTOTUNE_SUFFIXES):
        return "autotune"
    return parent_phase


@dataclass(frozen=True)
class Event:
    """One of torch's compile events, ended: name, start and end (``time.time_ns``), and whether
    it was its thread's outermost event."""

    name: str
    start_ns: int
    end_ns: int
    outermost: bool


class EventTape:
    """The compile events that end in the threads that listen, handed to each thread's listener.

    ``listen(fn)`` makes ``fn(event)`` be called in this thread for every event that ends in it,
    until the returned ``stop()``; the observer stays on torch's logger while any thread listens.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: dict[int, Callable[[Event], None]] = {}
        self._logger: Any = None
        self._original: Any = None

    def listen(self, fn: Callable[[Event], None]) -> Callable[[], None]:
        tid = threading.get_ident()
        with self._lock:
            self._listeners[tid] = fn
            if self._logger is None:
                self._install()

        def stop() -> None:
            with self._lock:
                if self._listeners.get(tid) is fn:
                    del self._listeners[tid]
                if not self._listeners and self._logger is not None:
                    self._uninstall()

        return stop

    def _install(self) -> None:
        logger = dynamo_utils.get_chromium_event_logger()
        original = logger.log_event_end  # a bound method (or an observer another tool put there)
        tape = self

        def log_event_end(event_name: str, time_ns: int, metadata: Any, start_time_ns: int,
                          *args: Any, **kwargs: Any) -> Any:
            out = original(event_name, time_ns, metadata, start_time_ns, *args, **kwargs)
            fn = tape._listeners.get(threading.get_ident())
            if fn is not None:
                fn(Event(event_name, int(start_time_ns), int(time_ns), not logger.get_stack()))
            return out

        logger.log_event_end = log_event_end
        self._logger, self._original = logger, original

    def _uninstall(self) -> None:
        if self._logger.__dict__.get("log_event_end") is not None:
            if getattr(self._original, "__self__", None) is self._logger:
                del self._logger.log_event_end  # back to the class's method
            else:
                self._logger.log_event_end = self._original
        self._logger = self._original = None


EVENT_TAPE = EventTape()  # process-wide: the one observer on torch's one chromium event logger
