"""The value check's second reference: the graph Dynamo handed to enn, run as torch runs it.

The guard's first reference, enn's eager copy of a graph, is the ATen graph AOT Autograd traced
with the decompositions applied. Where a decomposition is wrong (pytorch/pytorch#185464, #186799),
the compiled code and the eager copy agree on the wrong value and the per-graph value check sees
nothing. So on the calls the value check samples -- a unit's first call, then every
``guard_values``-th (under ``guard="values"`` also every call of the warm-up and every
``guard_every``-th) -- :class:`DynamoReference` compares what the whole compiled unit returned
(after the per-graph guard's own checks) with the Dynamo graph run eagerly on the same inputs:
torch's ops, no decompositions. It compares the outputs and what the unit writes (inputs written
in place, module buffers, a compiled optimizer's parameters and state), with the value check's
rules (guard/screen.py); and where the call records a backward, the gradients the compiled
backward gives its inputs with those of the Dynamo graph run through autograd on the same inputs
and the same cotangents (its forward run with autograd on the sampled call, kept until that
backward has run).

**What the reference writes.** The Dynamo graph runs on copies of everything the unit writes,
taken before the compiled call: the compiled call writes the caller's tensors once, and the
reference never does. Nor does it show the caller's saved-tensor hooks what its autograd run
saves: those hooks see the step's own saved tensors, as with the guard off. What the unit
writes comes from AOT Autograd's mutation metadata (functionalization: a BatchNorm's running
statistics, foreach updates, writes through views), never from op schemas alone. Where that
metadata is missing, every tensor input and module attribute is copied (counted as
``guard.dynamo_reference_copies_all``); where the copies do not fit in memory, the reference is
switched off for the unit (logged, counted).

A disagreement is judged by an fp64 run of the Dynamo graph (``screen.compiled_is_worse``):

- the compiled result is further from fp64 than the Dynamo graph's: the graph AOT Autograd traced
  is at fault. A ``dynamo_graph`` fallback (reported, logged; ``guard="strict"`` raises); in the
  forward the call returns the Dynamo graph's result -- run again, with autograd, on the caller's
  inputs, restored first, so that its writes land once and its gradients are the Dynamo graph's --
  in the backward the Dynamo graph's gradients replace the compiled ones; the unit runs the
  Dynamo graph eagerly from then on;
- otherwise nobody is blamed (the Dynamo graph is the outlier, or no fp64 run exists): counted in
  the report (``guard.dynamo_reference_outlier``), compiled result kept.

Not compared: a unit holding FP8 GEMMs (option ``fp8``: the fp8 pass rewrote a GEMM of it into
``enn::fp8_mm``; logged once, counted as ``guard.dynamo_reference_off``). Its Dynamo graph computes
those GEMMs un-quantized, so FP8's own rounding would read as a fault there. The per-graph value
check covers such a unit: its reference runs each FP8 GEMM as FP8 emulated (``custom_ops.fp8``).
Nor a unit whose own code computes in FP8 (casts to an FP8 dtype, ``torch._scaled_mm``: torchao's
``Float8Linear``, hand-written FP8): compiled code may compute a scale one rounding away from
eager's and so round some values to the neighbouring FP8 value (an FP8 step is 6-12% of a
value), a difference no fault made, and its fp64 run cannot judge it (``_scaled_mm`` takes fp32
scales only). Logged once, counted as ``guard.dynamo_reference_off``; the per-graph value check
still compares the unit's kernels with enn's eager copy.
Nor a unit that draws random numbers (the RNG moves during its compiled call; random
draws differ by design), nor one whose Dynamo graph cannot run eagerly (logged once, counted as
``guard.dynamo_reference_off``). A backward is compared where AOT Autograd's backward node is
found among the outputs' autograd history (counted as ``guard.dynamo_backward_checks``).

Cost: on a sampled call, copies of what the unit writes, one eager run of the Dynamo graph
(with autograd when the call records a backward, whose activations live until the backward) and,
in the backward, one eager backward; an fp64 run only when the two disagree. Unsampled calls add
a counter and a comparison. On a GPU the run with autograd happens only where twice what the
compiled call holds (its outputs and saved activations) is free on the device; elsewhere that
call's backward is not compared, its forward is (logged once per unit, counted as
``guard.dynamo_backward_no_room``): a check must not run out of memory a step that fits without it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

from .. import compat
from ..fx_utils import LOW_PRECISION, inline_subgraph_calls, retarget_dtypes
from ..report import Count, FallbackKind, report
from .calls import LADDER, EnnGuardError, RngSnapshot, distributed, flat_args
from .screen import compiled_is_worse, diverging, outputs

log = logging.getLogger(__name__)


# The Dynamo graph's run with autograd holds its activations until the backward, beside the compiled
# call's: it runs only where this many times what the compiled call holds is free (module doc).
REFERENCE_MEMORY_MARGIN = 2.0


def _memory_device(flat: list) -> torch.device | None:
    """The CUDA device of a call's tensors, whose memory the reference's autograd run must fit in
    (None on the CPU: host memory is not budgeted)."""
    return next((x.device for x in flat if isinstance(x, torch.Tensor) and x.is_cuda), None)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device)


def _free(device: torch.device) -> int:
    """Bytes a new allocation on ``device`` can take: free in the driver, and held by the caching
    allocator but unused."""
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


@contextlib.contextmanager
def _own_saved_tensors() -> Iterator[None]:
    """The reference's autograd run keeps the tensors its backward needs itself: the caller's
    saved-tensor hooks (``torch.autograd.graph.save_on_cpu``, activation offloading, a memory
    counter) are for the step they wrap, and must see what it saves, not a second run of it made
    by the guard. Where torch forbids entering hooks (a transform that disables them), the run
    goes as it is."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_same, _same))
        except RuntimeError:
            pass
        yield


