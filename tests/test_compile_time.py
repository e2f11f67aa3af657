"""Where compile time goes (enn_backend.compile_time), and the per-graph build choice
(enn_backend.build_choice): the rules as tables, and a real compile whose phases add up."""

from __future__ import annotations

import logging
import time

import pytest
import torch

import enn_backend
from enn_backend import build_choice, compat, graph_compiler
from enn_backend.compat.compile_events import Event, phase_of_event
from enn_backend.compile_time import attribute
from enn_backend.report import CompilePhase, GraphRecord, fallback_line, format_report


def _ev(name: str, start: int, end: int, outermost: bool = False) -> Event:
    return Event(name, start, end, outermost)


# ------------------------------------------------------------------ the rules as tables
@pytest.mark.parametrize("name, parent_phase, parent_name, cpp_wrapper, phase", [
    ("entire_frame_compile", "other", "", False, "dynamo"),
    ("bytecode_tracing", "dynamo", "compile_attempt_0", False, "dynamo"),  # not named: its parent's
    ("backend_compile", "dynamo", "compile_attempt_0", False, "aot_autograd"),
    ("entire_backward_compile", "other", "", False, "aot_autograd"),
    ("enn_backend.passes", "inductor", "_recursive_joint_graph_passes", False, "enn_passes"),
    ("pass.joint_graph_passes.joint_custom_pre_pass", "inductor", "x", False, "enn_passes"),
    ("enn_backend.compile_graph", "aot_autograd", "compile_fx.<locals>.fw_compiler_base", False, "enn"),
    ("GraphLowering.run", "inductor", "fx_codegen_and_compile", False, "inductor"),
    ("async_compile.wait", "kernel_compile", "PyCodeCache.load_by_key_path", False, "kernel_compile"),
    ("compile_file", "kernel_compile", "PyCodeCache.load_by_key_path", False, "kernel_compile"),
    ("compile_file", "kernel_compile", "PyCodeCache.load_by_key_path", True, "cpp_wrapper"),
    ("compile_file", "kernel_compile", "async_compile.wait", True, "kernel_compile"),
    ("CppWrapperGpu.generate", "inductor", "GraphLowering.codegen", True, "cpp_wrapper"),
    ("CachingAutotuner.benchmark_all_configs", "other", "", False, "autotune"),
    ("mm_template_autotuning", "inductor", "GraphLowering.run", False, "autotune"),
    ("something_new", "other", "", False, "other"),
])
def test_phase_of_event(name, parent_phase, parent_name, cpp_wrapper, phase):
    assert phase_of_event(name, parent_phase, parent_name, cpp_wrapper) == phase


def test_each_events_own_time_counts_once_toward_its_graph_and_phase():
    fwd, bwd = GraphRecord("g0/forward", "g0", "forward"), GraphRecord("g0/backward", "g0", "backward")
    root = _ev("dynamo", 0, 100, outermost=True)
    events = [
        _ev("bytecode_tracing", 2, 8),  # dynamo (not named: the root's phase)
        _ev("backend_compile", 10, 95),  # aot_autograd: 10-20, 60-95 less the bwd graph
        _ev("enn_backend.compile_graph", 20, 60),  # enn: 20-25, 55-60 (forward graph)
        _ev("inductor_compile", 25, 55),  # inductor: 25-30, 50-55, and "unnamed" 45-50
        _ev("compile_file", 30, 45),  # kernel_compile
        _ev("unnamed", 45, 50),  # inductor (its parent's)
        _ev("enn_backend.compile_graph", 70, 80),  # the backward graph's enn: all of it
    ]
    windows = {(20, 60): fwd, (70, 80): bwd}

    def owner(e: Event):
        inner = [r for (s, t), r in windows.items() if s <= e.start_ns and e.end_ns <= t]
        return inner[0] if inner else fwd  # the rest of the compile: the first graph's

    got: dict[tuple[str, str], float] = {}
    for rec, phase, seconds in attribute(events, [root], owner):
        got[(rec.id, phase.value)] = got.get((rec.id, phase.value), 0.0) + seconds * 1e9
    assert got == pytest.approx({
        ("g0/forward", "dynamo"): 15,  # 0-10 (bytecode_tracing included), 95-100
        ("g0/forward", "aot_autograd"): 10 + 25,  # 10-20, 60-70, 80-95
        ("g0/forward", "enn"): 10,
        ("g0/forward", "inductor"): 15,
        ("g0/forward", "kernel_compile"): 15,
        ("g0/backward", "enn"): 10,
    })
    assert sum(got.values()) == pytest.approx(100)  # the phases add up to the compile's span


