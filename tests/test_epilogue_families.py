"""The GEMM epilogue families (bias, relu, gelu, gelu_tanh, silu, residual) on every kernel this
CPU runs, at edge shapes, against eager; the pass's residual and bias sites; the per-family
switch (``epilogue_off``) and measurement at compile time.

Tolerance (mixed): ``|got - ref| <= tol * (1 + |ref|)`` elementwise against the fp64 eager
result of the same inputs, with ``tol`` 1e-5 for fp32 and 2**-6 for bf16 (two bf16 roundings:
the GEMM's output and the activation's).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import enn_backend
from enn_backend.custom_ops import gemm_policy as P
from enn_backend.registry import cache as C
from enn_backend.registry import measure as M
from pass_harness import assert_ops, count_ops, find_ops, run_passes

aten, enn = torch.ops.aten, torch.ops.enn
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -6}
# name -> (M, N, K)
SHAPES = {"M=1": (1, 5, 16), "N=1": (4, 1, 16), "odd N": (4, 7, 16), "K=13": (4, 6, 13), "K=0": (4, 6, 0)}
ACTS = {"bias": "none", "relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_tanh", "silu": "silu"}


def _inputs(shape, dtype, seed=0):
    m, n, k = shape
    g = torch.Generator().manual_seed(seed)
    x, w, b, r = (torch.randn(*s, generator=g).to(dtype) for s in ((m, k), (n, k), (n,), (m, n)))
    return x, w, b, r


def _reference(family, x, w, b, r):
    x, w, b, r = (t.double() for t in (x, w, b, r))
    if family == "residual":
        return F.linear(x, w, b) + r
    return P.ACT_FN[ACTS[family]](F.linear(x, w, b))


def _call(family, kernel, x, w, b, r):
    if family == "residual":
        return torch.ops.enn.gemm_residual(x, w, b, r, kernel)
    return torch.ops.enn.gemm_bias_act(x, w, b, ACTS[family], kernel)


def _assert_close(got, ref, dtype, what):
    assert got.dtype == dtype and got.shape == ref.shape, what
    err = (got.double() - ref).abs()
    bound = TOL[dtype] * (1 + ref.abs())
    assert bool((err <= bound).all()), f"{what}: max error {err.max().item():.3g} over bound"


def _kernels(family, shape, dtype) -> list[str]:
    """The kernels whose checker accepts this family, shape and dtype here."""
    m, n, k = shape
    p = P.GemmProblem("cpu", dtype, "none" if family == "residual" else ACTS[family], True, m=m, n=n, k=k,
                      residual=family == "residual")
    return [kern.value for kern, check in P.CHECKERS.items() if check(p)[0]]


CASES = [(f, s, d) for f in P.FAMILIES for s in SHAPES for d in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("family, shape, dtype", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_every_family_on_every_eligible_kernel_equals_eager_at_edge_shapes(family, shape, dtype):
    x, w, b, r = _inputs(SHAPES[shape], dtype)
    ref = _reference(family, x, w, b, r)
    kernels = _kernels(family, SHAPES[shape], dtype)
    assert "inductor" in kernels
    for kernel in kernels + [""]:
        _assert_close(_call(family, kernel, x, w, b, r), ref, dtype, f"{family} {shape} {dtype} eager {kernel!r}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_family_compiled_equals_eager_at_edge_shapes(dtype):
    """One compiled graph per kernel, every (family, shape) it takes in it: the lowerings' IR and
    extern calls at the edge shapes."""
    for kernel in ("inductor", "onednn", "addmm"):
        cases = [(f, s) for f in P.FAMILIES for s in SHAPES if kernel in _kernels(f, SHAPES[s], dtype)]
        if not cases:
            continue
        data = {c: _inputs(SHAPES[c[1]], dtype, seed=i) for i, c in enumerate(cases)}

        def f(data=data, kernel=kernel):
            return [_call(fam, kernel, *data[(fam, s)]) for fam, s in data]

        torch._dynamo.reset()
        got = torch.compile(f, backend="enn", options={"guard": "off"})()
        for (fam, s), out in zip(data, got):
            _assert_close(out, _reference(fam, *data[(fam, s)]), dtype, f"{fam} {s} {dtype} compiled {kernel}")


# ----------------------------------------------------------------------------- the pass
class Residual(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16, bias=bias)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def test_a_residual_add_without_bias_becomes_addmm_with_the_residual_as_c():
    x = torch.randn(2, 3, 16)
    run = run_passes(Residual(bias=False), (x,), ["epilogue"], training=False)
    (op,) = find_ops(run.after, enn.gemm_residual)
    assert op.args[4] == "addmm"
    run.check_eager(atol=1e-5, rtol=1e-5)


def test_a_residual_site_under_dynamic_shapes_is_judged_by_its_value_checks():
    """Compiled with dynamic shapes, the residual's 2-D view must not name a symbolic row count:
    the value check's eager reference runs the graph as Python code, where no symbol is bound."""
    from enn_backend.report import GraphCounter

    model = Residual(bias=False)
    compiled = torch.compile(model, backend="enn", dynamic=True)
    for rows in (2, 3):
        x = torch.randn(rows, 5, 16, requires_grad=True)
        out = compiled(x)
        torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)
        out.sum().backward()
    graphs = enn_backend.report().graphs
    assert any(c.get("act") == "residual" and c["choice"] == "addmm" for g in graphs for c in g.kernel_choices)
    assert sum(g.counters.get(GraphCounter.VALUE_CHECKS.value, 0) for g in graphs) > 0
    assert all(g.counters.get(GraphCounter.VALUE_CHECKS_UNJUDGED.value, 0) == 0 for g in graphs), \
        [(g.id, g.counters) for g in graphs]