def fp64_dynamo_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """Copy of a Dynamo graph that computes in fp64 what it computed in a narrower float dtype
    (its callers cast its floating inputs up): dtype arguments and ``.float()``-style casts are
    retargeted; autocast regions are left as they are (autocast never casts fp64 tensors)."""
    new = compat.copy_dynamo_graph(gm)
    narrower = (torch.float16, torch.bfloat16, torch.float32)
    for n in new.graph.nodes:
        if n.op not in ("call_function", "call_method") or "autocast" in str(n.target):
            continue
        retarget_dtypes(n, narrower, torch.float64)
        if n.op == "call_method" and n.target in ("half", "bfloat16", "float"):
            n.target = "double"
    new.recompile()
    return new


def _low_precision(gm: fx.GraphModule) -> bool:
    """Does the Dynamo graph compute in fp16/bf16 anywhere (its values, or an autocast region)?"""
    for n in gm.graph.nodes:
        val = n.meta.get("example_value")
        if (isinstance(val, torch.Tensor) and val.dtype in LOW_PRECISION) or "autocast" in str(n.target):
            return True
    return False


FP8_DTYPES = frozenset(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                          "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, name))
SCALED_MM = frozenset(op for op in (getattr(torch, "_scaled_mm", None), torch.ops.aten._scaled_mm.default,
                                    torch.ops.aten._scaled_mm) if op is not None)


def _computes_in_fp8(gm: fx.GraphModule) -> bool:
    """Does the Dynamo graph compute in FP8 itself (a value of an FP8 dtype, or a scaled GEMM)?"""
    for n in gm.graph.nodes:
        val = n.meta.get("example_value")
        if (isinstance(val, torch.Tensor) and val.dtype in FP8_DTYPES) or (
                n.op == "call_function" and n.target in SCALED_MM):
            return True
    return False


def _floats(a: Any, b: Any) -> bool:
    return all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in (a, b))