@pytest.mark.parametrize("kernels, device_us, host_bound", [
    (0, 0.0, True),  # nothing to predict: as before the rule, the launch-saving defaults
    # the graphs of the H200 run (compile_guard_variants_2026-11-28.log): ViT-small's (host-bound,
    # 50-60% of the step idle), GPT-2's and LLaMA's (GPU-bound, 1-3% idle) forward and backward
    (40, 789.0, True), (77, 1668.0, True),
    (67, 2776.0, False), (76, 6563.0, False),
    (41, 3694.0, False), (70, 7603.0, False),
    (100, 3000.0, True),  # on the line: 1500 us >= 0.5 x 3000 us
    (100, 3001.0, False),
    (1000, 25000.0, True),  # a graph of many small kernels
    (1000, 250000.0, False),  # an 8-layer d2048 decoder's training graph: GPU-bound
    (3, 340.0, False),  # one large GEMM
])
def test_the_host_bound_rule(kernels, device_us, host_bound):
    assert build_choice.choose(kernels, device_us) is host_bound


@pytest.mark.parametrize("kernels, device_us, host_bound, as_training", [
    # the inference graphs of the H200 run (real_infer_2026-11-28.md; estimates of the same graphs):
    # BERT SDPA and eager (31-42% of the step idle under the Python wrapper: host-bound, though a
    # training graph of the same prediction is not), GPT-2 (3% idle), LLaMA and BLOOM (4-7%
    # idle), T5 (48% idle under Inductor)
    (45, 1604.0, True, False), (56, 2064.0, True, False),
    (52, 2381.0, False, False), (34, 3267.0, False, False), (44, 4301.0, False, False), (103, 965.0, True, True),
])
def test_the_host_bound_rule_for_inference_graphs(kernels, device_us, host_bound, as_training):
    assert build_choice.choose(kernels, device_us, inference=True) is host_bound
    assert build_choice.choose(kernels, device_us) is as_training


def test_an_inference_graph_is_judged_by_the_inference_line():
    est = build_choice.HostEstimate(kernels=45, device_us=1604.0, inference=True)
    assert est.host_bound and "the line for an inference graph: 0.35x" in est.reason()
    assert not build_choice.HostEstimate(kernels=45, device_us=1604.0).host_bound


def test_where_the_rule_is_not_applied_it_is_recorded(monkeypatch):
    monkeypatch.setattr(build_choice, "APPLIED", False)
    defaults = {"cpp_wrapper": True, "combo_kernels": True, "other": 1}
    kept, choice = build_choice.for_graph(defaults, build_choice.HostEstimate(kernels=1000, device_us=250000.0))
    assert kept == defaults and choice["applied"] is False
    assert choice["reason"].startswith("not host-bound")


def test_a_graph_keeps_enns_defaults_that_save_no_launches():
    assert build_choice.APPLIED  # the default
    defaults = {"cpp_wrapper": True, "combo_kernels": True, "combo_kernels_pointwise_only": True, "other": 1}
    kept, choice = build_choice.for_graph(defaults, build_choice.HostEstimate(kernels=1000, device_us=250000.0))
    assert kept == {"other": 1}
    assert choice["options"] == {"cpp_wrapper": False, "combo_kernels": False}
    assert choice["reason"].startswith("not host-bound: ~1000 kernels")
    kept, choice = build_choice.for_graph(defaults, build_choice.HostEstimate(kernels=10, device_us=100.0))
    assert kept == defaults and choice["options"] == {"cpp_wrapper": True, "combo_kernels": True}


def test_the_estimate_counts_gemms_reductions_and_pointwise_chains():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w):
        h = torch.relu(x @ w) * 2 + 1  # a GEMM, then one fused pointwise chain
        return h.sum(-1), h @ w  # a reduction, another GEMM

    x, w = torch.randn(512, 512), torch.randn(512, 512)
    gm = make_fx(f)(x, w)
    est = build_choice.estimate(gm)
    assert est.kernels == 4  # mm, relu-mul-add, sum, mm
    flops = 2 * 2 * 512 ** 3
    assert est.device_us >= flops / build_choice.PEAK_FLOPS_OTHER * 1e6


