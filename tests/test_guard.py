"""The runtime guard: injected faults in every phase, the model's own NaN, persistence, strict mode."""

from __future__ import annotations

import json
import operator
import os
import subprocess
import sys
import textwrap

import pytest

import torch

import enn_backend
from enn_backend.guard.calls import EnnGuardError

from _models import assert_close_step, make, train_step

# The guard is tested on its own: the pattern passes are off so graphs keep plain ATen ops.
ISOLATED = {"attention": False, "epilogue": False, "persist": False}
# One op per model and phase that occurs a few times only (keeps bisection short).
FAULT_OP = {
    ("mlp", "fwd"): "aten.addmm", ("mlp", "bwd"): "aten.mm", ("mlp", "compile"): "aten.addmm",
    ("block", "fwd"): "aten.erf", ("block", "bwd"): "aten.erf", ("block", "compile"): "aten.erf",
}
GRAPH_PHASE = {"fwd": "forward", "bwd": "backward", "compile": "compile"}


# Every kind in the run-time phases; a compile fault raises in the lowering whatever its kind
# (FaultSpec.planted_kind plants "compile"), so one kind stands for the three there.
FAULT_CASES = [(kind, phase) for phase in ("fwd", "bwd") for kind in ("raise", "nan", "inf")] + [("raise", "compile")]


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_kind", ["mlp", "block"])
@pytest.mark.parametrize("kind,phase", FAULT_CASES, ids=[f"{k}-{p}" for k, p in FAULT_CASES])
def test_fault_matrix(kind, phase, model_kind, dtype):
    op = FAULT_OP[(model_kind, phase)]
    model, x = make(model_kind)
    compiled = torch.compile(model, backend="enn", options={**ISOLATED, "fault_inject": f"{op}:{kind}:{phase}"})
    for _ in range(3):  # the first step meets the fault; later steps must not meet it again
        assert_close_step(train_step(model, x, compiled, dtype), train_step(model, x, autocast=dtype), dtype)

    rep = enn_backend.report().to_dict()
    # a pin is keyed by kernel, so a later graph with the same kernel starts pinned ("pinned_from_state")
    fallbacks = [f for f in rep["fallbacks"] if f["kind"] != "pinned_from_state"]
    if phase == "compile":  # a lowering fault hits every graph holding the op (forward and backward)
        assert fallbacks and all(f["kind"] == "compile_error" and f["phase"] == "compile" for f in fallbacks)
        assert all(f["node"] == op.split(".")[1] for f in fallbacks), fallbacks
        for fb in fallbacks:
            assert next(g for g in rep["graphs"] if g["id"] == fb["graph"])["path"] == "inductor-without-enn"
        return
    assert len(fallbacks) == 1, fallbacks
    fb = fallbacks[0]
    expected_kind = {"raise": "exception"}.get(kind, "nonfinite") if phase != "compile" else "compile_error"
    assert fb["kind"] == expected_kind
    assert fb["phase"] == GRAPH_PHASE[phase]
    assert fb["node"] and fb["node"] != "<graph>" and fb["reason"] and fb["action"]
    graphs = {g["phase"]: g for g in rep["graphs"]}
    g = graphs[GRAPH_PHASE[phase]]
    assert g["counters"]["faults"] == 1 and g["counters"]["calls"] == 3  # faulty fast path ran once
    assert set(fb["node"].split(",")) == set(g["pinned"])
    assert g["counters"]["pinned_in_graph"] == len(g["pinned"])  # really routed through enn::pinned
    assert all(name.startswith(op.split(".")[1]) for name in g["pinned"]), g["pinned"]
    assert 0 < g["compiled_nodes"] == g["compute_nodes"] - len(g["pinned"])


def test_enns_inductor_defaults_yield_to_options_and_to_a_failed_compile(monkeypatch):
    """enn compiles a graph with its Inductor defaults for the graph's device (combo kernels on
    CUDA) unless options= sets the key or Inductor lacks it; a graph that does not compile with them is compiled
    without them, keeping enn's rewrites, and the step down is recorded."""
    from enn_backend import compat

    # the graphs must be compiled here, not loaded: AOT Autograd's cache key does not hold the
    # defaults enn patches in per graph, and an earlier test of the session may have cached this mlp
    with compat.no_aot_autograd_cache():
        _defaults_yield_to_options_and_to_a_failed_compile(monkeypatch)


