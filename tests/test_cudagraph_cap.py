"""The cap on CUDA graphs recorded per compiled graph (enn_backend/cudagraph_cap.py, issue #43):
under ``mode="reduce-overhead"`` a graph with dynamic shapes hands at most
``cudagraph_max_shapes`` distinct input sizes to capture; later sizes run the graph compiled
without CUDA graphs, reported once per graph and counted.

On the CPU: the admission rule, the option's validation, which graphs get the cap, and the routing
through a real enn compile (the CUDA-graph artifact stood in by Inductor's CPU artifact: a CPU
graph is never captured, so the test says the graph is). On a GPU: the recordings themselves.
"""

from __future__ import annotations

import pytest
import torch

import enn_backend
from enn_backend import cudagraph_cap
from enn_backend.cudagraph_cap import CappedCudagraphs, CapturePolicy, capped, int_positions
from enn_backend.graph_compiler import GraphCompiler
from enn_backend.options import Options, OptionsError
from enn_backend.report import GraphCounter, report

from _models import assert_close_step, make, train_step

ISOLATED = {"attention": False, "epilogue": False, "persist": False}


# ------------------------------------------------------------------ the admission rule
@pytest.mark.parametrize("limit, calls, captured", [
    (3, "a b c d a d e c", "a b c - a - - c"),  # first come: a, b, c; d and e never, however often
    (1, "a a b b a", "a a - - a"),
    (0, "a b c d e f g h i j", "a b c d e f g h i j"),  # 0: no cap
    (2, "a b a b", "a b a b"),
])
def test_the_first_limit_distinct_keys_are_captured_and_no_later_one(limit, calls, captured):
    policy = CapturePolicy(limit)
    got = " ".join(key if policy.admit(key) else "-" for key in calls.split())
    assert got == captured
    assert list(policy.captured) == [k for k in dict.fromkeys(captured.split()) if k != "-"]
    assert set(policy.uncaptured) == set(calls.split()) - set(policy.captured)


def test_a_negative_limit_is_refused():
    with pytest.raises(ValueError, match=">= 0"):
        CapturePolicy(-1)


def test_the_key_is_read_where_inductor_reads_it():
    """Integers, symbolic or not (a bool is an int to Inductor too); tensors and floats are not."""
    t = torch.zeros(2)
    assert int_positions([t, 3, 2.5, t, True, 7]) == [1, 4, 5]
    assert int_positions([t, t]) == []


# ------------------------------------------------------------------ the option
def test_the_option_defaults_to_eight_and_reads_options_and_its_variable():
    assert Options().cudagraph_max_shapes == 8
    assert Options.from_sources({"cudagraph_max_shapes": 3}, environ={}).cudagraph_max_shapes == 3
    assert Options.from_sources({}, environ={"ENN_CUDAGRAPH_MAX_SHAPES": "0"}).cudagraph_max_shapes == 0
    # options= wins over the variable (as for every option that is not an override)
    assert Options.from_sources({"cudagraph_max_shapes": 5},
                                environ={"ENN_CUDAGRAPH_MAX_SHAPES": "2"}).cudagraph_max_shapes == 5


@pytest.mark.parametrize("value, message", [
    (-1, r"cudagraph_max_shapes must be >= 0 \(0: no cap\), got -1"),
    ("-3", r"cudagraph_max_shapes must be >= 0"),
    ("eight", r"cudagraph_max_shapes.* must be an integer, got 'eight'"),
    (2.5, r"cudagraph_max_shapes.* must be an integer"),
    (True, r"cudagraph_max_shapes.* must be an integer"),
])
def test_a_bad_value_is_a_clear_error(value, message):
    with pytest.raises(OptionsError, match=message):
        Options.from_sources({"cudagraph_max_shapes": value}, environ={})


