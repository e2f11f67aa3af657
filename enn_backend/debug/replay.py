"""What an enn repro script runs: enn's fast path against eager, with an fp64 referee.

A repro script (see :mod:`enn_backend.debug.repro`) defines the ATen graph inline as
a ``torch.nn.Module``, loads its inputs and calls :func:`run_repro`. The same check
(:func:`check`) is the minifier's predicate, so a repro and its minimized version
fail for the same reason:

- ``compile``    enn's compile of the graph raises (guard off: no fallback ladder)
- ``exception``  the compiled graph raises when run, while eager does not
- ``nonfinite``  the compiled output has NaN/Inf where eager's is finite
- ``accuracy``   compiled and eager differ beyond tolerance, and the compiled result
                 is further from an fp64 run than eager is (torch's ``same`` rule:
                 RMSE(compiled, fp64) > m * RMSE(eager, fp64) + tol/10, m = 2 for
                 fp32, 3 for fp16/bf16)

Exit codes of a repro script (:func:`run_repro`) are :data:`.repro.EXIT_CODES_DOC`: a verdict is
0, 3 or 4; 1 (and 2) are what Python itself exits with when a script fails (an uncaught
exception; a missing file or a bad command line), so a script that breaks before or
outside the check can never read as "the fault reproduces".
"""

from __future__ import annotations

import copy
import math
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .. import blame, compat
from ..fx_utils import retarget_dtypes
from ..graph_compiler import GraphCompiler
from ..guard.faults import parse_fault_spec
from ..guard.kernel_state import KernelState
from ..guard.runtime import GuardedGraph
from ..options import GuardMode, Options
from ..passes import PassManager
from ..report import report
# load_constants, load_inputs, regenerate: repro scripts import them from here
from .inputs import clone_input, load_constants, load_inputs, regenerate  # noqa: F401
from .repro import EXIT_FAULT, EXIT_OK, EXIT_SCRIPT_ERROR, EXIT_UNDECIDED

FAULT_KINDS = ("compile", "exception", "nonfinite", "accuracy")

# Tolerance (atol = rtol) per dtype for compiled vs eager, as torch's accuracy harness.
TOLERANCE = {torch.float64: 1e-7, torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-2}
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class Verdict:
    """The outcome of one check: ``failed`` is the predicate the minifier shrinks against."""

    kind: str  # compile | exception | nonfinite | accuracy | ok | eager_error
    message: str = ""
    details: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.kind in FAULT_KINDS

    @property
    def undecided(self) -> bool:
        return self.kind == "eager_error"


# ----------------------------------------------------------------------------- graphs
def trace(module: Callable[..., Any], inputs: Sequence[Any]) -> fx.GraphModule:
    """An ATen graph of ``module`` with fake ``meta['val']`` on every node (what enn compiles).

    Integer inputs are the graph's symbolic sizes: they are traced symbolically.
    """
    symbolic = any(isinstance(x, int) and not isinstance(x, bool) for x in inputs)
    with torch.no_grad():
        return compat.make_fx(module, tracing_mode="symbolic" if symbolic else "fake")(*inputs)


def fp64_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """Copy of ``gm`` in which every floating dtype argument names float64."""
    new = fx.GraphModule(gm, copy.deepcopy(gm.graph))

    for n in new.graph.nodes:
        if n.op == "call_function":
            retarget_dtypes(n, _FLOAT_DTYPES, torch.float64)
    new.recompile()
    return new


def _phase_kwargs(phase: str) -> dict[str, Any]:
    if phase == "backward":
        return {"is_backward": True}
    if phase == "inference":
        return {"is_inference": True}
    return {}


def resolve_options(options: dict[str, Any]) -> Any:
    """The saved options (ENN_* variables still win), set up for a replay: guard off for the
    fast path (compile errors raise), no persisted kernel state, no new repro scripts."""
    opts = Options.from_sources(options, inductor_config=compat.inductor_option_types())
    return opts.replace(guard=GuardMode.STRICT, persist=False, repro=False)


def fast_path(gm: fx.GraphModule, phase: str, opts: Any) -> Callable[[list], Any]:
    """Compile ``gm`` as enn compiles one forward/backward graph: enn's post-grad passes,
    lowerings and planted faults, without the runtime guard. Compile errors raise."""
    patches: dict[str, Any] = compat.inductor_config_patches(opts.mode, opts.inductor)
    patches["post_grad_custom_post_pass"] = PassManager(opts, "repro", "post_grad")
    if opts.emulate_precision_casts:
        patches["emulate_precision_casts"] = True
    fake_inputs = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    compiler = GraphCompiler(gm, fake_inputs, _phase_kwargs(phase), opts=opts, unit="repro",
                             config_patches=patches, fault_specs=parse_fault_spec(opts.fault_inject),
                             state=KernelState(None))
    return compiler.build()


# ----------------------------------------------------------------------------- comparing
def _flat(outs: Any) -> list[Any]:
    if isinstance(outs, (list, tuple)):
        return [t for o in outs for t in _flat(o)]
    return [outs]