def _defaults_yield_to_options_and_to_a_failed_compile(monkeypatch) -> None:
    from enn_backend import compat, graph_compiler

    # a key this torch's Inductor does not have is left out (defaults may name newer keys)
    monkeypatch.setitem(graph_compiler.INDUCTOR_DEFAULTS, "cpu", {"combo_kernels": True, "no_such_key": 1})
    real, seen = compat.compile_fx_inner, []

    def compile_fx_inner(gm, inputs, **kwargs):
        seen.append(compat.inductor_config.combo_kernels)
        if compat.inductor_config.combo_kernels:
            raise RuntimeError("combo kernels cannot compile this graph")
        return real(gm, inputs, **kwargs)

    monkeypatch.setattr(compat, "compile_fx_inner", compile_fx_inner)
    model, x = make("mlp")
    compiled = torch.compile(model, backend="enn", options=ISOLATED)
    assert_close_step(train_step(model, x, compiled), train_step(model, x))
    rep = enn_backend.report().to_dict()
    assert seen == [True, False, True, False]  # forward, then backward: with the defaults, then without
    assert [f["kind"] for f in rep["fallbacks"]] == ["compile_error"] * 2, rep["fallbacks"]
    for fb in rep["fallbacks"]:
        assert "combo kernels cannot compile" in fb["reason"]
        assert fb["action"] == "recompiled this graph without enn's Inductor defaults (combo_kernels=True)"
        assert next(g for g in rep["graphs"] if g["id"] == fb["graph"])["path"] == "inductor"

    torch._dynamo.reset()
    enn_backend.reset()
    seen.clear()
    compiled = torch.compile(model, backend="enn", options={**ISOLATED, "combo_kernels": False})
    assert_close_step(train_step(model, x, compiled), train_step(model, x))
    assert seen == [False, False] and not enn_backend.report().to_dict()["fallbacks"]


def test_enns_compile_fx_defaults_give_every_graph_a_cpp_wrapper(monkeypatch):
    """enn's compile_fx defaults (cpp_wrapper on CUDA; here on the CPU) reach every graph's first
    build: an inference graph, a training forward and its backward -- never a graph under CUDA
    graphs. A rung without enn's defaults, and the guard's recompiles after a fault, go without.
    On a torch that tunes the C++ wrapper's kernels on the real inputs (2.11), the backward is
    built on its first call, with that call's inputs at hand; the values are eager's either way."""
    from enn_backend import compat, graph_compiler

    monkeypatch.setitem(graph_compiler.INDUCTOR_DEFAULTS, "cpu", {})
    monkeypatch.setitem(graph_compiler.COMPILE_FX_DEFAULTS, "cpu", {"cpp_wrapper": True})
    real, seen, at_hand, fail = compat.compile_fx_inner, [], [], []

    def compile_fx_inner(gm, inputs, **kwargs):
        seen.append(kwargs.get("cpp_wrapper", False))
        at_hand.append(compat.real_inputs_at_hand())
        if fail and seen[-1]:
            raise RuntimeError("no C++ wrapper for this graph")
        return real(gm, inputs, **kwargs)

    def compile_and_run(options, grad=False):
        torch._dynamo.reset()
        enn_backend.reset()
        seen.clear()
        at_hand.clear()
        compiled = torch.compile(model, backend="enn", options={**ISOLATED, **options})
        with compat.no_aot_autograd_cache():  # every run compiles
            if grad:
                assert_close_step(train_step(model, x, compiled), train_step(model, x))
            else:
                with torch.no_grad():
                    for _ in range(2):
                        torch.testing.assert_close(compiled(x), model(x))
        return enn_backend.report().to_dict()

    monkeypatch.setattr(compat, "compile_fx_inner", compile_fx_inner)
    model, x = make("mlp")
    rep = compile_and_run({})
    assert seen == [True] and not rep["fallbacks"] and rep["graphs"][0]["path"] == "inductor"
    with monkeypatch.context() as m:  # a torch that compiles the kernels on the first call (2.12+)
        m.setattr(compat, "cpp_wrapper_tunes_on_real_inputs", lambda: False)
        compile_and_run({}, grad=True)
        assert seen == [True, True] and at_hand == [True, False]  # AOT compiles a backward on fake inputs
    with monkeypatch.context() as m:  # one that tunes them on the real inputs (2.11)
        m.setattr(compat, "cpp_wrapper_tunes_on_real_inputs", lambda: True)
        rep = compile_and_run({}, grad=True)
        assert seen == [True, True] and at_hand == [True, True]  # the backward's: on its first call
        assert [g["path"] for g in rep["graphs"]] == ["inductor", "inductor"] and not rep["fallbacks"]
        compile_and_run({"guard": "off"}, grad=True)  # AOT donates the backward's inputs: no tuning run on them
        assert seen == [True, False]
    compile_and_run({"mode": "reduce-overhead"})
    assert seen == [False]

    fail.append(True)
    rep = compile_and_run({})
    assert seen == [True, False]
    assert [f["action"] for f in rep["fallbacks"]] == [
        "recompiled this graph without enn's Inductor defaults (cpp_wrapper=True)"]
    fail.clear()

    rep = compile_and_run({"fault_inject": f"{FAULT_OP[('mlp', 'fwd')]}:nan:fwd"})
    assert seen[0] is True and len(seen) > 1 and not any(seen[1:]), seen  # then the guard's recompiles
    assert [f["kind"] for f in rep["fallbacks"] if f["kind"] != "pinned_from_state"] == ["nonfinite"]