# ------------------------------------------------------------------ a real compile (CPU)
class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = torch.nn.Linear(24, 56), torch.nn.LayerNorm(56), torch.nn.Linear(56, 7)

    def forward(self, x):
        return self.b(self.norm(torch.nn.functional.silu(self.a(x))))


def test_phases_add_up_to_the_wall_time_of_the_compile(caplog):
    """The first training step of a small model: its forward call (Dynamo's compile of the frame,
    the forward's first call) and its backward (the lazy backward compile, its first call)."""
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(9, 24)
    compiled = torch.compile(model, backend="enn")
    with caplog.at_level(logging.INFO, logger="enn_backend"):
        t0 = time.perf_counter()
        compiled(x).sum().backward()
        wall = time.perf_counter() - t0
    graphs = enn_backend.report().graphs
    assert [g.id for g in graphs] == ["g0/forward", "g0/backward"]
    total = sum(sum(g.compile_phases.values()) for g in graphs)
    assert abs(total - wall) <= 0.1 * wall, (total, wall, [g.compile_phases for g in graphs])
    fwd, bwd = graphs
    for phase in ("dynamo", "aot_autograd", "enn", "inductor", "kernel_compile", "guard", "first_run"):
        assert fwd.compile_phases.get(phase, 0.0) > 0, (phase, fwd.compile_phases)
    for phase in ("aot_autograd", "inductor", "kernel_compile", "guard", "first_run"):
        assert bwd.compile_phases.get(phase, 0.0) > 0, (phase, bwd.compile_phases)
    assert "dynamo" not in bwd.compile_phases  # Dynamo traced the frame once: the forward's
    # enn's own work among torch's compile events (tlparse, chromium traces)
    metrics = torch._dynamo.utils.compilation_time_metrics
    for name in ("enn_backend.compile_unit", "enn_backend.compile_graph", "enn_backend.passes"):
        assert metrics.get(name), name
    # one info line per graph, and the report's table
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("enn compile time")]
    assert [ln.split(":")[0] for ln in lines] == ["enn compile time g0/forward", "enn compile time g0/backward"]
    text = str(enn_backend.report())
    assert "compile time by phase" in text and "kernel_compile" in text
    # and the tape is off again: nothing of enn's stays on torch's logger
    assert "log_event_end" not in vars(torch._dynamo.utils.get_chromium_event_logger())


@pytest.mark.slow
def test_the_cpp_wrapper_goes_to_host_bound_graphs_only(monkeypatch):
    """With enn's C++ wrapper default on the CPU too (on CUDA it is enn's default): a graph of a
    few small kernels gets it, one large GEMM does not; each choice is in the report. The GEMM's
    graph, built with the Python wrapper inside a compile_fx that set the C++ wrapper's config,
    is built with Inductor's own config (not kernel binaries kept for a C++ wrapper)."""
    monkeypatch.setitem(graph_compiler.COMPILE_FX_DEFAULTS, "cpu", {"cpp_wrapper": True})
    seen: list[tuple[bool, bool]] = []  # (cpp_wrapper, triton.store_cubin) of each graph Inductor builds
    inner = compat.compile_fx_inner

    def spy(gm, example_inputs, **kwargs):
        seen.append((bool(kwargs.get("cpp_wrapper")), compat.inductor_config.triton.store_cubin))
        return inner(gm, example_inputs, **kwargs)

    monkeypatch.setattr(compat, "compile_fx_inner", spy)
    small, large = torch.nn.Linear(8, 8), torch.nn.Linear(2048, 2048, bias=False)
    with torch.no_grad():
        torch.compile(small, backend="enn")(torch.randn(4, 8))
        torch.compile(large, backend="enn")(torch.randn(2048, 2048))
    assert seen == [(True, True), (False, compat.inductor_config.triton.store_cubin)]
    g_small, g_large = enn_backend.report().graphs
    assert g_small.build_choices["options"] == {"cpp_wrapper": True}
    assert g_large.build_choices["options"] == {"cpp_wrapper": False}
    assert g_large.build_choices["reason"].startswith("not host-bound")
    assert "the line for an inference graph" in g_large.build_choices["reason"]  # judged as a step on its own
    assert g_small.compile_phases.get(CompilePhase.CPP_WRAPPER.value, 0.0) > 0
    assert CompilePhase.CPP_WRAPPER.value not in g_large.compile_phases
    text = format_report(enn_backend.report().to_dict())
    assert "build choices:" in text and "cpp_wrapper=False (not host-bound" in text