def test_a_bad_variable_is_a_clear_error():
    with pytest.raises(OptionsError, match=r"ENN_CUDAGRAPH_MAX_SHAPES must be an integer, got 'lots'"):
        Options.from_sources({}, environ={"ENN_CUDAGRAPH_MAX_SHAPES": "lots"})


def test_a_bad_value_stops_the_compile():
    model, x = make("mlp")
    with pytest.raises(Exception, match="cudagraph_max_shapes must be >= 0"):
        torch.compile(model, backend="enn", options={"cudagraph_max_shapes": -2})(x)


# ------------------------------------------------------------------ which graphs get the cap
class _Facts:
    """What ``capped`` reads of a graph: whether Inductor put it under CUDA graphs."""

    def __init__(self, cudagraphs: bool | None) -> None:
        if cudagraphs is not None:
            self.cudagraphs = cudagraphs


def _artifact(args: list) -> str:
    return "captured"


@pytest.mark.parametrize("limit, cudagraphs, inputs, wrapped", [
    (8, True, [torch.zeros(2), 4], True),
    (8, True, [torch.zeros(2)], False),  # no integer input: one key, nothing to cap
    (0, True, [torch.zeros(2), 4], False),  # the cap is off
    (8, False, [torch.zeros(2), 4], False),  # Inductor did not capture this graph (a CPU graph)
    (8, True, None, True),  # loaded from a cache: its first call tells
])
def test_only_a_captured_graph_with_integer_inputs_is_capped(limit, cudagraphs, inputs, wrapped):
    rec = report().new_graph("g0", "forward")
    got = capped(_artifact, _Facts(cudagraphs), rec, Options(cudagraph_max_shapes=limit), inputs)
    assert isinstance(got, CappedCudagraphs) is wrapped
    if not wrapped:
        assert got is _artifact


def test_a_cache_loaded_graph_on_the_cpu_is_never_routed(monkeypatch):
    """Its first call finds no CUDA tensor: every call goes to the artifact, nothing is built."""
    monkeypatch.setattr(cudagraph_cap, "_under_cudagraphs", lambda facts: True)  # as a load under reduce-overhead
    rec = report().new_graph("g0", "inference")
    runs = capped(_artifact, _Facts(None), rec, Options(cudagraph_max_shapes=1))
    assert isinstance(runs, CappedCudagraphs)
    runs.facts = None  # building would fail: nothing may build
    for n in range(4):
        assert runs([torch.zeros(n + 1), n + 1]) == "captured"
    assert report().to_dict()["fallbacks"] == []


# ------------------------------------------------------------------ routing, through a real compile
@pytest.fixture
def under_cudagraphs(monkeypatch):
    """Every graph counts as captured by Inductor: on the CPU the cap then routes Inductor's CPU
    artifact as it would route the CUDA-graph one, and builds the uncaptured one for real."""
    monkeypatch.setattr(cudagraph_cap, "_under_cudagraphs", lambda facts: True)
    monkeypatch.setattr(cudagraph_cap, "_on_cuda", lambda args: True)


def _dynamic_mlp(options: dict):
    model, _ = make("mlp")
    return model, torch.compile(model, backend="enn", dynamic=True, options={**ISOLATED, **options})


def _routes(monkeypatch) -> list[str]:
    """Which artifact each call of a capped graph ran."""
    seen: list[str] = []
    call, run_uncaptured = CappedCudagraphs.__call__, CappedCudagraphs._run_uncaptured

    def counted_call(self, args):
        seen.append("captured")
        return call(self, args)

    def counted_uncaptured(self, args, key):
        seen[-1] = "uncaptured"
        return run_uncaptured(self, args, key)

    monkeypatch.setattr(CappedCudagraphs, "__call__", counted_call)
    monkeypatch.setattr(CappedCudagraphs, "_run_uncaptured", counted_uncaptured)
    return seen