def _rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.sqrt(torch.mean((a.double() - b.double()) ** 2))) if a.numel() else 0.0


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def compare(compiled: list[Any], eager: list[Any], ref: Callable[[], list[Any] | None]) -> Verdict:
    """Output-by-output comparison; ``ref()`` computes the fp64 outputs on demand."""
    if len(compiled) != len(eager):
        return Verdict("accuracy", f"compiled returns {len(compiled)} outputs, eager {len(eager)}")
    details: list[str] = []
    kind = "ok"
    ref_outs: list[Any] | None = None
    ref_done = False
    for i, (c, e) in enumerate(zip(compiled, eager)):
        if not isinstance(e, torch.Tensor) or not isinstance(c, torch.Tensor):
            if c != e and not (isinstance(c, float) and isinstance(e, float) and math.isclose(c, e)):
                details.append(f"output {i}: compiled {c!r}, eager {e!r}")
                kind = "accuracy" if kind == "ok" else kind
            continue
        if c.shape != e.shape or c.dtype != e.dtype:
            details.append(f"output {i}: compiled {_describe(c)}, eager {_describe(e)}")
            kind = "accuracy" if kind == "ok" else kind
            continue
        if not e.is_floating_point():
            if not torch.equal(c, e):
                details.append(f"output {i} {_describe(e)}: {int((c != e).sum())}/{e.numel()} elements differ")
                kind = "accuracy" if kind == "ok" else kind
            continue
        c_bad, e_bad = ~torch.isfinite(c), ~torch.isfinite(e)
        new_bad = c_bad & ~e_bad
        if bool(new_bad.any()):
            nans = int((torch.isnan(c) & ~e_bad).sum())
            details.append(f"output {i} {_describe(e)}: {int(new_bad.sum())}/{e.numel()} non-finite "
                           f"({nans} NaN) where eager is finite")
            kind = "nonfinite"
            continue
        tol = TOLERANCE.get(e.dtype, 1e-4)
        if torch.allclose(c, e, rtol=tol, atol=tol, equal_nan=True):
            continue
        ok = ~(c_bad | e_bad)
        max_diff = float((c[ok].double() - e[ok].double()).abs().max()) if bool(ok.any()) else float("nan")
        if not ref_done:
            ref_outs, ref_done = ref(), True
        r = ref_outs[i] if ref_outs is not None and i < len(ref_outs) else None
        if isinstance(r, torch.Tensor) and r.shape == e.shape:
            m = 2.0 if e.dtype == torch.float32 else 3.0
            r = r.to(torch.float64)
            err_c, err_e = _rmse(c[ok], r[ok]), _rmse(e[ok], r[ok])
            line = (f"output {i} {_describe(e)}: max |compiled - eager| = {max_diff:.3g}; "
                    f"RMSE vs fp64: compiled {err_c:.3g}, eager {err_e:.3g}")
            if err_c <= m * err_e + tol / 10:
                details.append(line + " (within tolerance of the fp64 reference)")
                continue
        else:
            line = f"output {i} {_describe(e)}: max |compiled - eager| = {max_diff:.3g} (tol {tol:g}; no fp64 reference)"
        details.append(line)
        if kind == "ok":
            kind = "accuracy"
    message = {"ok": "compiled output matches eager", "nonfinite": "compiled output has NaN/Inf where eager is finite",
               "accuracy": "compiled output differs from eager beyond tolerance"}[kind]
    return Verdict(kind, message, details)


def _run_eager(fn: Callable[..., Any], inputs: Sequence[Any]) -> tuple[list[Any] | None, BaseException | None]:
    try:
        with torch.no_grad():
            return _flat(fn(*[clone_input(x) for x in inputs])), None
    except Exception as exc:  # noqa: BLE001
        return None, exc


def _one_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    # Inductor wraps lowering errors; the cause's own message is the useful line.
    cause = exc.__cause__ or exc.__context__
    head = f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"
    if cause is not None and str(cause).strip() and str(cause).strip().splitlines()[0] not in head:
        head += f" (caused by {type(cause).__name__}: {str(cause).strip().splitlines()[0][:200]})"
    return head


def check(module: Callable[..., Any], inputs: Sequence[Any], *, phase: str, options: dict[str, Any],
          gm: fx.GraphModule | None = None) -> Verdict:
    """Run eager and enn's fast path on ``inputs``; say whether enn's fast path is at fault."""
    inputs = list(inputs)
    eager, eager_exc = _run_eager(module, inputs)
    if eager_exc is not None:
        return Verdict("eager_error", f"eager raises: {_one_line(eager_exc)}")
    opts = resolve_options(options)
    gm = gm if gm is not None else trace(module, inputs)
    try:
        compiled = fast_path(gm, phase, opts)
    except Exception as exc:  # noqa: BLE001
        return Verdict("compile", f"enn's compile raised {_one_line(exc)}")
    try:
        with torch.no_grad():
            outs = _flat(compiled([clone_input(x) for x in inputs]))
    except Exception as exc:  # noqa: BLE001
        return Verdict("exception", f"the compiled graph raised {_one_line(exc)}")

    def ref() -> list[Any] | None:
        ref_in = [x.to(torch.float64) if isinstance(x, torch.Tensor) and x.dtype in _FLOAT_DTYPES else x for x in inputs]
        out, exc = _run_eager(fp64_graph(gm), ref_in)
        return out

    return compare(outs, eager, ref)


