"""GuardedGraph: the callable that wraps each graph Inductor compiled for enn.

AOT Autograd calls it with a boxed list of inputs (forward: primals; backward:
saved tensors + tangents), and it returns the graph's outputs. On the fast path it
adds one NaN/Inf screen of the outputs (one host sync) and, for graphs that write
into their inputs, a copy of those inputs so a re-run never applies a mutation twice.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Any, Callable

import torch

from .. import compat
from ..report import FallbackKind, GraphRecord, report
from . import graph_edit as E
from .kernel_state import graph_key, node_key
from .localize import localize, suspects_from_traceback

log = logging.getLogger(__name__)


class EnnGuardError(RuntimeError):
    """Raised in ``guard="strict"`` mode instead of falling back."""


def _outputs(outs: Any) -> list:
    """A graph's outputs as a list (a boxed graph returns a list or tuple, a bare one a tensor)."""
    return outs if isinstance(outs, (list, tuple)) else [outs]


def _screened(flat: list, allowed: dict[int, str]) -> tuple[list[int], list[int]]:
    """(outputs to screen for NaN/Inf, outputs where only a NaN counts)."""
    idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()
           and i not in allowed]
    nan_only = [i for i, a in allowed.items() if a == "inf" and i < len(flat) and isinstance(flat[i], torch.Tensor)]
    return idx, nan_only