@pytest.mark.parametrize("guard", ["nonfinite", "off"])
def test_sizes_past_the_cap_run_a_build_without_cudagraphs_reported_once(monkeypatch, under_cudagraphs, guard):
    routes = _routes(monkeypatch)
    builds: list[tuple[bool, bool]] = []  # (quiet, cudagraphs_ok) of each build after the first
    compilers: list[GraphCompiler] = []
    original_build = GraphCompiler.build

    def build(self, *args, **kwargs):
        if self.first_build:
            compilers.append(self)
        else:
            builds.append((kwargs.get("quiet", False), self.cudagraphs_ok))
        return original_build(self, *args, **kwargs)

    monkeypatch.setattr(GraphCompiler, "build", build)
    model, compiled = _dynamic_mlp({"cudagraph_max_shapes": 2, "guard": guard})
    sizes = [3, 5, 3, 7, 5, 9, 7, 3]
    with torch.no_grad():
        for n in sizes:
            x = torch.randn(n, 16)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-4)
    # sizes 3 and 5 are admitted; 7 and 9 are past the cap, however often they come back
    assert routes == ["captured" if n in (3, 5) else "uncaptured" for n in sizes]
    # one build, without CUDA graphs; the compiler keeps them for what it builds later (a fault's)
    assert builds == [(True, False)]
    assert [c.cudagraphs_ok for c in compilers] == [True]
    rep = report().to_dict()
    (fb,) = rep["fallbacks"]
    assert fb["kind"] == "cudagraph_limit" and fb["node"] == "<graph>"
    assert "7" in fb["reason"] and "cudagraph_max_shapes" in fb["reason"] and "built once" in fb["action"]
    (graph,) = rep["graphs"]
    assert fb["graph"] == graph["id"]
    counters = graph["counters"]
    assert counters[GraphCounter.CUDAGRAPH_SHAPES.value] == 2
    assert counters[GraphCounter.UNCAPTURED_SHAPES.value] == 2
    assert counters[GraphCounter.UNCAPTURED_CALLS.value] == 3


def test_training_graphs_are_capped_each(monkeypatch, under_cudagraphs):
    """The forward and the backward each cap their own sizes; gradients stay eager's."""
    model, compiled = _dynamic_mlp({"cudagraph_max_shapes": 1})
    for n in (4, 6, 4, 6):
        x = torch.randn(n, 16)
        assert_close_step(train_step(model, x, compiled), train_step(model, x))
    rep = report().to_dict()
    assert sorted(f["graph"].split("/")[1] for f in rep["fallbacks"]) == ["backward", "forward"]
    assert all(f["kind"] == "cudagraph_limit" for f in rep["fallbacks"])
    for g in rep["graphs"]:
        assert g["counters"][GraphCounter.CUDAGRAPH_SHAPES.value] == 1, g
        assert g["counters"][GraphCounter.UNCAPTURED_CALLS.value] == 2, g


class _Compiler:
    """A compiler as the cap uses one: ``full()``, and ``build(quiet=True)`` with CUDA graphs off."""

    def __init__(self) -> None:
        self.cudagraphs_ok = True
        self.builds: list[tuple[bool, bool]] = []

    def full(self) -> "_Compiler":
        return self

    def build(self, quiet: bool = False):
        self.builds.append((quiet, self.cudagraphs_ok))
        return lambda args: "uncaptured"


def test_a_graph_loaded_from_a_cache_reads_its_key_from_its_first_call(under_cudagraphs):
    """No example inputs (AOT Autograd's cache loads no trace): the first call says where the
    integers are; two of them make a tuple key, as Inductor's."""
    rec = report().new_graph("g0", "forward")
    compiler = _Compiler()
    runs = capped(_artifact, compiler, rec, Options(cudagraph_max_shapes=2))
    t = torch.zeros(1)
    got = [runs([t, m, n]) for m, n in ((2, 5), (2, 6), (2, 5), (3, 5), (2, 6))]
    assert got == ["captured", "captured", "captured", "uncaptured", "captured"]
    assert list(runs.policy.captured) == [(2, 5), (2, 6)] and list(runs.policy.uncaptured) == [(3, 5)]
    assert compiler.builds == [(True, False)] and compiler.cudagraphs_ok