# ----------------------------------------------------------------------------- the script's main
def run_repro(module: Any, inputs: Any, *, phase: str, options: dict[str, Any],
              expect: dict[str, Any] | None = None) -> int:
    """Run a repro and print what differs. Returns the exit code (:data:`.repro.EXIT_CODES_DOC`).

    ``module`` / ``inputs`` may be zero-argument functions that build them: a failure while
    building them (a corrupt inputs.pt, a bad ENN_* variable) is then the script's own
    failure (exit 1), never mistaken for the fault reproducing.
    """
    try:
        return _run_repro(module() if _is_builder(module) else module,
                          inputs() if callable(inputs) else inputs, phase=phase, options=options, expect=expect)
    except Exception as exc:  # noqa: BLE001 - anything outside the checked run is not the fault
        traceback.print_exc()
        print(f"SCRIPT ERROR: the repro itself failed, the fault was not checked: {_one_line(exc)} "
              f"(exit {EXIT_SCRIPT_ERROR})")
        return EXIT_SCRIPT_ERROR


def _is_builder(obj: Any) -> bool:
    return callable(obj) and not isinstance(obj, torch.nn.Module)


def _run_repro(module: Callable[..., Any], inputs: Sequence[Any], *, phase: str, options: dict[str, Any],
               expect: dict[str, Any] | None = None) -> int:
    expect = expect or {}
    shown = {k: v for k, v in options.items()}
    print(f"enn repro: {phase} graph, options {shown or '{}'}")
    if expect:
        at = blame.where(",".join(expect.get("nodes", [])) or "?", expect.get("sites") or [])
        print(f"  recorded fault: {expect.get('kind', '?')} at {at}" + (f" ({expect['what']})" if expect.get("what") else ""))
    t0 = time.perf_counter()
    verdict = check(module, inputs, phase=phase, options=options)
    print(f"  checked in {time.perf_counter() - t0:.1f}s: {verdict.kind}: {verdict.message}")
    for line in verdict.details:
        print(f"    {line}")
    if verdict.undecided:
        print(f"UNDECIDED: eager itself fails on these inputs (exit {EXIT_UNDECIDED})")
        return EXIT_UNDECIDED
    if verdict.failed:
        print(f"FAULT REPRODUCES ({verdict.kind}) (exit {EXIT_FAULT})")
        return EXIT_FAULT
    print(f"fault does not reproduce: enn's fast path agrees with eager (exit {EXIT_OK})")
    return EXIT_OK


# ----------------------------------------------------------------------------- the corpus' test
_FALLBACK_OF = {"compile": "compile_error", "exception": "exception", "nonfinite": "nonfinite"}


def guarded_problems(module: Callable[..., Any], inputs: Sequence[Any], *, phase: str, options: dict[str, Any],
                     expect: dict[str, Any], calls: int = 2) -> list[str]:
    """Run the graph the way enn runs it in a model (compiled, inside the runtime guard) and
    list what is wrong: the result differs from eager, or the report does not name the fault.

    Used by every ``minifier_repros/repro_*.py`` test; an empty list means enn handles it.
    """
    inputs = list(inputs)
    eager, eager_exc = _run_eager(module, inputs)
    if eager_exc is not None:
        return [f"eager raises: {_one_line(eager_exc)}"]
    opts = Options.from_sources(options, inductor_config=compat.inductor_option_types()).replace(persist=False, repro=False)
    if not opts.guard.guarded or opts.guard.raises:
        opts = opts.replace(guard=GuardMode.NONFINITE)
    gm = trace(module, inputs)
    patches: dict[str, Any] = compat.inductor_config_patches(opts.mode, opts.inductor)
    patches["post_grad_custom_post_pass"] = PassManager(opts, "corpus", "post_grad")
    fake_inputs = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    start = len(report().fallbacks)
    compiler = GraphCompiler(gm, fake_inputs, _phase_kwargs(phase), opts=opts, unit="corpus",
                             config_patches=patches, fault_specs=parse_fault_spec(opts.fault_inject))
    guarded = GuardedGraph(compiler, compiler.build(), compiler.record)
    problems: list[str] = []
    for i in range(calls):
        with torch.no_grad():
            outs = _flat(guarded([clone_input(x) for x in inputs]))
        v = compare(outs, eager, lambda: None)
        if v.kind != "ok":
            problems.append(f"call {i + 1}: guarded result differs from eager: {v.message}; " + "; ".join(v.details))
    fallbacks = report().fallbacks[start:]
    want = _FALLBACK_OF.get(expect.get("kind", ""), expect.get("kind", ""))
    hits = [f for f in fallbacks if f.kind == want]
    if not hits:
        problems.append(f"no {want!r} fallback in the report (got {[f.kind for f in fallbacks]})")
    named = set(expect.get("nodes", []))
    if named and not any(named & set(f.node.split(",")) for f in hits):
        problems.append(f"the report blames {[f.node for f in hits]}, not {sorted(named)}")
    return problems
