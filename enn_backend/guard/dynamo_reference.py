"""The value check's second reference: the graph Dynamo handed to enn, run as torch runs it.

The guard's first reference, enn's eager copy of a graph, is the ATen graph AOT Autograd traced
with the decompositions applied. Where a decomposition is wrong (pytorch/pytorch#185464), the
compiled code and the eager copy agree on the wrong value and the per-graph value check sees
nothing. So on the calls the value check samples -- a unit's first call, then every
``guard_values``-th (under ``guard="values"`` also every call of the warm-up and every
``guard_every``-th) -- :class:`DynamoReference` compares what the whole compiled unit returned
(after the per-graph guard's own checks) with the Dynamo graph run eagerly on the same inputs:
torch's ops, no decompositions, no autograd. It compares the outputs and what the unit writes
into its inputs, with the value check's rules (guard/screen.py).

A disagreement is judged by an fp64 run of the Dynamo graph (``screen.compiled_is_worse``):

- the compiled result is further from fp64 than the Dynamo graph's: the graph AOT Autograd traced
  is at fault. A ``dynamo_graph`` fallback (reported, logged; ``guard="strict"`` raises), the call
  returns the Dynamo graph's result -- run again, with autograd, on the caller's inputs, so that
  this call's gradients are the Dynamo graph's too -- and the unit runs the Dynamo graph eagerly
  from then on;
- otherwise nobody is blamed (the Dynamo graph is the outlier, or no fp64 run exists): counted in
  the report (``guard.dynamo_reference_outlier``), compiled result kept.

Not covered: gradients are not compared with the Dynamo graph's (its backward would need the
caller's cotangents, which exist only later). A decomposition whose forward is right but whose
backward is wrong is not seen here; the per-graph check compares the compiled backward with the
eager copy's, which has the same decomposition. A unit that draws random numbers is not compared
(the RNG moves during its compiled call; random draws differ by design), nor one whose Dynamo graph
cannot run on fake tensors or eagerly (logged once, counted as ``guard.dynamo_reference_off``).

Cost: on a sampled call, one eager run of the Dynamo graph without autograd and a copy of the
inputs it writes; an fp64 run only when the two disagree; once per unit, a run on fake tensors
that finds the inputs the graph writes. Unsampled calls add a counter and a comparison.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

import torch
import torch.fx as fx

from .. import compat
from ..report import FallbackKind, report
from .calls import LADDER, EnnGuardError, RngSnapshot, distributed, flat_args
from .graph_edit import LOW_PRECISION, retarget_dtypes
from .screen import compiled_is_worse, diverging, outputs

log = logging.getLogger(__name__)


def fp64_dynamo_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """Copy of a Dynamo graph that computes in fp64 what it computed in a narrower float dtype
    (its callers cast its floating inputs up): dtype arguments and ``.float()``-style casts are
    retargeted; autocast regions are left as they are (autocast never casts fp64 tensors)."""
    new = compat.copy_dynamo_graph(gm)
    narrower = (torch.float16, torch.bfloat16, torch.float32)
    for n in new.graph.nodes:
        if n.op not in ("call_function", "call_method") or "autocast" in str(n.target):
            continue
        n.args = retarget_dtypes(n.args, narrower, torch.float64)
        n.kwargs = {k: retarget_dtypes(v, narrower, torch.float64) for k, v in n.kwargs.items()}
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


def _floats(a: Any, b: Any) -> bool:
    return all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in (a, b))


class DynamoReference:
    """Wraps one unit's compiled callable, called as Dynamo calls it (boxed or not: calls.flat_args)."""

    def __init__(self, compiled: Callable[..., Any], gm: fx.GraphModule, opts: Any, unit: str) -> None:
        self.compiled, self.gm, self.opts, self.unit = compiled, gm, opts, unit
        self.calls = 0
        self.written: list[int] | None = None  # inputs the Dynamo graph writes into (its first check)
        self.on = True  # off for a unit that draws random numbers or whose reference cannot run
        self.eager = False  # after a fault: the unit runs the Dynamo graph
        self.low_precision = _low_precision(gm)
        self.values_every = opts.guard_values
        self.every_value = opts.guard.checks_every_value
        # the first call that is not a bare call of the compiled unit (a sampled one, or every
        # call once the unit runs eagerly); the calls before it cost one comparison
        self.due = 1

    @classmethod
    def wrap(cls, compiled: Callable[..., Any], gm: fx.GraphModule, opts: Any, unit: str) -> Callable[..., Any]:
        """``compiled`` behind this check where the guard compares values at all (not under
        torch.distributed, where ranks must run the same graphs: asked on each sampled call)."""
        checks = opts.guard.checks_outputs and (opts.guard_values > 0 or opts.guard.checks_every_value)
        return cls(compiled, gm, opts, unit) if checks else compiled

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
        report().count("guard.dynamo_reference_off")
        log.info("enn: unit %s: no Dynamo-graph reference from now on: %s", self.unit, why)

    def _run(self, gm: fx.GraphModule, flat: list, before: dict[int, torch.Tensor],
             fp64: bool = False) -> tuple[list, BaseException | None]:
        """``gm`` on the call's inputs as they were before it (copies of those it writes), without
        autograd; its outputs followed by what it wrote."""
        def arg(i: int, x: Any) -> Any:
            x = before[i].clone() if i in before else x
            return x.detach().double() if fp64 and isinstance(x, torch.Tensor) and x.is_floating_point() else x

        inputs = [arg(i, x) for i, x in enumerate(flat)]
        try:
            with torch.no_grad():
                out = list(outputs(gm(*inputs)))
        except Exception as exc:  # noqa: BLE001 - a reference that cannot run judges nothing
            return [], exc
        return out + [inputs[i] for i in self.written or []], None

    def _check(self, args: tuple, flat: list) -> Any:
        rng = RngSnapshot()
        if self.written is None:
            try:
                self.written = compat.inputs_written(self.gm, flat)
            except Exception as exc:  # noqa: BLE001
                self._off(f"its Dynamo graph does not run on fake tensors ({type(exc).__name__}: {exc})")
                return self.compiled(*args)
            finally:
                rng.restore()
        with torch.no_grad():
            before = {i: flat[i].clone() for i in self.written}
        out = self.compiled(*args)
        if rng.moved():
            self._off("it draws random numbers, which differ from eager's by design")
            return out
        ref, exc = self._run(self.gm, flat, before)
        rng.restore()
        got = list(outputs(out)) + [flat[i] for i in self.written]
        if exc is not None or len(ref) != len(got):
            self._off(f"its Dynamo graph raised when run eagerly ({type(exc).__name__}: {exc})" if exc is not None
                      else f"it returns {len(got)} results, its Dynamo graph {len(ref)}")
            return out
        # enn's precision passes may return a float result wider than the model's (fp32_tail's fp32
        # logits): dtypes are the eager copy's to judge (the guard's value check); this reference
        # judges values, in the compiled result's dtype
        ref = [r.to(g.dtype) if _floats(g, r) and g.dtype != r.dtype else r for g, r in zip(got, ref)]
        with torch.no_grad():
            off = diverging(got, ref, self.low_precision)
            wrong = bool(off) and self._compiled_is_wrong(flat, before, got, ref, off)
        if not wrong:
            if off:
                report().count("guard.dynamo_reference_outlier")
                log.info("enn: unit %s: results %s differ from the Dynamo graph's, which is no closer to fp64: kept",
                         self.unit, off)
            return out
        return self._fault(flat, before, got, off)

    def _compiled_is_wrong(self, flat: list, before: dict[int, torch.Tensor], got: list, ref: list,
                           off: list[int]) -> bool:
        ref64, exc = self._run(fp64_dynamo_graph(self.gm), flat, before, fp64=True)
        if exc is not None or len(ref64) != len(ref):
            log.info("enn: unit %s: no fp64 run of the Dynamo graph to judge a value difference (%s); nobody blamed",
                     self.unit, f"{type(exc).__name__}: {exc}" if exc is not None else "other outputs")
            return False
        return any(compiled_is_worse(got[i], ref[i], ref64[i], self.low_precision) for i in off)

    def _fault(self, flat: list, before: dict[int, torch.Tensor], got: list, off: list[int]) -> Any:
        n_out = len(got) - len(self.written or [])
        where = ", ".join(f"output {i}" if i < n_out else f"input {self.written[i - n_out]} (written in place)"
                          for i in off[:6])
        what = (f"the compiled result and enn's eager copy (the graph AOT Autograd traced, decompositions applied) "
                f"differ from the graph Dynamo handed over ({where}), and an fp64 run sides with Dynamo's graph")
        if self.opts.guard.raises:
            raise EnnGuardError(f"enn (guard=strict): unit {self.unit}: {what}. Set guard='nonfinite' to fall back "
                                "automatically.")
        with LADDER:
            report().add_fallback(FallbackKind.DYNAMO_GRAPH, node="<graph>", phase="forward", graph=self.unit,
                                  reason=what, action="returned the Dynamo graph's result (gradients through its "
                                  "eager ops); the unit runs the Dynamo graph eagerly from now on")
            self.eager, self.due = True, 0
            with torch.no_grad():
                for i, saved in before.items():
                    flat[i].copy_(saved)
            return self.gm(*flat)  # with autograd, on the caller's inputs: its writes land there