def test_device_builds_skip_the_cpu_isa_probe_where_inductor_runs_it(monkeypatch):
    """torch 2.11's CppCodeCache.load_async probes the CPU's vector ISAs (a test build per ISA,
    each loaded by a new Python process) before any C++ build: 40-45 s per process on the H100
    host. Inside enn's compiles -- a unit's, and a graph's build on its first call -- a build of
    device code without a CPU vector kernel (a CUDA graph's C++ wrapper) goes without it, as
    torch 2.13 decides; CPU code and vector kernels keep it, and everything is put back after."""
    from torch._inductor import codecache
    from torch._inductor.cpu_vec_isa import invalid_vec_isa

    from enn_backend import compat, graph_compiler

    probes, isas = [], []
    monkeypatch.setattr(compat.inductor, "inductor_probes_vec_isa_only_for_cpu_code", lambda: False)  # 2.11

    def load_async(cls, main_code, device_type="cpu", submit_fn=None, extra_flags=(), optimized_code=None):
        isas.append(codecache.pick_vec_isa())
        return cls

    with monkeypatch.context() as m:
        m.setattr(codecache, "pick_vec_isa", lambda: probes.append(1) or "avx512")
        m.setattr(codecache.CppCodeCache, "load_async", classmethod(load_async))
        with compat.device_builds_skip_vec_isa_probe():
            with compat.device_builds_skip_vec_isa_probe():  # re-entrant: one swap
                assert codecache.CppWrapperCodeCache.load_async("void call() {}", "cuda") is codecache.CppWrapperCodeCache
            codecache.CppCodeCache.load_async("void call() {}", device_type="cuda:0")
            codecache.CppCodeCache.load_async("at::vec::Vectorized<float> v;", device_type="cuda")
            codecache.CppCodeCache.load_async("void call() {}", device_type="cuda", optimized_code="prod_masked_reduce(")
            codecache.CppCodeCache.load_async("void call() {}", "cpu")
        assert isas == [invalid_vec_isa, invalid_vec_isa, "avx512", "avx512", "avx512"] and len(probes) == 3
        assert codecache.CppCodeCache.__dict__["load_async"].__func__ is load_async  # put back
        with monkeypatch.context() as newer:  # a torch that decides itself: nothing swapped
            newer.setattr(compat.inductor, "inductor_probes_vec_isa_only_for_cpu_code", lambda: True)
            with compat.device_builds_skip_vec_isa_probe():
                codecache.CppCodeCache.load_async("void call() {}", "cuda")
            assert isas[-1] == "avx512"
        assert codecache.pick_vec_isa() == "avx512"

    # enn's compiles run inside the swap: the unit's compile, and a backward built on its first call
    monkeypatch.setattr(compat, "cpp_wrapper_tunes_on_real_inputs", lambda: True)
    monkeypatch.setitem(graph_compiler.COMPILE_FX_DEFAULTS, "cpu", {"cpp_wrapper": True})
    real, swapped = compat.compile_fx_inner, []

    def compile_fx_inner(gm, inputs, **kwargs):
        swapped.append(getattr(codecache.CppCodeCache.__dict__["load_async"].__func__, "_enn_skips_probe", False))
        return real(gm, inputs, **kwargs)

    monkeypatch.setattr(compat, "compile_fx_inner", compile_fx_inner)
    torch._dynamo.reset()
    model, x = make("mlp")
    with compat.no_aot_autograd_cache():
        assert_close_step(train_step(model, x, torch.compile(model, backend="enn", options=ISOLATED)),
                          train_step(model, x))
    assert swapped == [True, True] and not getattr(codecache.CppCodeCache.load_async, "_enn_skips_probe", False)