def test_a_residual_add_with_bias_stays_unfused_by_the_rules():
    run = run_passes(Residual(bias=True), (torch.randn(4, 16),), ["epilogue"], training=False)
    assert count_ops(run.after, enn.gemm_residual) == 0
    (choice,) = [c for c in run.choices if c.get("act") == "residual"]
    assert choice["choice"] == "inductor" and "rules rank the un-fused path first" in choice["reason"]


@pytest.mark.parametrize("off", ["residual", "all"])
def test_epilogue_off_forces_the_unfused_path_per_family(off, monkeypatch):
    model = Residual(bias=False).to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    run = run_passes(model, (x,), ["epilogue"], training=False, options={"epilogue_off": off})
    assert count_ops(run.after, enn.gemm_residual) == 0
    relu_fused = count_ops(run.after, enn.gemm_bias_act)
    assert relu_fused == (0 if off == "all" else int(P.hw_caps("cpu").onednn_bf16))
    monkeypatch.setenv("ENN_EPILOGUE_OFF", off)
    run = run_passes(model, (x,), ["epilogue"], training=False)
    assert count_ops(run.after, enn.gemm_residual) == 0
    monkeypatch.delenv("ENN_EPILOGUE_OFF")
    run = run_passes(model, (x,), ["epilogue"], training=False)
    assert count_ops(run.after, enn.gemm_residual) == 1


@pytest.fixture
def fused_wins(monkeypatch):
    """Measurement where every fused kernel times 1 ms and the un-fused path 2 ms."""
    monkeypatch.setattr(M, "measure", lambda runs, device, budget: {k: 2.0 if k == "inductor" else 1.0 for k in runs})


@pytest.mark.skipif(not P.hw_caps("cpu").onednn_bf16, reason="needs oneDNN's native bf16 GEMM")
def test_the_bias_family_is_a_site_only_when_measured(fused_wins):
    model = nn.Linear(16, 8).to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    run = run_passes(model, (x,), ["epilogue"], training=False)
    assert_ops(run.after, present=[aten.addmm], absent=[enn.gemm_bias_act])
    run = run_passes(model, (x,), ["epilogue"], training=False, options={"measure_ms": 10})
    (op,) = find_ops(run.after, enn.gemm_bias_act)
    assert op.args[3:] == ("none", "onednn")
    assert [c["how"] for c in run.choices] == ["measured"]
    run.check_eager(atol=2e-2, rtol=2e-2)


def test_measured_choices_are_cached_for_the_next_compile(tmp_path, monkeypatch):
    """Measured for real on this CPU: the choice and the times are in the report and the cache;
    a later compile (the same cache folder, a fresh process's view of it) takes it without timing."""
    monkeypatch.setenv("ENN_CACHE_DIR", str(tmp_path))
    model = Residual(bias=False)
    x = torch.randn(8, 16)
    opts = {"guard": "off", "measure_ms": 20, "fx_graph_cache": False}
    with torch.no_grad():
        torch.compile(model, backend="enn", options=opts)(x)
    first = [c for g in enn_backend.report().graphs for c in g.kernel_choices if c.get("act") == "residual"]
    assert [c.get("how") for c in first] == ["measured"] and first[0]["timings_ms"]  # whichever kernel won
    assert "residual" in [e.key.epilogue for e in C.ChoiceCache(str(tmp_path / C.FILE_NAME)).entries()]
    C.forget_loaded_caches()
    monkeypatch.setattr(M, "measure", lambda *a: pytest.fail("measured again"))
    enn_backend.reset()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend="enn", options=opts)(x)
    again = [c for g in enn_backend.report().graphs for c in g.kernel_choices if c.get("act") == "residual"]
    assert [c["choice"] for c in again] == [c["choice"] for c in first]
    assert [c["how"] for c in again] == ["cached"]


@pytest.mark.skipif(not P.hw_caps("cpu").onednn_bf16, reason="needs oneDNN's native bf16 GEMM")
def test_a_site_measurement_leaves_to_inductor_is_reported_as_measured(monkeypatch):
    """The un-fused path wins the measurement: the site stays Inductor's, and the report says
    it was measured, with the times (not a rule's decline)."""
    monkeypatch.setattr(M, "measure", lambda runs, device, budget: {k: 1.0 if k == "inductor" else 2.0 for k in runs})
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU()).to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    run = run_passes(model, (x,), ["epilogue"], training=False, options={"measure_ms": 10})
    assert_ops(run.after, present=[aten.addmm], absent=[enn.gemm_bias_act])
    (c,) = run.choices
    assert c["choice"] == "inductor" and c["how"] == "measured", c
    assert c["timings_ms"] == {"inductor": 1.0, "onednn": 2.0} and "measured:" in c["reason"]