def test_no_cap_leaves_the_artifact_alone(monkeypatch, under_cudagraphs):
    routes = _routes(monkeypatch)
    model, compiled = _dynamic_mlp({"cudagraph_max_shapes": 0})
    with torch.no_grad():
        for n in range(2, 14):
            compiled(torch.randn(n, 16))
    assert routes == []  # not wrapped
    assert report().to_dict()["fallbacks"] == []


def test_reduce_overhead_on_the_cpu_is_not_capped():
    """Inductor captures no CPU graph (it turns the graph's CUDA-graph flag off): no cap, no
    line, any number of sizes."""
    model, _ = make("mlp")
    compiled = torch.compile(model, backend="enn", dynamic=True, options={**ISOLATED, "mode": "reduce-overhead",
                                                                          "cudagraph_max_shapes": 1})
    with torch.no_grad():
        for n in (2, 3, 4, 5):
            x = torch.randn(n, 16)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-4)
    rep = enn_backend.report().to_dict()
    assert rep["fallbacks"] == []
    assert all(GraphCounter.CUDAGRAPH_SHAPES.value not in g["counters"] for g in rep["graphs"])


# ------------------------------------------------------------------ on a GPU: what Inductor records
def _recordings(monkeypatch) -> list[int]:
    """One entry per CUDA graph Inductor's trees record."""
    from torch._inductor import cudagraph_trees

    seen: list[int] = []
    original = cudagraph_trees.CUDAGraphTreeManager.record_function

    def record_function(self, *args, **kwargs):
        seen.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function", record_function)
    return seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("limit", [3, 8])
def test_reduce_overhead_records_at_most_the_cap_per_graph(monkeypatch, limit):
    """Twelve batch sizes, each called three times (Inductor warms a size up, then records it):
    at most ``limit`` recordings, every result eager's, the sizes past the cap reported."""
    recorded = _recordings(monkeypatch)
    model, _ = make("mlp")
    model = model.cuda()
    compiled = torch.compile(model, backend="enn", dynamic=True,
                             options={**ISOLATED, "mode": "reduce-overhead", "cudagraph_max_shapes": limit})
    sizes = list(range(2, 14))
    with torch.no_grad():
        for _ in range(3):
            for n in sizes:
                x = torch.randn(n, 16, device="cuda")
                torch.testing.assert_close(compiled(x).clone(), model(x), atol=1e-5, rtol=1e-4)
    assert 0 < len(recorded) <= limit, recorded
    rep = enn_backend.report().to_dict()
    (graph,) = rep["graphs"]
    assert graph["counters"][GraphCounter.CUDAGRAPH_SHAPES.value] == limit
    assert graph["counters"][GraphCounter.UNCAPTURED_SHAPES.value] == len(sizes) - limit
    assert [f["kind"] for f in rep["fallbacks"]] == ["cudagraph_limit"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reduce_overhead_training_past_the_cap_gives_eager_steps(monkeypatch):
    recorded = _recordings(monkeypatch)
    model, _ = make("mlp")
    model = model.cuda()
    compiled = torch.compile(model, backend="enn", dynamic=True,
                             options={**ISOLATED, "mode": "reduce-overhead", "cudagraph_max_shapes": 2})
    for _ in range(3):
        for n in (4, 6, 8, 10, 12):
            torch.compiler.cudagraph_mark_step_begin()
            x = torch.randn(n, 16, device="cuda")
            assert_close_step(train_step(model, x, compiled), train_step(model, x))
    rep = enn_backend.report().to_dict()
    for g in rep["graphs"]:
        assert g["counters"][GraphCounter.CUDAGRAPH_SHAPES.value] == 2, g
    assert 0 < len(recorded) <= 2 * len(rep["graphs"]), recorded