def _totals(flat: list, idx: list[int]) -> list[torch.Tensor]:
    """One fp32 L1 norm per output, summed per device and dtype (NaN + x = NaN, Inf - Inf = NaN):
    a finite total means every output is finite. On CUDA one _foreach_norm launches a few
    kernels for all outputs of a dtype instead of one kernel per output."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for i in idx:
        groups.setdefault((flat[i].device, flat[i].dtype), []).append(flat[i])
    totals = []
    for (device, _), ts in groups.items():
        if device.type == "cuda":
            totals.append(torch.stack(torch._foreach_norm(ts, 1, dtype=torch.float32)).sum())
        else:
            totals.append(torch.stack([t.sum(dtype=torch.float32) for t in ts]).sum())
    return totals


def nonfinite_outputs(outs: Any, allowed: dict[int, str] | None = None) -> list[int]:
    """Indices (in the flat output list) of floating outputs holding NaN/Inf.

    ``allowed`` maps outputs known to hold non-finite values legitimately (eager makes the
    same ones: an additive ``-inf`` mask saved for backward, the model's own NaN) to what is
    allowed there: ``"inf"`` (only a NaN counts) or ``"any"`` (not checked).

    One fp32 reduction per output screens them with one host sync per device and dtype;
    only when the screen trips (a NaN/Inf, or a sum overflowing) is each output checked exactly.
    """
    flat = _outputs(outs)
    idx, nan_only = _screened(flat, allowed or {})
    bad_nan = [i for i in nan_only if bool(torch.isnan(flat[i]).any())]
    if not idx or all(math.isfinite(t.item()) for t in _totals(flat, idx)):
        return bad_nan
    return sorted(bad_nan + [i for i in idx if not bool(torch.isfinite(flat[i]).all())])


def single_cuda_device(outs: Any) -> bool:
    """Are all floating outputs on one CUDA device (so they can be screened without a sync)?"""
    flat = _outputs(outs)
    devices = {t.device for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()}
    return len(devices) == 1 and next(iter(devices)).type == "cuda"


class _LateScreen:
    """The NaN/Inf screen of one call's outputs, computed on the GPU and copied to pinned host
    memory behind an event: read back once the event has passed, with no device sync."""

    def __init__(self, outs: Any, allowed: dict[int, str], host: torch.Tensor, call: int) -> None:
        flat = _outputs(outs)
        idx, nan_only = _screened(flat, allowed)
        flags = [~torch.isfinite(torch.stack(_totals(flat, idx)).sum())] if idx else []
        flags += [torch.isnan(flat[i]).any() for i in nan_only]
        self.call, self.host, self.event = call, host, None
        if flags:
            host.copy_(torch.stack(flags).any(), non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self, wait: bool = False) -> bool | None:
        """True: NaN/Inf found; False: clean; None: not known yet (``wait`` blocks instead)."""
        if self.event is None:
            return False
        if not self.event.query():
            if not wait:
                return None
            self.event.synchronize()
        return bool(self.host)


def _same_nonfinite_pattern(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(torch.isfinite(a), torch.isfinite(b)) and torch.equal(torch.isnan(a), torch.isnan(b))


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
        self.checks_outputs = self.mode != "exceptions"
        self.keep_inputs = self.mode == "exceptions"  # exceptions mode may re-run any call
        self.counters = record.counters  # the report's counters for this graph, updated per call
        self.calls = 0
        self.since_build = 0  # calls since the current artifact was built
        self.mutated = compiler.mutated
        self.random = compiler.random
        self.model_nonfinite_seen = False
        self.allowed: dict[int, str] = {}  # outputs whose non-finite values eager makes too
        # steady-state samples of a graph whose outputs live on one GPU are screened there and
        # read back later (a host sync would stall the launch queue: +3-7% on a short step)
        self.screen_later = False  # set by the first synchronously checked call
        self._late: _LateScreen | None = None
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
        check = self.checks_outputs and (warm or self.calls % self.every == 0)
        later = check and not warm and self.screen_later and not _distributed()
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
            return self._after(out, exc, None, None, None, False)
        if check:
            self.counters["checks"] = self.counters.get("checks", 0) + 1
        # Keep our own references to the inputs on the calls the ladder may need them
        # (checked calls; every call in "exceptions" mode, which schedules no checks).
        inputs = list(args)  # the compiled code may clear `args` to free memory early
        snapshot = [args[i].clone() for i in self.mutated] if self.mutated else None
        rng = _RngSnapshot() if self.random else None
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
        return self._after(out, exc, inputs, snapshot, rng, check)

    def _after(self, out: Any, exc: BaseException | None, inputs: list | None, snapshot: list | None,
               rng: _RngSnapshot | None, check: bool) -> Any:
        """The rest of a call that raised, is checked, or runs under torch.distributed."""
        bad = nonfinite_outputs(out, self.allowed) if (exc is None and check) else []
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
        if inputs is None:
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
        return self._on_fault(kind, inputs, snapshot, rng, exc=exc, bad=bad, out=out)

    def _screen_later(self, out: Any) -> None:
        self.counters["checks"] = self.counters.get("checks", 0) + 1
        if self._late is not None:  # (a screen still in flight, with guard_every=1: wait for it)
            self._read_late(wait=True)
        if self._late_host is None:
            self._late_host = torch.empty((), dtype=torch.bool, pin_memory=True)
        self._late = _LateScreen(out, self.allowed, self._late_host, self.calls)

    def _read_late(self, wait: bool = False) -> None:
        found = self._late.result(wait)
        if found is None:
            return
        call, self._late = self._late.call, None
        if not found:
            return
        # That call's outputs are with the caller already: say so, and check every call again,
        # so that the next call meets the fault (a kernel fault repeats) on the synchronous path
        # with its inputs held: the ladder re-runs it eagerly and pins the culprit there.
        self.since_build = 0
        report().add_fallback(
            FallbackKind.NONFINITE_LATE, node="<graph>", phase=self.record.phase, graph=self.record,
            reason=f"NaN/Inf (or a sum beyond fp32's range) in the outputs of call {call}, found by the "
                   "steady-state screen, which is read back without a device sync, after that call returned",
            action="that call's outputs were returned as computed; every call is checked again (warm-up restarts)")

    # --------------------------------------------------------------- the ladder
    def _restore(self, inputs: list, snapshot: list | None, rng: _RngSnapshot | None) -> None:
        if snapshot is not None:
            for i, saved in zip(self.mutated, snapshot):
                inputs[i].copy_(saved)
        if rng is not None:
            rng.restore()

    def _run_eager(self, gm: torch.fx.GraphModule, inputs: list) -> tuple[Any, BaseException | None]:
        try:
            with _no_autocast(), torch.no_grad():
                out = gm(*inputs)
            return list(out) if isinstance(out, (list, tuple)) else [out], None
        except Exception as exc:  # noqa: BLE001
            return None, exc

    def _on_fault(self, kind: str, inputs: list, snapshot: list | None, rng: Any, exc: BaseException | None = None,
                  bad: list | None = None, out: Any = None) -> Any:
        rec, phase, R = self.record, self.record.phase, report()
        rec.counters["faults"] = rec.counters.get("faults", 0) + 1
        R.count("guard.faults")
        if exc is not None:
            what = f"{type(exc).__name__}: {exc}"
        elif bad == [-1]:
            what = f"another rank's compiled graph {'raised' if kind == 'exception' else 'gave NaN/Inf'} (decision shared by all ranks)"
        else:
            what = "NaN/Inf in compiled output"
        self._full_compiler(what)
        self._restore(inputs, snapshot, rng)
        eager_out, eager_exc = self._run_eager(self.compiler.safe_gm(), inputs)
        rec.counters["eager_reruns"] = rec.counters.get("eager_reruns", 0) + 1
        if eager_exc is not None:
            R.add_fallback(FallbackKind.EXCEPTION, node="<graph>", phase=phase, graph=rec,
                           reason=f"{what}; the eager graph raises too ({type(eager_exc).__name__}: {eager_exc})",
                           action="raised the model's own error")
            raise eager_exc
        # Outputs where eager is non-finite at exactly the same places are the model's own
        # values; any other bad output is the compiled code's fault.
        eager_bad = set(nonfinite_outputs(eager_out))
        own = {i for i in (bad or []) if i >= 0 and i in eager_bad and _same_nonfinite_pattern(out[i], eager_out[i])}
        kernel = kind == "exception" or bad == [-1] or any(i not in own for i in bad or [])
        if _distributed():
            kernel = _agree(kernel)
        legit = {i: ("any" if bool(torch.isnan(eager_out[i]).any()) else "inf") for i in eager_bad}
        if kernel:
            return self._kernel_fault(kind, what, inputs, snapshot, rng, exc, eager_out,
                                      [i for i in (bad or []) if i not in own] or bad, {**self.allowed, **legit})
        return self._eager_nonfinite(what, inputs, snapshot, rng, eager_out, legit, bad or [])

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
        self.__dict__.pop("_fx_graph_cache_key", None)

    def _kernel_fault(self, kind, what, inputs, snapshot, rng, exc, eager_out, bad, legit) -> Any:
        rec, phase, R = self.record, self.record.phase, report()
        t0 = time.perf_counter()

        def still_faulty(pins: frozenset[str]) -> bool:
            # a pin set found fault-free before re-runs its kept artifact (localize confirms)
            compiled = trial_cache.pop(pins, None) or self.compiler.build(extra_pins=pins, quiet=True)
            self._restore(inputs, snapshot, rng)
            try:
                out = compiled(list(inputs))
            except torch.OutOfMemoryError:
                raise
            except Exception:  # noqa: BLE001
                return _agree(True)
            faulty = kind == "nonfinite" and bool(nonfinite_outputs(out, legit))
            if _distributed():
                faulty = _agree(faulty)
            if not faulty:
                trial_cache[pins] = compiled
            return faulty

        trial_cache: dict[frozenset[str], Any] = {}
        groups, prime = self._suspects(kind, bad, exc)
        loc = localize(groups, still_faulty, self.opts.localize_budget, prime)
        elapsed = time.perf_counter() - t0
        if loc is None:
            nodes, action = "<graph>", "graph runs eagerly from now on (pinning every node did not remove the fault)"
            new = self.compiler.eager_callable()
            rec.path = "eager"
        else:
            nodes = ",".join(loc.pinned)
            pins = frozenset(loc.pinned)
            new = trial_cache.get(pins) or self.compiler.build(extra_pins=pins)
            action = (f"pinned {len(loc.pinned)} node(s) to eager after {loc.trials} trial recompile(s) "
                      f"in {elapsed:.1f}s; {self.compiler.compute_nodes - len(self.compiler.pinned_now(pins))} nodes stay compiled")
            if loc.notes:
                action += "; " + "; ".join(loc.notes)
            for name in loc.pinned:
                key = node_key(self.compiler.node(name))
                if key:
                    self.compiler.state.record(key, "pinned", exc, reason=what)
        if self.mode == "strict":
            raise EnnGuardError(
                f"enn (guard=strict): {kind} in compiled graph {rec.id} (phase {phase}) at node(s) {nodes}: {what}. "
                f"Eager gives a finite result, so the compiled kernel is at fault. Set guard='nonfinite' to fall back automatically."
            ) from exc
        R.add_fallback(FallbackKind(kind), node=nodes, phase=phase, graph=rec, reason=what, action=action)
        self.compiler.adopt(new, pins=frozenset(loc.pinned) if loc else frozenset())
        self._adopt(new)
        self.compiler.write_repro(kind=kind, what=what, inputs=inputs, snapshot=snapshot, nodes=nodes)
        return eager_out

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

    def _eager_nonfinite(self, what, inputs, snapshot, rng, eager_out, legit, bad) -> Any:
        rec, phase, R = self.record, self.record.phase, report()
        if E.has_low_precision(self.compiler.eager_gm) and self.opts.precision:
            fp32_gm = self.compiler.fp32_gm()
            self._restore(inputs, snapshot, rng)
            out32, exc32 = self._run_eager(fp32_gm, inputs)
            ok = exc32 is None and not (set(nonfinite_outputs(out32)) & set(bad))
            if _distributed():
                ok = not _agree(not ok)
            if ok:
                if self.mode == "strict":
                    raise EnnGuardError(
                        f"enn (guard=strict): graph {rec.id} (phase {phase}) overflows in low precision ({what}); fp32 is finite."
                    )
                new = self.compiler.build(fp32=True)
                self.compiler.adopt(new, fp32=True)
                self._adopt(new)
                self.compiler.state.record(graph_key(self.compiler.eager_gm), "fp32", reason=what)
                R.add_fallback(FallbackKind.PRECISION, node="<graph>", phase=phase, graph=rec,
                               reason=f"{what}; eager in low precision is non-finite too, fp32 is finite",
                               action="graph pinned to fp32 compute (outputs cast back); result taken from the fp32 run")
                rec.promotions.append({"node": "<graph>", "reason": "master-dtype retry: low precision overflowed"})
                return out32
        # The model's own NaN/Inf: eager makes it too, at the same places. Return eager's
        # result, blame nothing, and stop flagging those outputs (a -inf mask saved for the
        # backward would otherwise send every call down this path).
        self.allowed.update(legit)
        rec.counters["model_nonfinite"] = rec.counters.get("model_nonfinite", 0) + 1
        if self.mode == "strict":
            raise EnnGuardError(
                f"enn (guard=strict): graph {rec.id} (phase {phase}) produces NaN/Inf in eager too: the model's own numerics, not a kernel fault."
            )
        if not self.model_nonfinite_seen:
            self.model_nonfinite_seen = True
            R.add_fallback(FallbackKind.MODEL_NONFINITE, node="<none>", phase=phase, graph=rec,
                           reason="NaN/Inf in compiled output and in eager (fp32 too): the model's own numerics",
                           action="returned eager's result unchanged; no kernel blamed (repeats counted, not re-logged)",
                           level=logging.INFO)
        R.count("guard.model_nonfinite")
        return eager_out