def test_a_planted_compile_fault_skips_the_rung_without_enns_inductor_defaults(monkeypatch):
    """A fault planted in the graph fails every rung that holds it: the step down goes straight to
    the rung without enn's rewrites, blaming the op once per graph."""
    from enn_backend import graph_compiler

    monkeypatch.setitem(graph_compiler.INDUCTOR_DEFAULTS, "cpu", {"combo_kernels": True})
    op = FAULT_OP[("mlp", "compile")]
    model, x = make("mlp")
    compiled = torch.compile(model, backend="enn", options={**ISOLATED, "fault_inject": f"{op}:raise:compile"})
    assert_close_step(train_step(model, x, compiled), train_step(model, x))
    rep = enn_backend.report().to_dict()
    fallbacks = [f for f in rep["fallbacks"] if f["kind"] != "pinned_from_state"]
    assert fallbacks and all(f["node"] == op.split(".")[1] for f in fallbacks), fallbacks
    assert all(f["action"] == "recompiled this graph without enn's rewrites and lowerings" for f in fallbacks)
    for fb in fallbacks:  # one record per graph holding the op
        assert next(g for g in rep["graphs"] if g["id"] == fb["graph"])["path"] == "inductor-without-enn"
    assert len({fb["graph"] for fb in fallbacks}) == len(fallbacks)


def test_models_own_nan_keeps_the_compiled_result_and_blames_nothing():
    """Eager makes the same NaN at the same places: nothing fell back, nothing is reported as a
    fallback, the compiled outputs are returned (counted on the graph)."""
    class LogModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.log(self.lin(x)) * 2.0

    torch.manual_seed(0)
    model, x = LogModel(), torch.randn(4, 8)
    compiled = torch.compile(model, backend="enn", options=ISOLATED)
    with torch.no_grad():
        got, ref = compiled(x), model(x)
    assert torch.isnan(ref).any() and not torch.isnan(ref).all()
    torch.testing.assert_close(got, ref, equal_nan=True)
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    rep = enn_backend.report().to_dict()
    assert rep["fallbacks"] == []
    assert rep["graphs"][0]["counters"]["model_nonfinite"] == 1 and rep["graphs"][0]["pinned"] == []


def test_precision_fault_retries_in_fp32():
    class Overflow(torch.nn.Module):
        def forward(self, x):
            h = x.to(torch.float16)
            y = h @ h  # 4 * 300 * 300 = 360000 > fp16 max (65504): the matmul's fp16 output is inf
            return (y / 1000.0).to(torch.float32)

    x = torch.full((4, 4), 300.0)
    assert torch.isinf(Overflow()(x)).all()  # eager overflows too
    compiled = torch.compile(Overflow(), backend="enn", options=ISOLATED)
    with torch.no_grad():
        got = compiled(x)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, torch.full((4, 4), 360.0), rtol=1e-3, atol=0)
        again = compiled(x)  # sticky: the fp32 graph is the fast path now
    assert torch.isfinite(again).all()
    rep = enn_backend.report().to_dict()
    assert [f["kind"] for f in rep["fallbacks"]] == ["precision"]
    assert rep["graphs"][0]["counters"]["faults"] == 1


def test_strict_mode_raises_naming_graph_node_phase():
    model, x = make("mlp")
    compiled = torch.compile(model, backend="enn", options={**ISOLATED, "guard": "strict", "fault_inject": "aten.addmm:nan:fwd"})
    with pytest.raises(EnnGuardError, match=r"g0/forward.*phase forward.*at fc1 \(_models.py:\d+, in forward\) \[addmm\]"):
        compiled(x)


def test_guard_off_lets_the_fault_through():
    model, x = make("mlp")
    compiled = torch.compile(model, backend="enn", options={**ISOLATED, "guard": "off", "fault_inject": "aten.addmm:nan:fwd"})
    with torch.no_grad():
        assert torch.isnan(compiled(x)).all()
    assert enn_backend.report().to_dict()["fallbacks"] == []