def _module_state(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """The graph module's parameters, then its buffers, by name, duplicates kept: the order of
    AOT Autograd's flat inputs (a compiled optimizer's parameters and state live here)."""
    return {**dict(gm.named_parameters(remove_duplicate=False)), **dict(gm.named_buffers(remove_duplicate=False))}


class Writes:
    """What a unit writes: graph inputs by index, module attributes by name. ``inputs`` None:
    not known, every tensor input is taken as written."""

    __slots__ = ("inputs", "attrs")

    def __init__(self, inputs: list[int] | None, attrs: list[str]) -> None:
        self.inputs, self.attrs = inputs, attrs

    @classmethod
    def of(cls, gm: fx.GraphModule, state: dict[str, torch.Tensor], metadata: Any) -> "Writes":
        names = list(state)
        n_in = len(gm.graph.find_nodes(op="placeholder"))
        flat = compat.mutated_flat_inputs(metadata, len(names) + n_in)
        if flat is None:
            return cls(None, names)
        return cls([i - len(names) for i in flat if i >= len(names)], [names[i] for i in flat if i < len(names)])

    def input_indices(self, flat: list) -> list[int]:
        if self.inputs is not None:
            return self.inputs
        return [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]


class Before:
    """Copies, taken before a compiled call, of what the unit may write."""

    __slots__ = ("inputs", "attrs")

    def __init__(self, flat: list, state: dict[str, torch.Tensor], writes: Writes) -> None:
        with torch.no_grad():
            self.inputs = {i: flat[i].clone() for i in writes.input_indices(flat)}
            self.attrs = {n: state[n].clone() for n in writes.attrs}

    def restore(self, flat: list, state: dict[str, torch.Tensor]) -> None:
        """Put the copies back into the caller's tensors."""
        with torch.no_grad():
            for i, saved in self.inputs.items():
                flat[i].copy_(saved)
            for n, saved in self.attrs.items():
                state[n].copy_(saved)


def _keep(store: dict[int, torch.Tensor], j: int, grad: torch.Tensor | None) -> None:
    # an output the loss does not reach (the logits beside a loss computed from labels=) gets
    # no gradient: its hook is called with None, and it has no cotangent
    if grad is not None:
        store[j] = grad


def _backward_node(outs: list) -> Any:
    """AOT Autograd's backward node of a compiled call, from its outputs' autograd history (an
    output may be a view AOT Autograd regenerated: its node leads there)."""
    seen, todo = set(), [o.grad_fn for o in outs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    for _ in range(64):
        if not todo:
            return None
        node = todo.pop(0)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if compat.is_aot_backward_node(node):
            return node
        todo += [n for n, _ in node.next_functions if n is not None][:4]
    return None


def _gradient_targets(node: Any, flat: list, state: dict[str, torch.Tensor]) -> list[tuple[int, Any]]:
    """(position among the backward node's gradients, ``("input", i)`` or ``("attr", name)``) for
    each tensor of the unit that position's gradient goes to."""
    leaves = {id(x): ("input", i) for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.grad_fn is None}
    leaves.update({id(t): ("attr", n) for n, t in state.items() if id(t) not in leaves})
    inner = {(id(x.grad_fn), x.output_nr): ("input", i) for i, x in enumerate(flat)
             if isinstance(x, torch.Tensor) and x.grad_fn is not None}
    found = []
    for k, (fn, nr) in enumerate(node.next_functions):
        if fn is None:
            continue
        variable = getattr(fn, "variable", None)
        key = leaves.get(id(variable)) if variable is not None else inner.get((id(fn), nr))
        if key is not None:
            found.append((k, key))
    return found


class DynamoReference:
    """Wraps one unit's compiled callable, called as Dynamo calls it (boxed or not: calls.flat_args)."""

    wraps_unit = True  # a wrapper around a unit's compiled callable (``.compiled``): see blocks.Segment

    def __init__(self, compiled: Callable[..., Any], gm: fx.GraphModule, opts: Any, unit: str,
                 metadata: Any = None) -> None:
        # the reference runs eagerly, with autograd: nested compile regions inlined (fx_utils)
        self.compiled, self.gm, self.opts, self.unit = compiled, inline_subgraph_calls(gm), opts, unit
        self.calls = 0
        self.state = _module_state(gm)
        self.writes = Writes.of(gm, self.state, metadata)  # what the unit writes (AOT Autograd's metadata)
        self.on = True  # off for a unit that draws random numbers or whose reference cannot run
        self.eager = False  # after a fault: the unit runs the Dynamo graph
        self.low_precision = _low_precision(gm)
        self.values_every = opts.guard_values
        self.every_value = opts.guard.checks_every_value
        # the first call that is not a bare call of the compiled unit (a sampled one, or every
        # call once the unit runs eagerly); the calls before it cost one comparison
        self.due = 1
        self.unjudged_said = False  # a backward that could not be compared: warned once per unit
        self.no_room_said = False  # a backward reference skipped for want of device memory: logged once per unit

    @classmethod
    def wrap(cls, compiled: Callable[..., Any], gm: fx.GraphModule, opts: Any, unit: str,
             metadata: Any = None) -> Callable[..., Any]:
        """``compiled`` behind this check where the guard compares values at all (not under
        torch.distributed, where ranks must run the same graphs: asked on each sampled call).
        ``metadata``: AOT Autograd's view-and-mutation metadata of the unit (what it writes)."""
        checks = opts.guard.checks_outputs and (opts.guard_values > 0 or opts.guard.checks_every_value)
        if checks and report().unit_fusions(unit, "fp8"):
            report().count(Count.DYNAMO_REFERENCE_OFF)
            log.info("enn: unit %s: no Dynamo-graph reference: it holds FP8 GEMMs (option fp8), which its Dynamo "
                     "graph computes un-quantized; its per-graph value checks compare them with FP8 emulated", unit)
            return compiled
        if checks and _computes_in_fp8(gm):
            report().count(Count.DYNAMO_REFERENCE_OFF)
            log.info("enn: unit %s: no Dynamo-graph reference: its code computes in FP8 (FP8 casts or "
                     "torch._scaled_mm), where compiled and eager quantization may round values to neighbouring "
                     "FP8 values without a fault; its per-graph value checks still run", unit)
            return compiled
        return cls(compiled, gm, opts, unit, metadata) if checks else compiled

    def _sampled(self) -> bool:
        n, every = self.calls, self.values_every
        return n == 1 or (every > 0 and n % every == 0) or (
            self.every_value and (n <= self.opts.guard_warmup or n % self.opts.guard_every == 0))

    def _next_due(self) -> int:
        """The next sampled call after this one (see _sampled)."""
        n, every = self.calls, self.values_every
        if not self.on:
            return sys.maxsize
        if self.eager:
            return n + 1
        due = n + every - n % every if every > 0 else sys.maxsize
        if self.every_value:
            if n < self.opts.guard_warmup:
                return n + 1
            due = min(due, n + self.opts.guard_every - n % self.opts.guard_every)
        return due

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls < self.due:
            return self.compiled(*args)
        return self._due_call(args)

    def _due_call(self, args: tuple) -> Any:
        if self.eager:
            flat, boxed = flat_args(args)
            out = self.gm(*flat)
            if boxed:
                flat.clear()  # the boxed convention: the callee owns (and frees) the argument list
            return out
        sampled = self.on and self._sampled()
        self.due = self._next_due()  # _off and _fault set it again
        if not sampled or distributed():  # off there, as the guard's value checks
            return self.compiled(*args)
        return self._check(args, list(flat_args(args)[0]))

    def _off(self, why: str) -> None:
        self.on = False
        self.due = sys.maxsize
        report().count(Count.DYNAMO_REFERENCE_OFF)
        log.info("enn: unit %s: no Dynamo-graph reference from now on: %s", self.unit, why)

    def _run(self, flat: list, before: Before, fp64: bool = False,
             keep: dict[str, Any] | None = None) -> tuple[list, BaseException | None]:
        """The Dynamo graph on the call's inputs as they were before it (fresh copies of ``before``
        for what the unit writes); its outputs followed by what it wrote. Without autograd, unless
        ``keep`` is given: then with autograd on leaves that require grad where the caller's
        tensors do, which it keeps (``inputs``, ``params``) for the backward's reference."""
        grad = keep is not None
        inputs, params = self._inputs(flat, before, fp64, grad)
        try:
            with torch.set_grad_enabled(grad):
                out = list(outputs(self._call(fp64_dynamo_graph(self.gm) if fp64 else self.gm, inputs, params)))
        except Exception as exc:  # noqa: BLE001 - a reference that cannot run judges nothing
            return [], exc
        if keep is not None:
            keep.update(inputs=inputs, params=params, outputs=out)
        return out + [inputs[i] for i in before.inputs] + [params[n] for n in before.attrs], None

    def _inputs(self, flat: list, before: Before, fp64: bool = False,
                grad: bool = False) -> tuple[list, dict[str, torch.Tensor]]:
        """Inputs and module attributes for one run of the Dynamo graph: copies of ``before`` for
        what the unit writes, the caller's tensors for the rest (detached, in fp64 with ``fp64``;
        with ``grad``, leaves that require grad where the caller's did)."""
        def prepare(x: Any, saved: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            t = (saved.clone() if saved is not None else x).detach()
            if fp64 and t.is_floating_point():
                t = t.double()
            return t.requires_grad_(x.requires_grad) if grad and t.is_floating_point() else t

        inputs = [prepare(x, before.inputs.get(i)) for i, x in enumerate(flat)]
        names = self.state if (fp64 or grad) else before.attrs
        params = {n: prepare(self.state[n], before.attrs.get(n)) for n in names}
        return inputs, params

    @staticmethod
    def _call(gm: fx.GraphModule, inputs: list, params: dict[str, torch.Tensor]) -> Any:
        """``gm`` on ``inputs``, its module attributes named in ``params`` replaced by those, its
        saved tensors out of the caller's hooks (:func:`_own_saved_tensors`)."""
        with _own_saved_tensors():
            if not params:
                return gm(*inputs)
            return torch.func.functional_call(gm, params, tuple(inputs), strict=False)

    def _check(self, args: tuple, flat: list) -> Any:
        rng = RngSnapshot()
        if self.writes.inputs is None:
            report().count(Count.DYNAMO_REFERENCE_COPIES_ALL)
        try:
            before = Before(flat, self.state, self.writes)
        except torch.OutOfMemoryError:
            self._off("no memory for copies of what the unit writes")
            return self.compiled(*args)
        device = _memory_device(flat)
        held = _allocated(device) if device is not None else 0
        out = self.compiled(*args)
        if rng.moved():
            self._off("it draws random numbers, which differ from eager's by design")
            return out
        # where the call records a backward, the reference runs with autograd: the backward's
        # reference differentiates that same run (guard.dynamo_backward_checks), if it fits
        backward = self._backward_of(flat, out)
        if backward and device is not None and not self._room(device, _allocated(device) - held):
            backward = None
        kept: dict[str, Any] = {}
        ref, exc = self._run(flat, before, keep=kept) if backward else ([], None)
        if backward and exc is not None:
            log.info("enn: unit %s: no backward reference (its Dynamo graph raised with autograd: %s: %s)",
                     self.unit, type(exc).__name__, exc)
            backward = None
        if not backward:
            ref, exc = self._run(flat, before)
        ref = [r.detach() if isinstance(r, torch.Tensor) else r for r in ref]
        got = self._results(out, flat, before)
        if exc is not None or len(ref) != len(got):
            self._off(f"its Dynamo graph raised when run eagerly ({type(exc).__name__}: {exc})" if exc is not None
                      else f"it returns {len(got)} results, its Dynamo graph {len(ref)}")
            return out
        off, wrong = self._judge(got, ref, lambda: self._run(flat, before, fp64=True))
        if wrong:
            return self._fault(flat, before, off, len(outputs(out)))
        if backward:
            self._watch_backward(backward, flat, before, out, kept)
        return out

    def _room(self, device: torch.device, held: int) -> bool:
        """Whether the Dynamo graph's run with autograd fits on ``device`` beside the compiled call,
        which holds ``held`` bytes (its outputs and saved activations) until its backward: the
        reference holds its own until then, eager's usually more than compiled code's (nothing
        fused, nothing recomputed), hence :data:`REFERENCE_MEMORY_MARGIN` times as much. If it
        does not fit, this call's backward is not compared (its forward still is): a check must
        not run a step out of memory that fits without it."""
        need, free = REFERENCE_MEMORY_MARGIN * held, _free(device)
        if free >= need:
            return True
        report().count(Count.DYNAMO_BACKWARD_NO_ROOM)
        if not self.no_room_said:
            self.no_room_said = True
            log.warning("enn: unit %s: a backward not compared with the Dynamo graph's gradients: the reference's "
                        "autograd run would need about %.2f GiB of %s beside the compiled step's %.2f GiB, %.2f GiB "
                        "are free; its forward is compared (counted as guard.dynamo_backward_no_room)",
                        self.unit, need / 2**30, device, held / 2**30, free / 2**30)
        return False

    def _results(self, out: Any, flat: list, before: Before) -> list:
        """What the compiled call produced: its outputs, then what it wrote, as it left them."""
        return list(outputs(out)) + [flat[i] for i in before.inputs] + [self.state[n] for n in before.attrs]

    def _judge(self, got: list, ref: list, fp64: Callable[[], tuple[list, BaseException | None]]) -> tuple[list[int], bool]:
        """The results off the reference's, and whether the compiled ones are wrong (an fp64 run,
        made only for a disagreement, sides with the reference)."""
        # enn's precision passes may return a float result wider than the model's (fp32_tail's fp32
        # logits): dtypes are the eager copy's to judge (the guard's value check); this reference
        # judges values, in the compiled result's dtype
        ref = [r.to(g.dtype) if _floats(g, r) and g.dtype != r.dtype else r for g, r in zip(got, ref)]
        with torch.no_grad():
            off = diverging(got, ref, self.low_precision)
            if not off:
                return off, False
            ref64, exc = fp64()
            if exc is not None or len(ref64) != len(ref):
                log.info("enn: unit %s: no fp64 run of the Dynamo graph to judge a value difference (%s); nobody "
                         "blamed", self.unit, f"{type(exc).__name__}: {exc}" if exc is not None else "other results")
                wrong = False
            else:
                wrong = any(compiled_is_worse(got[i], ref[i], ref64[i], self.low_precision) for i in off)
        if not wrong:
            report().count(Count.DYNAMO_REFERENCE_OUTLIER)
            log.info("enn: unit %s: results %s differ from the Dynamo graph's, which is no closer to fp64: kept",
                     self.unit, off)
        return off, wrong

    def _fall_back(self, where: str, phase: str, returned: str) -> None:
        """The compiled unit is wrong where the Dynamo graph is right: raise (strict), or record it
        and run the Dynamo graph eagerly from now on. Called under the ladder's lock."""
        what = (f"the compiled {'backward' if phase == 'backward' else 'result'} and enn's eager copy (the graph AOT "
                f"Autograd traced, decompositions applied) differ from the graph Dynamo handed over ({where}), and "
                "an fp64 run sides with Dynamo's graph")
        if self.opts.guard.raises:
            raise EnnGuardError(f"enn (guard=strict): unit {self.unit}: {what}. Set guard='nonfinite' to fall back "
                                "automatically.")
        report().add_fallback(FallbackKind.DYNAMO_GRAPH, node="<graph>", phase=phase, graph=self.unit, reason=what,
                              action=f"returned {returned}; the unit runs the Dynamo graph eagerly from now on")
        self.eager, self.due = True, 0

    def _fault(self, flat: list, before: Before, off: list[int], n_out: int) -> Any:
        written = [f"input {i}" for i in before.inputs] + [f"{n}" for n in before.attrs]
        where = ", ".join(f"output {i}" if i < n_out else f"{written[i - n_out]} (written in place)" for i in off[:6])
        with LADDER:
            self._fall_back(where, "forward", "the Dynamo graph's result (gradients through its eager ops)")
            before.restore(flat, self.state)  # what the compiled call wrote is undone: the Dynamo graph writes once
            return self.gm(*flat)  # with autograd, on the caller's inputs: its writes land there

    # ------------------------------------------------------------------ the backward
    def _backward_of(self, flat: list, out: Any) -> tuple[Any, list] | None:
        """Where this call records a backward: AOT Autograd's backward node among its outputs'
        history, and which of the unit's tensors its gradients go to; else None."""
        outs = list(outputs(out))
        if not torch.is_grad_enabled() or not any(isinstance(o, torch.Tensor) and o.requires_grad for o in outs):
            return None
        node = _backward_node(outs)
        targets = _gradient_targets(node, flat, self.state) if node is not None else []
        return (node, targets) if targets else None

    def _watch_backward(self, backward: tuple[Any, list], flat: list, before: Before, out: Any,
                        kept: dict[str, Any]) -> None:
        """Compare the gradients the compiled backward gives with those of the reference run in
        ``kept`` (the Dynamo graph with autograd, on this call), when that backward runs."""
        node, targets = backward
        outs, ref_outs = list(outputs(out)), kept["outputs"]
        if len(ref_outs) != len(outs):
            return
        cotangents: dict[int, torch.Tensor] = {}
        for j, o in enumerate(outs):
            if isinstance(o, torch.Tensor) and o.requires_grad:
                o.register_hook(functools.partial(_keep, cotangents, j))
        inputs, params = kept["inputs"], kept["params"]
        leaves = [inputs[key[1]] if key[0] == "input" else params[key[1]] for _, key in targets]

        def compare(grad_inputs: tuple, grad_outputs: tuple) -> tuple | None:
            return self._compare_backward(grad_inputs, targets, ref_outs, leaves, cotangents,
                                          lambda: self._fp64_gradients(flat, before, targets, cotangents))

        node.register_hook(compare)

    @staticmethod
    def _gradients(outs: list, leaves: list, cotangents: dict[int, torch.Tensor]) -> list:
        pairs = [(outs[j], g) for j, g in sorted(cotangents.items())
                 if isinstance(outs[j], torch.Tensor) and outs[j].requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], leaves,
                                    grad_outputs=[g.to(o.dtype) for o, g in pairs], allow_unused=True)
        return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]

    def _fp64_gradients(self, flat: list, before: Before, targets: list, cotangents: dict) -> tuple[list, Any]:
        try:
            inputs, params = self._inputs(flat, before, fp64=True, grad=True)
            with torch.enable_grad():
                outs = list(outputs(self._call(fp64_dynamo_graph(self.gm), inputs, params)))
            leaves = [inputs[key[1]] if key[0] == "input" else params[key[1]] for _, key in targets]
            return self._gradients(outs, leaves, cotangents), None
        except Exception as exc:  # noqa: BLE001
            return [], exc

    def _compare_backward(self, grad_inputs: tuple, targets: list, ref_outs: list, leaves: list,
                          cotangents: dict, fp64: Callable[[], tuple[list, Any]]) -> tuple | None:
        if self.eager or not cotangents:
            return None
        report().count(Count.DYNAMO_BACKWARD_CHECKS)
        try:
            ref = self._gradients(ref_outs, leaves, cotangents)
        except Exception as exc:  # noqa: BLE001
            report().count(Count.DYNAMO_BACKWARD_UNJUDGED)  # every time; the warning once per unit
            if not self.unjudged_said:
                self.unjudged_said = True
                log.warning("enn: unit %s: a backward was not compared with the Dynamo graph's gradients (%s: %s); "
                            "counted as guard.dynamo_backward_unjudged", self.unit, type(exc).__name__, exc)
            return None
        got = [grad_inputs[k] if grad_inputs[k] is not None else torch.zeros_like(r) for (k, _), r in zip(targets, ref)]
        off, wrong = self._judge(got, ref, fp64)
        if not wrong:
            return None
        names = [f"input {key[1]}" if key[0] == "input" else key[1] for _, key in targets]
        with LADDER:
            self._fall_back(", ".join(f"gradient of {names[i]}" for i in off[:6]), "backward",
                            "the Dynamo graph's gradients (its eager ops' backward)")
        fixed = list(grad_inputs)
        for (k, _), r, g in zip(targets, ref, got):
            fixed[k] = r.to(g.dtype)
        return tuple(fixed)
