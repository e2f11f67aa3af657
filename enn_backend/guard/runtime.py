"""GuardedGraph: the callable that wraps each graph Inductor compiled for enn.

AOT Autograd calls it with a boxed list of inputs (forward: primals; backward:
saved tensors + tangents), and it returns the graph's outputs. On the fast path it
adds one NaN/Inf screen of the outputs (one host sync) and, for graphs that write
into their inputs, a copy of those inputs so a re-run never applies a mutation twice.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable

import torch

from .. import compat
from ..report import FallbackKind, GraphRecord, report
from . import graph_edit as E
from .kernel_entry import graph_key, node_key
from .localize import CONFIRM_RUNS, Localization, localize, suspects_from_traceback
from .screen import (LateScreen, allowance, compiled_is_worse, divergent, diverging, nonfinite_inputs,
                     nonfinite_outputs, outputs, single_cuda_device)

log = logging.getLogger(__name__)


class EnnGuardError(RuntimeError):
    """Raised in ``guard="strict"`` mode instead of falling back."""


_OK, _NONFINITE, _EXCEPTION = 0, 1, 2


def _agree_level(level: int) -> int:
    """Under torch.distributed, the max of ``level`` over all ranks, so that every rank
    takes the same branch of the ladder (and runs the same collectives in it)."""
    dist = torch.distributed
    if not _distributed():
        return level
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([level], device=device, dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _agree(flag: bool) -> bool:
    """Under torch.distributed, the OR of ``flag`` over all ranks."""
    return bool(_agree_level(int(flag)))


def _distributed() -> bool:
    # asked on every guarded call, so the cheap probe first (see compat.dist_initialized)
    return compat.dist_initialized() and torch.distributed.get_world_size() > 1


@contextlib.contextmanager
def _no_autocast() -> Any:
    """The graphs are post-AOT: autocast's casts are already explicit in them."""
    with torch.autocast("cpu", enabled=False):
        if torch.cuda.is_available():
            with torch.autocast("cuda", enabled=False):
                yield
        else:
            yield


class _RngSnapshot:
    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


# One ladder at a time in a process: a thread whose call faults while another thread's ladder
# runs waits for it, then runs its call again on whatever fast path that ladder left (or, for
# another graph with the same faulty kernel, finds the culprit in kernel state). Ladders are rare
# and spend their time compiling, which Inductor does one graph at a time anyway.
_LADDER = threading.RLock()