def test_exceptions_mode_ignores_nan_but_catches_raise():
    model, x = make("mlp")
    compiled = torch.compile(model, backend="enn", options={**ISOLATED, "guard": "exceptions", "fault_inject": "aten.addmm:raise:fwd"})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    assert [f["kind"] for f in enn_backend.report().to_dict()["fallbacks"]] == ["exception"]


def test_input_mutation_is_applied_once_on_rerun():
    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.register_buffer("seen", torch.zeros(8))

        def forward(self, x):
            self.seen.add_(x.sum(0))
            return self.lin(x)

    torch.manual_seed(0)
    model, x = Counting(), torch.randn(4, 8)
    ref_model = Counting()
    ref_model.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="enn", options={**ISOLATED, "fault_inject": "aten.addmm:nan:fwd"})
    for _ in range(2):
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), ref_model(x))
    torch.testing.assert_close(model.seen, ref_model.seen)  # two adds, not three
    assert enn_backend.report().to_dict()["fallbacks"][0]["kind"] == "nonfinite"


# ----------------------------------------------------------------------------- persistence
_PERSIST_SCRIPT = textwrap.dedent(
    """
    import json, torch, enn_backend
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(4, 8)
    f = torch.compile(m, backend="enn", options={"attention": False, "epilogue": False})
    with torch.no_grad():
        y = f(x)
    assert torch.isfinite(y).all()
    print(json.dumps(enn_backend.report().to_dict()["fallbacks"]))
    """
)