def test_a_graph_the_cpp_wrapper_cannot_call_is_built_without_it():
    """A random op that AOT Autograd must replay in the backward (SDPA with dropout inside an
    activation-checkpointed region: HF BERT with its default dropout under
    ``gradient_checkpointing_enable()``) is wrapped in an RNG-state higher-order op, which
    Inductor's C++ wrapper cannot call (its codegen asserts). Such a graph keeps enn's other
    defaults but not the C++ wrapper, with the reason in its build choice, however host-bound
    it is: built once, not failed in Inductor's codegen and built again."""
    from torch._prims import rng_prims
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        _, y = rng_prims.run_and_save_rng_state(torch.ops.aten.rand_like.default, x)
        return y * x

    gm = make_fx(f)(torch.randn(4))
    why = build_choice.cpp_wrapper_refusal(gm)
    assert why.startswith("run_and_save_rng_state calls run_and_save_rng_state"), why
    assert build_choice.cpp_wrapper_refusal(make_fx(lambda x: x * 2)(torch.randn(4))) == ""
    defaults = {"cpp_wrapper": True, "combo_kernels": True}
    host_bound = build_choice.HostEstimate(kernels=10, device_us=100.0)
    kept, choice = build_choice.for_graph(defaults, host_bound, why)
    assert kept == {"combo_kernels": True}
    assert choice["options"] == {"cpp_wrapper": False, "combo_kernels": True}
    assert choice["reason"].startswith("host-bound") and f"; no C++ wrapper: {why}" in choice["reason"]
    assert build_choice.for_graph(defaults, host_bound, "")[0] == defaults


@pytest.mark.gpu
def test_on_cuda_sdpa_dropout_under_checkpointing_is_built_once():
    """CUDA, enn's defaults: SDPA with dropout inside a non-reentrant checkpoint. Its graphs
    hold ``graphsafe_run_with_rng_state`` and are built without the C++ wrapper at once: no
    compile_error fallback (the C++ wrapper's codegen asserts on that op)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from torch.utils.checkpoint import checkpoint

    lin = torch.nn.Linear(64, 192, device="cuda", dtype=torch.bfloat16)

    def block(y):
        q, k, v = lin(y).view(2, 128, 3, 4, 16).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1)

    def step(x):
        return checkpoint(block, x, use_reentrant=False).float().sum()

    x = torch.randn(2, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.compile(step, backend="enn")(x).backward()
    rep = enn_backend.report()
    assert [f.kind for f in rep.fallbacks] == [], [fallback_line(f) for f in rep.fallbacks]
    assert any("no C++ wrapper: " in g.build_choices.get("reason", "") for g in rep.graphs), \
        [g.build_choices for g in rep.graphs]
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.gpu
def test_on_cuda_a_gpu_bound_unit_is_built_as_inductor_builds_it(monkeypatch):
    """CUDA, enn's defaults: a training step of one large GEMM is GPU-bound, so its forward and
    backward are built with the Python wrapper and Inductor's own config (no kernel binaries kept
    for a C++ wrapper), the backward when AOT Autograd asks (not on its first call); a step of a
    few small kernels is host-bound and gets the C++ wrapper. Values equal eager's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    seen: list[tuple[bool, bool]] = []
    inner = compat.compile_fx_inner

    def spy(gm, example_inputs, **kwargs):
        seen.append((bool(kwargs.get("cpp_wrapper")), compat.inductor_config.triton.store_cubin))
        return inner(gm, example_inputs, **kwargs)

    monkeypatch.setattr(compat, "compile_fx_inner", spy)
    for size, rows, host_bound in ((4096, 8192, False), (8, 4, True)):
        torch._dynamo.reset()
        seen.clear()
        model = torch.nn.Linear(size, size, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(rows, size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = torch.compile(model, backend="enn")(x)
        out.float().sum().backward()
        torch.testing.assert_close(out, model(x))
        want_cubin = True if host_bound else compat.inductor_config.triton.store_cubin
        assert seen and all(s == (host_bound, want_cubin) for s in seen), (size, seen)