class GuardedGraph:
    """Fast path + the fallback ladder for one compiled graph (see enn_backend.guard)."""

    def __init__(self, compiler: "Any", compiled: Callable[[list], Any], record: GraphRecord) -> None:
        self.compiler = compiler  # enn_backend.graph_compiler.GraphCompiler
        self.compiled = compiled
        self.record = record
        self.opts = compiler.opts
        self.mode = self.opts.guard
        self.every = self.opts.guard_every
        self.warmup = self.opts.guard_warmup
        self.checks_outputs = self.mode.checks_outputs
        # value checks: every checked call in "values" mode, else the first call of each
        # artifact and every `guard_values`-th call; never where random draws differ by design
        self.value_every = self.opts.guard_values if self.mode.checks_outputs and not compiler.random else 0
        self.values_always = self.mode.checks_every_value and not compiler.random
        # a graph loaded from AOTAutograd's cache was checked when it was compiled; checking its
        # first call again would trace it again, which a warm start exists to avoid
        self.first_call_values = not compiler.from_cache
        self.low_precision: bool | None = None  # does the graph compute in fp16/bf16? (on the first value check)
        self.keep_inputs = self.mode.keeps_inputs  # exceptions mode may re-run any call
        self.counters = record.counters  # the report's counters for this graph, updated per call
        self.calls = 0
        self.since_build = 0  # calls since the current artifact was built
        self.written = compiler.written  # inputs a compiled call may write into: copied on checked calls
        self.random = compiler.random
        self.inputs_are_primals = compiler.phase != "backward"  # parameters, buffers, user inputs
        self.allowed: dict[int, str] = {}  # output -> the infinities the reference makes there too
        self.reported: set[FallbackKind] = set()  # kinds reported once per graph, repeats counted
        self.generation = 0  # bumped whenever the fast path changes (see _LADDER)
        # steady-state samples of a graph whose outputs live on one GPU are screened there and
        # read back later (a host sync would stall the launch queue: +3-7% on a short step)
        self.screen_later = False  # set by the first synchronously checked call
        self._late: LateScreen | None = None
        self._late_host: torch.Tensor | None = None
        self._boxed_call = True  # an instance attribute: torch._dynamo.disable copies __dict__

    # --------------------------------------------------------------- fast path
    def __call__(self, args: list) -> Any:
        # Runs on every call of every compiled graph, so the steady state's unchecked call is
        # kept to a few attribute reads: on a small CPU graph (tens of microseconds) each
        # Python operation here is a visible share of the call.
        self.calls += 1
        self.since_build += 1
        self.counters["calls"] = self.calls
        if self._late is not None:
            self._read_late()
        # every call while the artifact is new (first calls are where kernel faults show),
        # then every `guard_every`-th call
        warm = self.since_build <= self.warmup
        values = self.value_every and ((self.since_build == 1 and self.first_call_values)
                                       or self.calls % self.value_every == 0)
        check = self.checks_outputs and (warm or values or self.calls % self.every == 0)
        values = check and (values or self.values_always)
        later = check and not warm and not values and self.screen_later and not _distributed()
        generation = self.generation
        if later or not (check or self.keep_inputs):
            # An unchecked call holds no reference to the inputs: the compiled code's
            # `args.clear()` frees each one when it is dead (holding them kept a backward
            # graph's saved activations alive to its end).
            out, exc = None, None
            try:
                out = self.compiled(args)
            except torch.OutOfMemoryError:
                raise  # not a kernel fault: eager would need the same memory
            except Exception as e:  # noqa: BLE001 - any kernel failure enters the ladder
                exc = e
            if exc is None and not _distributed():
                if later:
                    self._screen_later(out)
                return out
            return self._after(out, exc, _Call(None, None, None, generation), False)
        if check:
            self.counters["checks"] = self.counters.get("checks", 0) + 1
        # Keep our own references to the inputs on the calls the ladder may need them
        # (checked calls; every call in "exceptions" mode, which schedules no checks), and a
        # copy of those the compiled code may write into, so a re-run starts from what this
        # call was given.
        call = _Call(list(args),  # the compiled code may clear `args` to free memory early
                     [args[i].clone() for i in self.written] if self.written else None,
                     _RngSnapshot() if self.random else None, generation)
        out, exc = None, None
        try:
            out = self.compiled(args)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001
            exc = e
        if exc is None and not check and not _distributed():
            return out
        # outside the `except`: an error the ladder raises is not chained to the kernel's
        return self._after(out, exc, call, check, values)

    def _after(self, out: Any, exc: BaseException | None, call: "_Call", check: bool, values: bool = False) -> Any:
        """The rest of a call that raised, is checked, or runs under torch.distributed."""
        bad = nonfinite_outputs(out, self.allowed) if (exc is None and check) else []
        if values and exc is None and not bad and not _distributed():
            return self._check_values(out, call)
        if exc is None and check and not self.screen_later and compat.is_cuda_available():
            self.screen_later = single_cuda_device(out)
        level = _EXCEPTION if exc is not None else (_NONFINITE if bad else _OK)
        if _distributed():
            agreed = _agree_level(level)
            if agreed > level:
                bad = [-1]  # another rank faulted: every rank takes the same path
            level = agreed
        if level == _OK:
            return out
        if call.inputs is None:
            # An unchecked call raised. Its inputs are gone -- the compiled code frees each one
            # when it is dead, and holding them on every call would keep a backward graph's
            # saved activations alive to its end (measured: +60% peak on an MLP) -- so the
            # ladder cannot re-run it. Recorded, re-raised; every call is checked from now on.
            self.since_build = 0
            what = f"{type(exc).__name__}: {exc}" if exc is not None else "another rank's compiled graph raised"
            report().add_fallback(FallbackKind.EXCEPTION, node="<graph>", phase=self.record.phase, graph=self.record,
                                  reason=f"{what} on a call the guard did not check (inputs already freed)",
                                  action="raised to the caller; the following calls are checked (warm-up restarts)")
            raise exc if exc is not None else RuntimeError("enn: another rank's compiled graph failed on an unchecked call")
        kind = "exception" if level == _EXCEPTION else "nonfinite"
        with _LADDER:
            if call.generation != self.generation and not _distributed():
                # another thread's ladder changed the fast path while this call ran on the old one
                retried = self._retry(call, check)
                if retried is not None:
                    return retried
            return self._on_fault(kind, call, exc=exc, bad=bad, out=out)

    def _retry(self, call: "_Call", check: bool) -> Any:
        """This call again on the current fast path; None if it faults there too."""
        self._restore(call)
        try:
            out = self.compiled(list(call.inputs))
        except torch.OutOfMemoryError:
            raise
        except Exception:  # noqa: BLE001
            return None
        return None if (check and nonfinite_outputs(out, self.allowed)) else out

    def _screen_later(self, out: Any) -> None:
        self.counters["checks"] = self.counters.get("checks", 0) + 1
        if self._late is not None:  # (a screen still in flight, with guard_every=1: wait for it)
            self._read_late(wait=True)
        if self._late_host is None:
            self._late_host = torch.empty((), dtype=torch.bool, pin_memory=True)
        self._late = LateScreen(out, self.allowed, self._late_host, self.calls)

    def _read_late(self, wait: bool = False) -> None:
        late = self._late
        found = late.result(wait) if late is not None else None
        if found is None:
            return
        self._late = None
        if not found:
            return
        # That call's outputs are with the caller already: say so, and check every call again,
        # so that the next call meets the fault (a kernel fault repeats) on the synchronous path
        # with its inputs held: the ladder re-runs it eagerly and pins the culprit there.
        self.since_build = 0
        report().add_fallback(
            FallbackKind.NONFINITE_LATE, node="<graph>", phase=self.record.phase, graph=self.record,
            reason=f"NaN/Inf (or a sum beyond fp32's range) in the outputs of call {late.call}, found by the "
                   "steady-state screen, which is read back without a device sync, after that call returned",
            action="that call's outputs were returned as computed; every call is checked again (warm-up restarts)")

    # --------------------------------------------------------------- the ladder
    def _restore(self, call: "_Call") -> None:
        if call.snapshot is not None:
            for i, saved in zip(self.written, call.snapshot):
                call.inputs[i].copy_(saved)
        if call.rng is not None:
            call.rng.restore()

    def _reference(self, call: "_Call") -> tuple[Any, BaseException | None]:
        """Run the eager reference on this call's inputs (restored first). What it writes into
        inputs and leaves in the RNG is kept on ``call``, so the ladder can leave them as
        the reference left them after its trials ran (see _settle)."""
        self._restore(call)
        ref, exc = self._run_eager(self.compiler.safe_gm(), call.inputs)
        if exc is None:
            call.after = ([call.inputs[i].clone() for i in self.written],
                          _RngSnapshot() if call.rng is not None else None)
        return ref, exc

    def _settle(self, call: "_Call") -> None:
        """Inputs and RNG as the reference run left them (trials ran after it)."""
        if call.after is None:
            return
        written, rng = call.after
        for i, t in zip(self.written, written):
            call.inputs[i].copy_(t)
        if rng is not None:
            rng.restore()

    def _run_eager(self, gm: torch.fx.GraphModule, inputs: list) -> tuple[Any, BaseException | None]:
        try:
            with _no_autocast(), torch.no_grad():
                out = gm(*inputs)
            return list(out) if isinstance(out, (list, tuple)) else [out], None
        except Exception as exc:  # noqa: BLE001
            return None, exc

    def _check_values(self, out: Any, call: "_Call") -> Any:
        """Compare this call's results -- outputs and writes into inputs -- with the reference's."""
        rec = self.record
        rec.counters["value_checks"] = rec.counters.get("value_checks", 0) + 1
        mutated = self.compiler.mutated
        written = [call.inputs[i].clone() for i in mutated]  # what the compiled call wrote
        self._full_compiler("a value check")
        ref, ref_exc = self._reference(call)
        if ref_exc is not None:
            log.warning("enn: graph %s: the value check's eager run raised (%s: %s); compiled result kept",
                        rec.id, type(ref_exc).__name__, ref_exc)
            return out
        flat = outputs(out)
        ref_written = [call.inputs[i].clone() for i in mutated]
        if self.low_precision is None:
            self.low_precision = E.has_low_precision(self.compiler.eager_gm)
        off = diverging(list(flat) + written, ref + ref_written, self.low_precision)
        if not off:
            for i, t in zip(mutated, written):  # the inputs keep what the compiled call wrote
                call.inputs[i].copy_(t)
            return out
        with _LADDER:
            if not self._compiled_is_wrong(call, list(flat) + written, ref + ref_written, off):
                # the reference is the outlier (compiled is as close to fp64): nobody is blamed
                rec.counters["value_reference_outlier"] = rec.counters.get("value_reference_outlier", 0) + 1
                log.info("enn: graph %s: compiled results %s differ from eager's, but no further from fp64: kept",
                         rec.id, off)
                for i, t in zip(mutated, written):
                    call.inputs[i].copy_(t)
                return out
            self._count_fault()
            n_out = len(flat)
            where = [f"output {i}" if i < n_out else f"input {mutated[i - n_out]} (written in place)" for i in off]
            what = f"finite values differ from eager's beyond tolerance ({', '.join(where[:6])})"
            return self._kernel_fault("value", what, call, None, ref, [i for i in off if i < n_out] or off)

    def _compiled_is_wrong(self, call: "_Call", got: list, ref: list, off: list[int]) -> bool:
        """Judge a disagreement with an fp64 run of the reference. Without one (an op with no
        fp64 kernel) nobody is blamed: a tolerance alone cannot tell a wrong kernel from a
        reference that rounds differently."""
        if any(not (isinstance(got[i], torch.Tensor) and isinstance(ref[i], torch.Tensor))
               or got[i].dtype != ref[i].dtype or got[i].shape != ref[i].shape for i in off):
            return True  # a dtype or shape eager does not give is wrong whatever the values
        self._restore(call)
        try:
            ref64, exc64 = self._run_eager(self.compiler.fp64_gm(), call.inputs)
        except Exception as exc:  # noqa: BLE001 - building the fp64 graph failed
            ref64, exc64 = None, exc
        if exc64 is not None:
            log.info("enn: graph %s: no fp64 run to judge a value difference (%s: %s); nobody blamed",
                     self.record.id, type(exc64).__name__, exc64)
            return False
        ref64 += [call.inputs[i] for i in self.compiler.mutated]  # (the fp64 graph writes into copies)
        return any(compiled_is_worse(got[i], ref[i], ref64[i], bool(self.low_precision))
                   for i in off if i < len(ref64))

    def _on_fault(self, kind: str, call: "_Call", exc: BaseException | None = None, bad: list | None = None,
                  out: Any = None) -> Any:
        rec, phase, R = self.record, self.record.phase, report()
        bad = bad or []
        if exc is not None:
            what = f"{type(exc).__name__}: {exc}"
        elif bad == [-1]:
            what = f"another rank's compiled graph {'raised' if kind == 'exception' else 'gave NaN/Inf'} (decision shared by all ranks)"
        else:
            what = "NaN/Inf in compiled output"
        self._full_compiler(what)
        ref, ref_exc = self._reference(call)
        rec.counters["eager_reruns"] = rec.counters.get("eager_reruns", 0) + 1
        if ref_exc is not None:
            self._count_fault()
            R.add_fallback(FallbackKind.EXCEPTION, node="<graph>", phase=phase, graph=rec,
                           reason=f"{what}; the eager graph raises too ({type(ref_exc).__name__}: {ref_exc})",
                           action="raised the model's own error")
            raise ref_exc
        # Outputs whose NaN/Inf the reference makes at the same places, with the same finite
        # values elsewhere, are the model's own values; any other is the compiled code's fault.
        pattern, values = divergent(outputs(out), ref, [i for i in bad if i >= 0]) if exc is None else ([], [])
        kernel = kind == "exception" or bad == [-1] or bool(pattern)
        if _distributed():
            kernel = _agree(kernel)
        if kernel:
            self._count_fault()
            return self._kernel_fault(kind, what, call, exc, ref, pattern or bad)
        return self._reference_nonfinite(what, call, out, ref, bad, values)

    def _count_fault(self) -> None:
        self.record.counters["faults"] = self.record.counters.get("faults", 0) + 1
        report().count("guard.faults")

    def _full_compiler(self, what: str) -> None:
        """Make sure the ladder has the graph: a graph loaded from AOTAutograd's cache has a
        stand-in compiler until now (enn_backend.aot_cache); this traces the graph."""
        try:
            self.compiler = self.compiler.full()
        except Exception as exc:  # noqa: BLE001
            report().add_fallback(FallbackKind.EXCEPTION, node="<graph>", phase=self.record.phase, graph=self.record,
                                  reason=f"{what}; this graph came from AOTAutograd's cache and tracing it again "
                                         f"failed ({type(exc).__name__}: {exc})",
                                  action="raised: the guard has no eager copy to re-run")
            raise EnnGuardError(f"enn: {what} in cache-loaded graph {self.record.id}, and its eager copy could not be "
                                f"rebuilt: {type(exc).__name__}: {exc}") from exc

    def _adopt(self, new: Callable[[list], Any]) -> None:
        """Make ``new`` the fast path. The artifact first compiled is no longer the graph's: it
        must not reach AOTAutograd's cache (enn_backend.aot_cache) if that saves it later."""
        self.compiled, self.since_build = new, 0
        self.generation += 1
        self.first_call_values = True
        self.__dict__.pop("_fx_graph_cache_key", None)

    def _kernel_fault(self, kind: str, what: str, call: "_Call", exc: BaseException | None, ref: list,
                      bad: list) -> Any:
        rec, phase, R = self.record, self.record.phase, report()
        t0 = time.perf_counter()

        def still_faulty(pins: frozenset[str]) -> bool:
            # a pin set found fault-free before re-runs its kept artifact (localize confirms)
            compiled = trial_cache.pop(pins, None) or self.compiler.build(extra_pins=pins, quiet=True)
            self._restore(call)
            try:
                out = compiled(list(call.inputs))
            except torch.OutOfMemoryError:
                raise
            except Exception:  # noqa: BLE001
                return _agree(True)
            # a trial is judged against the reference: NaN/Inf it makes where eager does not, or
            # for a value fault, any value off eager's
            flat = outputs(out)
            if kind == "value":
                faulty = bool(diverging(list(flat)[:len(ref)], ref, bool(self.low_precision)))
            else:
                faulty = kind == "nonfinite" and bool(divergent(flat, ref, nonfinite_outputs(flat))[0])
            if _distributed():
                faulty = _agree(faulty)
            if not faulty:
                trial_cache[pins] = compiled
            return faulty

        def reproduces(pins: frozenset[str]) -> bool:
            # a flaky kernel passes some runs: a clean verdict needs every confirming run clean
            return any(still_faulty(pins) for _ in range(CONFIRM_RUNS))

        trial_cache: dict[frozenset[str], Any] = {}
        known = self.compiler.recorded_pins()
        if known and not reproduces(known):
            # kernel state learned these kernels' fault since this graph was compiled
            loc, nodes, new = Localization(pinned=sorted(known), trials=1), ",".join(sorted(known)), trial_cache[known]
            action = (f"pinned {len(known)} node(s) whose kernels kernel state records as faulty, after 1 trial "
                      f"recompile in {time.perf_counter() - t0:.1f}s")
            localized = False  # the graph that localized them wrote the repro
        elif not reproduces(frozenset()):
            # A fresh compile of the same graph, with the same pins, runs this call cleanly: the
            # fault was in the artifact or transient, and no node can be blamed on this evidence.
            loc, nodes, localized = None, "<graph>", False
            new = trial_cache[frozenset()]
            action = (f"recompiled the graph with no new pins in {time.perf_counter() - t0:.1f}s: the fault did not "
                      "reproduce on a fresh compile of the same graph, so no node is blamed")
        else:
            groups, prime = self._suspects(kind, bad, exc)
            loc, localized = localize(groups, still_faulty, self.opts.localize_budget, prime), True
            elapsed = time.perf_counter() - t0
            if loc is None and kind == "value":
                # no pin set brings the values to eager's: the difference is not a node's, so it
                # is not a kernel fault this check can prove; the compiled graph stays
                nodes, new = "<graph>", self.compiled
                action = ("kept the compiled graph: pinning every node did not bring its values to eager's, so no "
                          "kernel is at fault on this evidence; value checks of this graph are off from now on")
                self.value_every, self.values_always = 0, False
            elif loc is None:
                nodes, action = "<graph>", "graph runs eagerly from now on (pinning every node did not remove the fault)"
                new = self.compiler.eager_callable()
                rec.path = "eager"
            else:
                nodes = ",".join(loc.pinned)
                pins = frozenset(loc.pinned)
                new = trial_cache.get(pins) or self.compiler.build(extra_pins=pins)
                action = (f"pinned {len(loc.pinned)} node(s) to eager after {loc.trials + 1} trial recompile(s) "
                          f"in {elapsed:.1f}s; {self.compiler.compute_nodes - len(self.compiler.pinned_now(pins))} "
                          "nodes stay compiled")
                if loc.notes:
                    action += "; " + "; ".join(loc.notes)
                for name in loc.pinned:
                    key = node_key(self.compiler.node(name))
                    if key:
                        self.compiler.state.record(key, "pinned", exc, reason=what)
        if self.mode.raises:
            raise EnnGuardError(
                f"enn (guard=strict): {kind} in compiled graph {rec.id} (phase {phase}) at node(s) {nodes}: {what}. "
                f"Eager's result is right where the compiled one is not, so the compiled kernel is at fault. "
                f"Set guard='nonfinite' to fall back automatically."
            ) from exc
        R.add_fallback(FallbackKind(kind), node=nodes, phase=phase, graph=rec, reason=what, action=action)
        self.compiler.adopt(new, pins=frozenset(loc.pinned) if loc else frozenset())
        self._adopt(new)
        self._settle(call)
        if localized:
            mutated = None if call.snapshot is None else [call.snapshot[self.written.index(i)] for i in self.compiler.mutated]
            self.compiler.write_repro(kind=kind, what=what, inputs=call.inputs, snapshot=mutated, nodes=nodes)
        return ref

    def _suspects(self, kind: str, bad: list | None, exc: BaseException | None) -> tuple[list[list[str]], frozenset[str]]:
        """Suspects grouped by op (enn's own ops first) and the prime suspects.

        Prime suspects: for an exception, the nodes behind the kernel that raised (from
        the traceback); for NaN/Inf, the nodes that only the bad outputs depend on.
        """
        gm = self.compiler.eager_gm
        cands = [n for n in E.candidate_nodes(gm) if n.name not in self.compiler.pinned_names]
        prime: frozenset[str] = frozenset()
        if exc is not None:
            prime = suspects_from_traceback(exc, gm)
        elif bad and bad != [-1]:
            outs = E.output_nodes(gm)
            bad_cone = E.ancestors(gm, [outs[i] for i in bad if i < len(outs)])
            good_cone = E.ancestors(gm, [o for i, o in enumerate(outs) if i not in bad])
            cands = [n for n in cands if n.name in bad_cone] or cands
            prime = frozenset(n.name for n in cands if n.name not in good_cone)
        groups: dict[str, list[str]] = {}
        for n in cands:
            groups.setdefault(E.node_op_name(n), []).append(n.name)
        ordered = sorted(groups.items(), key=lambda kv: not kv[0].startswith("enn."))
        return [g for _, g in ordered], prime

    def _reference_nonfinite(self, what: str, call: "_Call", out: Any, ref: list, bad: list,
                             values: list[int]) -> Any:
        """The reference makes the compiled call's NaN/Inf too, at the same places."""
        rec, phase, R = self.record, self.record.phase, report()
        if E.has_low_precision(self.compiler.eager_gm) and self.opts.precision:
            fp32 = self._fp32_retry(what, call, bad)
            if fp32 is not None:
                return fp32
        if self.mode.raises:
            raise EnnGuardError(
                f"enn (guard=strict): graph {rec.id} (phase {phase}) produces NaN/Inf in eager too: the model's own numerics, not a kernel fault."
            )
        rec.counters["model_nonfinite"] = rec.counters.get("model_nonfinite", 0) + 1
        R.count("guard.model_nonfinite")
        if values:
            # Same NaN/Inf places, other finite values: the reference is the result eager gives.
            self._report_once(FallbackKind.MODEL_NONFINITE, reason=(
                f"NaN/Inf in outputs {values} at the same places in compiled and eager code, but the other values "
                "differ beyond the tolerance of their dtype"), action="returned eager's result (repeats counted, not re-logged)")
            return ref
        stale = nonfinite_inputs(call.inputs) if self.inputs_are_primals else []
        if stale:
            # Not this graph's numerics: what it was given already held NaN/Inf.
            self._report_once(FallbackKind.NONFINITE_INPUTS, reason=(
                f"graph inputs {stale[:8]} already hold NaN/Inf (parameters, buffers or activations), so eager's "
                "result is non-finite too; an earlier step made them: a kernel fault on a call the guard did not "
                "check (see any nonfinite_late entry) or the model's own divergence"),
                action="returned the compiled result, which equals eager's; nothing blamed (repeats counted, not re-logged)")
            return out
        # The model's own values: keep the compiled outputs (the backward reads what this forward
        # saved) and learn which infinities each output may hold on later calls. A NaN is never
        # learned: every check meets it again.
        for i in bad:
            learned = allowance(ref[i])
            if learned is not None:
                self.allowed[i] = learned
        log.debug("enn: graph %s: outputs %s hold NaN/Inf that eager makes too (the model's own values); compiled "
                  "outputs kept", rec.id, bad)
        return out

    def _fp32_retry(self, what: str, call: "_Call", bad: list) -> Any:
        """Low precision overflowed in eager too: the fp32 graph's result if it is finite there
        (and the graph is pinned to fp32 from now on), else None."""
        rec, phase, R = self.record, self.record.phase, report()
        self._restore(call)
        out32, exc32 = self._run_eager(self.compiler.fp32_gm(), call.inputs)
        ok = exc32 is None and not (set(nonfinite_outputs(out32)) & set(bad))
        if _distributed():
            ok = not _agree(not ok)
        if not ok:
            return None
        if self.mode.raises:
            raise EnnGuardError(
                f"enn (guard=strict): graph {rec.id} (phase {phase}) overflows in low precision ({what}); fp32 is finite."
            )
        self._count_fault()
        new = self.compiler.build(fp32=True)
        self.compiler.adopt(new, fp32=True)
        self._adopt(new)
        self.compiler.state.record(graph_key(self.compiler.eager_gm), "fp32", reason=what)
        R.add_fallback(FallbackKind.PRECISION, node="<graph>", phase=phase, graph=rec,
                       reason=f"{what}; eager in low precision is non-finite too, fp32 is finite",
                       action="graph pinned to fp32 compute (outputs cast back); result taken from the fp32 run")
        rec.promotions.append({"node": "<graph>", "reason": "master-dtype retry: low precision overflowed"})
        return out32

    def _report_once(self, kind: FallbackKind, reason: str, action: str) -> None:
        if kind in self.reported:
            return
        self.reported.add(kind)
        report().add_fallback(kind, node="<none>", phase=self.record.phase, graph=self.record, reason=reason,
                              action=action)


class _Call:
    """What the ladder needs of one call: its inputs (None when not held), copies of the inputs
    it may write into, the RNG state before it, the fast path's generation it ran on, and what
    the reference run left in the inputs and the RNG."""

    __slots__ = ("inputs", "snapshot", "rng", "generation", "after")

    def __init__(self, inputs: list | None, snapshot: list | None, rng: _RngSnapshot | None, generation: int) -> None:
        self.inputs, self.snapshot, self.rng, self.generation = inputs, snapshot, rng, generation
        self.after: tuple[list, _RngSnapshot | None] | None = None  # what the reference run left
