"""Epilogue family: enn::gemm_bias_act, its kernel policy, the pass and the lowering.

CPU policy (custom_ops/gemm.py): bf16 -> oneDNN fused kernel, fp32 -> left to Inductor.
Tests that need an fp32 rewrite force the oneDNN rule on for fp32 (``fp32_fused``).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import enn_backend
from enn_backend.custom_ops import gemm as G
from enn_backend.custom_ops import gemm_policy as P
from enn_backend.passes import epilogue as E
from enn_backend.report import FallbackKind
from pass_harness import assert_ops, count_ops, find_ops, run_passes

aten, enn = torch.ops.aten, torch.ops.enn
# what the activations decompose to in the graph the pass sees (gelu: erf, gelu_tanh: tanh, silu: exp)
ACT_OPS = (aten.relu, aten.erf, aten.tanh, aten.exp)

ACTS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
    "silu": F.silu,
}


class MLP(nn.Module):
    """One linear + activation per act, so one compile exercises all four."""

    def __init__(self, dim: int = 16, acts=tuple(ACTS)) -> None:
        super().__init__()
        self.acts = acts
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in acts)

    def forward(self, x):
        for act, lin in zip(self.acts, self.layers):
            x = ACTS[act](lin(x))
        return x


def _compile(model, **options):
    return torch.compile(model, backend="enn", options={"guard": "off", **options})


def _epilogue(fn, inputs, training: bool, **options):
    """The epilogue pass alone on ``fn``'s graph (tests/pass_harness.py); its rewrite checked against eager."""
    run = run_passes(fn, inputs, ["epilogue"], training=training, options=options or None)
    run.check_eager(atol=2e-2, rtol=2e-2)
    return run


def _fused_acts(graph) -> list[str]:
    """The activation of each enn::gemm_bias_act in ``graph``."""
    return sorted(n.args[3] for n in find_ops(graph, enn.gemm_bias_act))


def _choices(kind: str | None = None) -> list[dict]:
    out = [c for g in enn_backend.report().graphs for c in g.kernel_choices]
    return [c for c in out if kind is None or c["choice"] == kind]


def _close_to_fp64(got: torch.Tensor, eager: torch.Tensor, ref64: torch.Tensor) -> None:
    """torch's accuracy rule: allclose, or RMSE vs fp64 no worse than 3x eager's (bf16/fp16)."""
    if torch.allclose(got.double(), eager.double(), rtol=2e-2, atol=2e-2):
        return
    rmse = lambda a: (a.double() - ref64).pow(2).mean().sqrt().item()  # noqa: E731
    assert rmse(got) <= 3 * rmse(eager) + 1e-4, (rmse(got), rmse(eager))


@pytest.fixture
def fp32_fused(monkeypatch):
    """Let the CPU rules prefer oneDNN for fp32 too (they keep fp32 with Inductor by measurement)."""
    def order(p):
        return (P.GemmKernel.ONEDNN, P.GemmKernel.INDUCTOR) if p.device_type == "cpu" else P.default_order(p)

    monkeypatch.setattr(P, "POLICY", dataclasses.replace(P.POLICY, order=order))


# ----------------------------------------------------------------------------- the op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", list(ACTS))
def test_opcheck(act, dtype):
    x = torch.randn(2, 3, 8, dtype=dtype, requires_grad=True)
    w = torch.randn(5, 8, dtype=dtype, requires_grad=True)
    b = torch.randn(5, dtype=dtype, requires_grad=True)
    torch.library.opcheck(torch.ops.enn.gemm_bias_act.default, (x, w, b, act))
    torch.library.opcheck(torch.ops.enn.gemm_bias_act.default, (x, w, None, act))


@pytest.mark.parametrize("act", list(ACTS))
def test_op_values_and_grads_fp32(act):
    x = torch.randn(4, 6, 8, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(5, 8).requires_grad_()
    b = torch.randn(5).requires_grad_()
    y = torch.ops.enn.gemm_bias_act(x, w, b, act)
    ref = ACTS[act](F.linear(x, w, b))
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w, b), g)
    want = torch.autograd.grad(ref, (x, w, b), g)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_op_gelu_variants_are_distinct():
    x = torch.linspace(-4, 4, 64).reshape(8, 8)
    eye = torch.eye(8)
    exact = torch.ops.enn.gemm_bias_act(x, eye, None, "gelu")
    tanh = torch.ops.enn.gemm_bias_act(x, eye, None, "gelu_tanh")
    torch.testing.assert_close(exact, F.gelu(x), rtol=0, atol=1e-6)
    torch.testing.assert_close(tanh, F.gelu(x, approximate="tanh"), rtol=0, atol=1e-6)
    assert (exact - tanh).abs().max() > 1e-4