def _run_persist(cache_dir, extra_env=None):
    env = {**os.environ, "ENN_CACHE_DIR": str(cache_dir), "ENN_FAULT_INJECT": "aten.addmm:nan:fwd", **(extra_env or {})}
    out = subprocess.run([sys.executable, "-c", _PERSIST_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_second_process_starts_with_pinned_state(tmp_path):
    first, _ = _run_persist(tmp_path)
    assert [f["kind"] for f in first] == ["nonfinite"]
    state_files = list(tmp_path.glob("kernel_state-inject-*.json"))
    assert len(state_files) == 1 and not (tmp_path / "kernel_state.json").exists()
    entries = json.loads(state_files[0].read_text())["entries"]
    assert {e["action"] for e in entries} == {"pinned"} and all(e["fail_count"] == 1 for e in entries)
    second, _ = _run_persist(tmp_path)
    assert [f["kind"] for f in second] == ["pinned_from_state"], second  # no fault met again


@pytest.mark.parametrize("content", ["{\"format\": \"enn-kernel-state\", \"vers", "garbage\x00\x01",
                                     "{\"format\": \"enn-kernel-state\", \"version\": 1, \"entries\": [{\"key\": 1}]}"],
                         ids=["truncated", "garbage", "bad-entry"])
def test_corrupt_state_file_is_survived_with_one_warning(tmp_path, content, monkeypatch, caplog):
    """_PERSIST_SCRIPT's program, run in this process (the fixtures start it with no state
    loaded, as a new process starts): the bad file is read, warned about once, and ignored."""
    import logging

    from enn_backend.guard.kernel_state import state_path
    from enn_backend.options import Options

    path = state_path(Options(cache_dir=str(tmp_path), fault_inject="aten.addmm:nan:fwd"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(content)
    monkeypatch.setenv("ENN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ENN_FAULT_INJECT", "aten.addmm:nan:fwd")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(4, 8)
    f = torch.compile(m, backend="enn", options={"attention": False, "epilogue": False})
    with caplog.at_level(logging.WARNING, logger="enn_backend"), torch.no_grad():
        y = f(x)
    assert torch.isfinite(y).all()
    fallbacks = enn_backend.report().to_dict()["fallbacks"]
    assert [f["kind"] for f in fallbacks] == ["nonfinite"]  # started with no recorded faults
    warned = [r.getMessage() for r in caplog.records if "ignoring kernel state file" in r.getMessage()]
    assert len(warned) == 1, warned


def test_legit_inf_outputs_are_learned_once():
    class MaskedScores(torch.nn.Module):
        """Returns attention scores with an additive -inf causal mask, as eager does."""

        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            t = x.shape[0]
            return self.lin(x) @ x.t() + torch.full((t, t), float("-inf")).triu(1)

    torch.manual_seed(0)
    model, x = MaskedScores(), torch.randn(6, 8)
    compiled = torch.compile(model, backend="enn", options=ISOLATED)
    with torch.no_grad():
        for _ in range(4):
            torch.testing.assert_close(compiled(x), model(x))
    rep = enn_backend.report().to_dict()
    g = rep["graphs"][0]
    assert g["counters"]["checks"] == 4 and g["counters"].get("eager_reruns", 0) == 1, g["counters"]
    assert rep["fallbacks"] == []  # the -inf eager makes too is not a fallback


_LATE_FAULT = {"on": False}


@torch.library.custom_op("enntest::late_fault", mutates_args=())
def _late_fault(x: torch.Tensor) -> torch.Tensor:
    if _LATE_FAULT["on"]:
        raise RuntimeError("injected late kernel failure")
    return x * 2


@_late_fault.register_fake
def _(x):
    return torch.empty_like(x)


def test_exception_on_unchecked_call_is_recorded_and_reraised():
    """Past its warm-up the guard keeps no references to a graph's inputs (the compiled code
    frees them as it goes), so an exception on an unchecked call cannot be re-run eagerly: it is
    recorded, raised to the caller, and the warm-up (checking every call) starts again."""
    def f(x):
        return _late_fault(x + 1).sum()

    compiled = torch.compile(f, backend="enn", options={**ISOLATED, "guard_warmup": 2, "guard_every": 1000})
    x = torch.randn(4)
    with torch.no_grad():
        for _ in range(4):  # calls 1-2 checked, 3-4 not
            compiled(x)
        _LATE_FAULT["on"] = True
        try:
            with pytest.raises(RuntimeError, match="injected late kernel failure"):
                compiled(x)
        finally:
            _LATE_FAULT["on"] = False
        g = enn_backend.report().to_dict()["graphs"][0]
        checks = g["counters"]["checks"]
        compiled(x)
    rep = enn_backend.report().to_dict()
    (fb,) = rep["fallbacks"]
    assert fb["kind"] == "exception" and "did not check" in fb["reason"], fb
    assert rep["graphs"][0]["counters"]["checks"] == checks + 1  # checking again from the next call


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_steady_state_screen_on_gpu_is_read_late_then_every_call_is_checked():
    """Past the warm-up, a sampled call of a GPU graph is screened on the device and read back
    without a sync. A NaN found there is reported after its call returned; the warm-up restarts,
    and the next call meets the fault on the synchronous path, which fixes and localizes it."""
    import gc

    from enn_backend.guard.runtime import GuardedGraph

    model, x = make("mlp")
    model, x = model.cuda(), x.cuda()
    compiled = torch.compile(model, backend="enn", options={**ISOLATED, "guard_warmup": 2, "guard_every": 4})
    with torch.no_grad():
        want = model(x)
        for _ in range(3):  # calls 1-2 checked synchronously, 3 not checked
            compiled(x)
        (record,) = enn_backend.report().graphs
        guard = next(o for o in gc.get_objects() if type(o) is GuardedGraph and o.record is record)
        assert guard.screen_later
        kernels = guard.compiled
        guard.compiled = lambda args: [torch.full_like(t, float("nan")) for t in kernels(args)]  # a kernel gone bad
        late = compiled(x)  # call 4: sampled, screened on the device, returned as computed
        torch.cuda.synchronize()
        assert torch.isnan(late).all() and [f["kind"] for f in enn_backend.report().to_dict()["fallbacks"]] == []
        fixed = compiled(x)  # call 5: reads the screen, checks synchronously, re-runs eagerly
    torch.testing.assert_close(fixed, want)
    kinds = [f["kind"] for f in enn_backend.report().to_dict()["fallbacks"]]
    assert kinds == ["nonfinite_late", "nonfinite"], kinds
    assert "call 4" in enn_backend.report().to_dict()["fallbacks"][0]["reason"]


# ----------------------------------------------------------------------------- flaky kernels
def test_intermittent_fault_grammar():
    from enn_backend.fault_spec import FaultSpec, FaultSpecError, parse_fault_specs
    from enn_backend.guard.faults import parse_fault_spec
    from enn_backend.options import Options, OptionsError

    (spec,) = parse_fault_spec("aten.addmm:nan@3:fwd")
    assert spec == FaultSpec("aten.addmm", "nan", "fwd", every=3) and spec.text == "aten.addmm:nan@3:fwd"
    assert parse_fault_spec("aten.mm:raise")[0].every == 1
    for bad, why in [("aten.mm:nan@1", "at least 2"), ("aten.mm:nan@2.5", "integer"), ("aten.mm:nan@", "integer"),
                     ("aten.mm:raise@3:compile", "compile fault strikes once"), ("aten.mm:boom@3", "kind")]:
        with pytest.raises(FaultSpecError, match=why):
            parse_fault_specs(bad)
        with pytest.raises(OptionsError, match=why):  # Options validates its fault_inject
            Options(fault_inject=bad)


def test_intermittent_fault_op_counts_calls_per_site():
    import enn_backend.custom_ops  # noqa: F401  registers enn::fault

    x = torch.ones(3)
    hits = [bool(torch.isnan(torch.ops.enn.fault(x, "nan@3#t/forward/a")).all()) for _ in range(6)]
    assert hits == [False, False, True, False, False, True]
    assert not torch.isnan(torch.ops.enn.fault(x, "nan@3#t/forward/b")).any()  # another site: its own count
    assert torch.equal(torch.ops.enn.fault(x, "nan@3#t/forward/a"), x)
    with pytest.raises(ValueError, match="bad intermittent kind"):
        torch.ops.enn.fault(x, "nan@x#t/forward/a")


def test_localize_confirms_fault_free_trials_of_a_flaky_fault():
    """A pin set that leaves the culprit compiled faults on every 3rd run only. Trusting one
    fault-free run pins innocent nodes (the bisection follows the lucky runs); confirmed
    verdicts find exactly the culprit group, and the action says what the re-runs cost."""
    from enn_backend.guard.localize import localize

    groups = [["mm", "mm_1"], ["addmm", "addmm_1"], ["mul", "mul_1", "mul_2"], ["erf"], ["add"]]
    culprit = {"addmm", "addmm_1"}

    def flaky(runs):
        calls = {"n": 0}

        def still_faulty(pins):
            if culprit <= pins:
                return False
            calls["n"] += 1
            return calls["n"] % 3 == 0

        return localize(groups, still_faulty, budget=32, runs=runs)

    trusting = flaky(runs=1)
    assert set(trusting.pinned) != culprit  # what a single fault-free run leads to
    loc = flaky(runs=3)
    assert sorted(loc.pinned) == sorted(culprit), loc
    assert loc.reruns > 0 and any(f"{loc.reruns} confirming re-run(s)" in n for n in loc.notes)


def test_flaky_kernel_is_pinned_to_its_one_culprit(monkeypatch):
    """Every addmm returns NaN on every 3rd call: the guard meets it on the 3rd step, confirms
    its fault-free trials by re-running them (no recompile), pins the addmm nodes only, and
    every step equals eager's."""
    import re

    from enn_backend.graph_compiler import GraphCompiler

    trial_builds = []
    build = GraphCompiler.build

    def counting_build(self, *args, **kwargs):
        trial_builds.extend([1] if kwargs.get("quiet") else [])
        return build(self, *args, **kwargs)

    monkeypatch.setattr(GraphCompiler, "build", counting_build)
    model, x = make("mlp")
    compiled = torch.compile(model, backend="enn", options={**ISOLATED, "fault_inject": "aten.addmm:nan@3:fwd"})
    for _ in range(6):
        assert_close_step(train_step(model, x, compiled), train_step(model, x))
    rep = enn_backend.report().to_dict()
    (fb,) = rep["fallbacks"]
    fwd = next(g for g in rep["graphs"] if g["phase"] == "forward")
    assert fb["kind"] == "nonfinite" and fb["graph"] == fwd["id"], fb
    assert sorted(fwd["pinned"]) == ["addmm", "addmm_1"] == sorted(fb["node"].split(",")), fb
    assert fwd["counters"]["faults"] == 1 and fwd["counters"]["calls"] == 6
    trials, reruns = re.search(r"after (\d+) trial recompile.*; (\d+) confirming re-run", fb["action"]).groups()
    assert int(reruns) > 0 and len(trial_builds) == int(trials), (len(trial_builds), fb["action"])


# ----------------------------------------------------------------------------- fault_inject that plants nothing
def test_fault_inject_that_plants_nothing_is_reported_per_unit(caplog):
    """A spec that no graph of a compiled unit received is a WARNING and a report line with
    the likely reason, decided once the graphs its phase reaches are compiled: a fwd spec
    with the forward graph, a bwd/any spec with the (lazy) backward graph, or the inference
    graph (no backward will come). A spec planted in some graphs of the unit only is fine."""
    import logging

    def not_planted():
        return {f.reason.split("'")[1]: f for f in enn_backend.report().fallbacks if f.kind == "fault_not_planted"}

    model, x = make("mlp")
    specs = "aten.gelu:nan:fwd,aten.addmm:inf:bwd,aten.gleu:nan,aten.mm:nan"  # aten.mm: backward graph only
    compiled = torch.compile(model, backend="enn", options={**ISOLATED, "guard": "off", "fault_inject": specs})
    with caplog.at_level(logging.WARNING, logger="enn_backend"):
        out = compiled(x)
        assert list(not_planted()) == ["aten.gelu:nan:fwd"]  # the others wait for the backward graph
        out.square().mean().backward()
    lines = not_planted()
    assert sorted(lines) == ["aten.addmm:inf:bwd", "aten.gelu:nan:fwd", "aten.gleu:nan:any"]
    gelu, addmm, typo = lines["aten.gelu:nan:fwd"], lines["aten.addmm:inf:bwd"], lines["aten.gleu:nan:any"]
    assert gelu.graph == "g0/forward" and addmm.graph == typo.graph == "g0/backward"
    assert "decomposed before faults are planted" in gelu.reason and "aten.erf" in gelu.reason, gelu.reason
    assert "appears only in the forward graph" in addmm.reason, addmm.reason
    assert "no op aten.gleu is registered" in typo.reason, typo.reason
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "fault_not_planted" in r.getMessage()]
    assert len(warned) == 3 and all(any(spec in w for w in warned) for spec in lines), warned
    assert torch.isnan(model.fc1.weight.grad).all()  # aten.mm's fault really was planted (guard off lets it through)

    torch._dynamo.reset()  # an inference unit: a bwd spec is decided with its one graph
    compiled = torch.compile(model, backend="enn", options={**ISOLATED, "guard": "off",
                                                            "fault_inject": "aten.addmm:nan:bwd,aten.addmm:inf:fwd"})
    with torch.no_grad():
        assert torch.isinf(compiled(x)).all()
    bwd = not_planted()["aten.addmm:nan:bwd"]
    assert bwd.graph == "g1/inference" and "only in the inference graph" in bwd.reason, bwd.reason
    assert "aten.addmm:inf:fwd" not in not_planted()


def test_collectives_are_never_pinned():
    """A collective is no kernel the guard judges: pinning it (say, in the "pin everything" trial
    of a localization) would move a communication every rank must issue in the same order. Only
    the ops around it are candidates."""
    import torch.fx as fx

    from enn_backend.guard import graph_edit as E

    g = fx.Graph()
    x = g.placeholder("x")
    reduced = g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
    relu = g.call_function(torch.ops.aten.relu.default, (reduced,))
    g.output(relu)
    for n in (x, reduced, relu):
        n.meta["val"] = torch.zeros(4)
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert [n.target for n in E.candidate_nodes(gm)] == [torch.ops.aten.relu.default]


def test_ops_returning_more_than_tensors_are_never_pinned():
    """enn::pinned returns tensors only: CUDA flash / cuDNN SDPA also return SymInts (max_q,
    max_k) and None, so pinning them (the "pin everything" trial of a localization on any CUDA
    model calling SDPA) would fail to build. They stay compiled; the ops around them are candidates."""
    import torch.fx as fx

    from enn_backend.guard import graph_edit as E

    g = fx.Graph()
    q = g.placeholder("q")
    flash = g.call_function(torch.ops.aten._scaled_dot_product_flash_attention.default, (q, q, q))
    out = g.call_function(operator.getitem, (flash, 0))
    relu = g.call_function(torch.ops.aten.relu.default, (out,))
    g.output(relu)
    t = torch.zeros(1, 1, 4, 8)
    for n, v in ((q, t), (flash, (t, torch.zeros(1, 1, 4), None, None, 4, 4, t, t, t)), (out, t), (relu, t)):
        n.meta["val"] = v
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert [n.target for n in E.candidate_nodes(gm)] == [torch.ops.aten.relu.default]