def test_op_rejects_bad_activation():
    with pytest.raises(RuntimeError, match="act must be one of"):
        torch.ops.enn.gemm_bias_act(torch.randn(2, 3), torch.randn(4, 3), None, "tanh")


# ----------------------------------------------------------------------------- the policy
CUDA = G.HwCaps("cuda", cublaslt=True)
CPU = G.HwCaps("cpu", onednn=True, onednn_bf16=True, onednn_fp16=False)


def _p(device="cuda", dtype=torch.bfloat16, act="gelu_tanh", bias=True, bias_ok=True, autotune=False):
    return G.GemmProblem(device, dtype, act, bias, bias_ok, autotune)


@pytest.mark.parametrize("problem, caps, kernel, actionable", [
    (_p(act="relu"), CUDA, "cublaslt", False),
    (_p(act="gelu_tanh", dtype=torch.float16), CUDA, "cublaslt", False),
    (_p(act="gelu"), CUDA, "inductor", True),  # no exact-GELU epilogue in cuBLASLt
    (_p(act="silu"), CUDA, "inductor", False),
    (_p(act="relu", bias=False), CUDA, "inductor", False),
    (_p(dtype=torch.float64), CUDA, "inductor", False),
    (_p(bias_ok=False), CUDA, "inductor", True),
    (_p("cpu", act="gelu"), CPU, "onednn", False),
    (_p("cpu", act="silu", bias=False), CPU, "onednn", False),
    (_p("cpu", dtype=torch.float32, act="relu"), CPU, "inductor", False),  # measured: not faster
    (_p("cpu", dtype=torch.float16), CPU, "inductor", True),
    (_p("cpu"), G.HwCaps("cpu", onednn=True), "inductor", False),  # no native bf16 GEMM
    (_p("mps"), G.HwCaps("mps"), "inductor", False),
    (_p(autotune=True), CUDA, "inductor", False),  # max-autotune: Inductor's templates decide
    (_p("cpu", autotune=True), CPU, "inductor", False),
])
def test_select_kernel(problem, caps, kernel, actionable):
    choice = G.select_kernel(problem, caps)
    assert (choice.kernel, choice.actionable) == (kernel, actionable), choice
    assert choice.reason


def test_fingerprints_tell_activations_apart():
    p = E._PROBE
    assert E.fingerprint(F.gelu(p)) == "gelu"
    assert E.fingerprint(F.gelu(p, approximate="tanh")) == "gelu_tanh"
    assert E.fingerprint(p / (1 + torch.exp(-p))) == "silu"
    assert E.fingerprint(p.clamp_min(0)) == "relu"
    assert E.fingerprint(p * torch.sigmoid(1.702 * p)) is None  # "quick GELU" is none of them
    assert E.fingerprint(torch.tanh(p)) is None


# ----------------------------------------------------------------------------- the pass
@pytest.mark.parametrize("shape", [(6, 16), (2, 3, 16)], ids=["2d", "3d"])
def test_inference_bf16_all_activations(shape):
    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16)
    x = torch.randn(*shape, dtype=torch.bfloat16)
    with torch.no_grad():
        got = _compile(model)(x)
        eager = model(x)
        ref = MLP().double()
        ref.load_state_dict(model.state_dict())
        ref64 = ref(x.double())
    _close_to_fp64(got, eager, ref64)
    run = _epilogue(model, (x,), training=False)
    assert count_ops(run.before, aten.addmm) == 4
    assert _fused_acts(run.after) == sorted(ACTS)
    assert_ops(run.after, absent=[aten.addmm, aten.mm, *ACT_OPS])
    assert [c["choice"] for c in run.choices] == ["onednn"] * 4


def test_inference_fp32_tight(fp32_fused):
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        got = _compile(model)(x)
        want = model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    run = _epilogue(model, (x,), training=False)
    assert _fused_acts(run.after) == sorted(ACTS)
    assert_ops(run.after, absent=[aten.addmm, aten.mm, *ACT_OPS])


def test_training_fp32_relu_fused_gelu_declined(fp32_fused):
    torch.manual_seed(0)
    model = MLP()
    ref = MLP()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(2, 5, 16)
    got = _compile(model)(x)
    want = ref(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.square().sum().backward()
    want.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert not enn_backend.report().fallbacks  # not actionable: no PASS_SKIPPED noise
    # relu's backward reads the relu output: fused; gelu/gelu_tanh/silu's backward reads
    # the pre-activation, which the fused kernel does not return: their GEMMs stay
    run = _epilogue(MLP(), (x,), training=True)
    assert count_ops(run.before, aten.addmm) == 4
    assert _fused_acts(run.after) == ["relu"]
    assert count_ops(run.after, aten.addmm) == 3 and count_ops(run.after, aten.relu) == 0
    assert_ops(run.after, present=[aten.erf, aten.tanh])  # gelu's and gelu_tanh's, as traced
    declined = [c for c in run.choices if c["choice"] == "inductor"]
    assert sorted(c["act"] for c in declined) == ["gelu", "gelu_tanh", "silu"]


def test_training_bf16_relu_grads():
    torch.manual_seed(0)
    model = MLP(acts=("relu", "relu")).to(torch.bfloat16)
    ref = MLP(acts=("relu", "relu")).double()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    got = _compile(model)(x)
    eager = model(x)
    _close_to_fp64(got, eager, ref(x.double()))
    run = _epilogue(model, (x,), training=True)
    assert _fused_acts(run.after) == ["relu", "relu"]
    assert_ops(run.after, absent=[aten.addmm, aten.relu])
    g = torch.randn_like(got)
    got.backward(g)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    eager.backward(g)
    for a, e in zip(grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, e, rtol=2e-2, atol=2e-2)


def test_handwritten_matmul_plus_bias_and_no_bias():
    torch.manual_seed(0)
    w1, b1, w2 = (torch.randn(16, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16),
                  torch.randn(16, 16, dtype=torch.bfloat16))

    def f(x):
        h = F.silu(x @ w1.t() + b1)
        return torch.relu(h @ w2.t())

    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        got = _compile(f)(x)
        eager = f(x)
        x64, w164, b164, w264 = (t.double() for t in (x, w1, b1, w2))
        ref64 = torch.relu(F.silu(x64 @ w164.t() + b164) @ w264.t())
    _close_to_fp64(got, eager, ref64)
    run = _epilogue(f, (x,), training=False)
    assert count_ops(run.before, aten.mm) == 2  # x @ w.t() (+ b): mm and add, as written
    assert _fused_acts(run.after) == ["relu", "silu"]
    assert_ops(run.after, absent=[aten.addmm, aten.mm, *ACT_OPS])
    # the harness's bf16 rule still fails a result further from fp64 than eager is
    off = dataclasses.replace(run, output=(ref64 + 0.5).to(torch.bfloat16))
    with pytest.raises(AssertionError, match="RMSE vs fp64"):
        off.check_eager(atol=2e-2, rtol=2e-2)


def test_near_misses_are_not_matched(caplog):
    torch.manual_seed(0)
    lin = nn.Linear(16, 16).to(torch.bfloat16)

    def f(x):
        y = lin(x)
        quick = y * torch.sigmoid(1.702 * y)  # not one of the four activations
        y2 = lin(x + 1)
        out_fp32 = F.gelu(y2.float())  # activation output in another dtype than the GEMM
        y3 = lin(x - 1)
        return quick, out_fp32, F.gelu(y3), y3  # y3's pre-activation is also an output

    x = torch.randn(4, 16, dtype=torch.bfloat16)
    run = _epilogue(f, (x,), training=False)
    assert run.matches == {"epilogue": 0}
    assert count_ops(run.after, aten.addmm) == count_ops(run.before, aten.addmm) == 3
    assert_ops(run.after, absent=[enn.gemm_bias_act])
    # the one activation it recognized: gelu on y3, whose pre-activation is also an output
    assert [(c["choice"], c["act"]) for c in run.choices] == [("inductor", "gelu")]
    with torch.no_grad(), caplog.at_level(logging.DEBUG, logger="enn_backend.passes.epilogue"):
        got = _compile(f)(x)
        want = f(x)
    assert "declined" in caplog.text
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_actionable_decline_records_pass_skipped(monkeypatch):
    # a CPU without native fp16 GEMM: the user could switch to bf16, so it is reported
    monkeypatch.setattr(G, "hw_caps", lambda device_type: G.HwCaps("cpu", onednn=True, onednn_bf16=True))
    model = MLP(acts=("gelu", "relu")).to(torch.float16)
    with torch.no_grad():
        _compile(model)(torch.randn(4, 16, dtype=torch.float16))
    skipped = [f for f in enn_backend.report().fallbacks if f.kind == FallbackKind.PASS_SKIPPED.value]
    assert len(skipped) == 1 and "2 GEMM(s)" in skipped[0].reason and "fp16" in skipped[0].reason
    run = run_passes(model, (torch.randn(4, 16, dtype=torch.float16),), ["epilogue"], training=False)
    assert count_ops(run.after, aten.addmm) == 2 and count_ops(run.after, enn.gemm_bias_act) == 0


def test_option_and_env_switch_the_pass_off(monkeypatch):
    model = MLP(acts=("relu",)).to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    run = run_passes(model, (x,), ["epilogue"], training=False, options={"epilogue": False})
    assert_ops(run.after, present=[aten.addmm], absent=[enn.gemm_bias_act])
    assert not run.choices
    monkeypatch.setenv("ENN_EPILOGUE", "0")
    run = run_passes(model, (x,), ["epilogue"], training=False)
    assert_ops(run.after, present=[aten.addmm], absent=[enn.gemm_bias_act])
    monkeypatch.delenv("ENN_EPILOGUE")
    run = run_passes(model, (x,), ["epilogue"], training=False)
    assert_ops(run.after, present=[enn.gemm_bias_act], absent=[aten.addmm])


def test_direct_call_lowers_to_inductor_ir(monkeypatch):
    """fp32 on CPU: the lowering emits Inductor's addmm + pointwise, never the op's Python impl."""
    calls = []
    real = G.run_aten
    monkeypatch.setattr(G, "run_aten", lambda *a: calls.append(1) or real(*a))
    w = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(8, requires_grad=True)

    def f(x):
        return torch.ops.enn.gemm_bias_act(x, w, b, "gelu_tanh")

    x = torch.randn(2, 4, 16, requires_grad=True)
    got = _compile(f)(x)
    assert calls == []
    want = F.gelu(F.linear(x, w, b), approximate="tanh")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(got)
    for a, e in zip(torch.autograd.grad(got, (x, w, b), g), torch.autograd.grad(want, (x, w, b), g)):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("act, kernel", [("relu", "cublaslt"), ("gelu_tanh", "cublaslt"), ("gelu", "inductor")])
def test_gpu_cublaslt_epilogue(act, kernel):
    torch.manual_seed(0)
    model = MLP(dim=64, acts=(act,)).cuda().to(torch.bfloat16)
    x = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        got = _compile(model)(x)
        eager = model(x)
        ref = MLP(dim=64, acts=(act,)).cuda().double()
        ref.load_state_dict(model.state_dict())
        ref64 = ref(x.double())
    assert enn_backend.report().fusions().get("epilogue", 0) == (1 if kernel == "cublaslt" else 0)
    assert [c["choice"] for c in _choices()] == [kernel]
    _close_to_fp64(got, eager, ref64)


def test_cublaslt_lowering_path_on_cpu(monkeypatch):
    """The cuBLASLt branch of the lowering (extern aten._addmm_activation), run on CPU for relu:
    CPU's _addmm_activation computes the same relu, so the Inductor extern mechanics are tested."""
    orig = G.select_kernel

    def select(p, caps=None, measurement=None):
        if p.act == "relu" and p.has_bias:
            return G.KernelChoice(G.GemmKernel.CUBLASLT, "test: forced")
        return orig(p, caps, measurement)

    monkeypatch.setattr(G, "select_kernel", select)
    monkeypatch.setattr(G, "run_cublaslt", lambda *a: pytest.fail("eager op impl called from compiled code"))
    torch.manual_seed(0)
    model = MLP(acts=("relu", "relu"))
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        got = _compile(model)(x)
        want = model(x)
    assert [c["choice"] for c in _choices()] == ["cublaslt", "cublaslt"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(G, "run_cublaslt", P.run_cublaslt)  # the harness runs the graph eagerly: the op's body
    run = run_passes(model, (x,), ["epilogue"], training=False)
    assert _fused_acts(run.after) == ["relu", "relu"] and count_ops(run.after, aten.addmm) == 0
