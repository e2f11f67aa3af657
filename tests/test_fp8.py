"""FP8 GEMMs (option ``fp8``): enn::fp8_mm, its FP8 bound, the pass's rules, the guard's demotion.

CPU: torch's CPU ``_scaled_mm`` runs both recipes on this torch, so CPU is eligible (the pass
probes it); shapes here are small, which on CPU has no minimum beyond multiples of 16.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import torch.nn as nn

import enn_backend
from enn_backend import compat
from enn_backend.custom_ops import fp8 as F8
from enn_backend.options import Options, OptionsError
from enn_backend.passes import fp8 as P
from enn_backend.report import FallbackKind
from pass_harness import find_ops, run_passes

enn = torch.ops.enn
pytestmark = pytest.mark.skipif(not F8.cpu_scaled_mm_works(torch.bfloat16, "rowwise")[0],
                                reason="this torch's CPU _scaled_mm cannot run FP8 GEMMs")


class Net(nn.Module):
    """Six linear layers, one per rule: 0 first, 1 FP8, 2 (N=24) and 3 (K=24) shapes off the
    multiple of 16, 4 excluded (``fp8_exclude="layers.4"``), 5 last. Tokens: 4 x 16 = 64."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        dims = [(32, 64), (64, 64), (64, 24), (24, 64), (64, 64), (64, 16)]
        self.layers = nn.ModuleList(nn.Linear(i, o) for i, o in dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for i, layer in enumerate(self.layers):
                x = layer(x)
                x = torch.relu(x) if i < len(self.layers) - 1 else x
        return x.float().pow(2).mean()


OPTS = {"fp8_exclude": "layers.4", "persist": True, "repro": True}


def _x() -> torch.Tensor:
    return torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1))


# ----------------------------------------------------------------- options
def test_unknown_fp8_value_is_refused_naming_the_valid_ones(monkeypatch):
    with pytest.raises(OptionsError, match="off, rowwise, tensorwise"):
        Options.from_sources({"fp8": "fp4"}, environ={})
    with pytest.raises(OptionsError, match="off, rowwise, tensorwise"):
        Options.from_sources({}, environ={"ENN_FP8": "delayed"})
    assert Options.from_sources({}, environ={"ENN_FP8": "tensorwise"}).fp8 == "tensorwise"
    assert Options.from_sources({}, environ={}).fp8 == "off"


# ----------------------------------------------------------------- the op and its bound
@pytest.mark.parametrize("recipe", F8.RECIPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_op_values_and_gradients_within_the_fp8_bound(recipe, dtype):
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(48, 64, generator=g) * 3).to(dtype).requires_grad_(True)
    b = (torch.randn(64, 32, generator=g) / 5).to(dtype).requires_grad_(True)
    bias = torch.randn(32, generator=g).to(dtype)
    out = enn.fp8_mm(a, b, bias, recipe, "e4m3", "e4m3")
    exact = a.detach().double() @ b.detach().double() + bias.double()
    bound = F8.error_bound(a.detach(), b.detach(), recipe, "e4m3", "e4m3")
    err = (out.detach().double() - exact).abs()
    assert out.dtype == dtype and bool((err <= bound).all()), float((err / bound).max())
    # FP8's error is real (not a bf16 GEMM in disguise): well above bf16's own rounding
    assert float(err.max()) > 4 * float((torch.mm(a, b).detach().double() + bias.double() - exact).abs().max())
    # gradients: FP8 GEMMs in the recipe's gradient format, each within its own bound
    grad = torch.randn(48, 32, generator=g).to(dtype)
    ga, gb = torch.autograd.grad(out, (a, b), grad)
    g_fmt = F8.formats_for(recipe, True, False)[0]
    assert g_fmt == ("e5m2" if recipe == "tensorwise" else "e4m3")
    for got, (x, y, fx, fy) in ((ga, (grad, b.detach().t(), g_fmt, "e4m3")), (gb, (a.detach().t(), grad, "e4m3", g_fmt))):
        e = (got.double() - x.double() @ y.double()).abs()
        assert bool((e <= F8.error_bound(x, y, recipe, fx, fy)).all())


def test_safe_path_is_the_gemm_in_its_own_dtype():
    from enn_backend.custom_ops.pinned import SAFE_PATHS

    a, b, bias = torch.randn(16, 32).bfloat16(), torch.randn(32, 16).bfloat16(), torch.randn(16).bfloat16()
    assert torch.equal(SAFE_PATHS["enn.fp8_mm.default"](a, b, bias, "rowwise", "e4m3", "e4m3"), torch.addmm(bias, a, b))


def test_opcheck():
    for args, kwargs in F8.OPCHECK_SAMPLES()["enn::fp8_mm"]:
        torch.library.opcheck(enn.fp8_mm.default, args, kwargs)


# ----------------------------------------------------------------- the pass
def _choices(run) -> dict[str, list[dict]]:
    by_module: dict[str, list[dict]] = {}
    for c in run.choices:
        if "role" in c:
            by_module.setdefault(c["module"], []).append(c)
    return by_module


@pytest.mark.parametrize("recipe", F8.RECIPES)
def test_rewrite_structure_and_reasons(recipe):
    run = run_passes(Net(), [_x()], passes=["fp8"], options={"fp8": recipe, "fp8_exclude": "layers.4"})
    ops = find_ops(run.after, enn.fp8_mm.default)
    # layer 1 only: its forward GEMM and both gradient GEMMs
    assert run.matches == {"fp8": 3} and len(ops) == 3
    formats = sorted((n.args[4], n.args[5]) for n in ops)
    grad = "e5m2" if recipe == "tensorwise" else "e4m3"
    assert formats == sorted([("e4m3", "e4m3"), (grad, "e4m3"), (grad, "e4m3")])
    assert all(n.args[3] == recipe and n.meta["val"].dtype == torch.bfloat16 for n in ops)
    by_module = _choices(run)
    assert {c["choice"] for c in by_module["layers.1"]} == {"fp8"}
    assert {c["role"] for c in by_module["layers.1"]} == {"forward", "backward"}
    scales = "per row of a, per column of b (power of 2)" if recipe == "rowwise" else "per tensor"
    assert all(c["scales"] == scales for c in by_module["layers.1"])
    why = {m: {c["reason"].split(": ")[1] for c in cs} for m, cs in by_module.items() if m != "layers.1"}
    assert all(c["choice"] == "bfloat16" for m, cs in by_module.items() if m != "layers.1" for c in cs)
    assert why["layers.0"] == {"layer"} and "first layer" in by_module["layers.0"][0]["reason"]
    assert why["layers.5"] == {"layer"} and "last layer" in by_module["layers.5"][0]["reason"]
    assert why["layers.4"] == {"layer"} and "fp8_exclude 'layers.4'" in by_module["layers.4"][0]["reason"]
    assert why["layers.2"] == why["layers.3"] == {"shape"}
    assert "multiple of 16" in by_module["layers.2"][0]["reason"]


def test_off_by_default_and_a_recorded_no_op_where_unsupported(monkeypatch, caplog):
    run = run_passes(Net(), [_x()], passes=["fp8"])
    assert run.matches == {"fp8": 0} and not find_ops(run.after, enn.fp8_mm.default)
    monkeypatch.setattr(P, "device_support", lambda *a: (False, "this torch's CPU _scaled_mm cannot: probe"))
    enn_backend.reset()
    with caplog.at_level(logging.WARNING, logger="enn_backend"):
        run = run_passes(Net(), [_x()], passes=["fp8"], options={"fp8": "rowwise"})
    assert run.matches == {"fp8": 0} and not find_ops(run.after, enn.fp8_mm.default)
    skipped = [f for f in enn_backend.report().fallbacks if f.kind == FallbackKind.PASS_SKIPPED.value]
    assert len(skipped) == 1 and "fp8='rowwise' is a no-op here" in skipped[0].reason and "probe" in skipped[0].reason
    assert any("no-op here" in r.getMessage() for r in caplog.records)


def test_shape_rule():
    assert P.shape_reason(64, 64, 64, "cpu") == ""
    assert "multiple of 16" in P.shape_reason(64, 24, 64, "cpu")
    assert P.shape_reason(2048, 2048, 2048, "cuda") == ""
    assert "MNK/(MK+KN)" in P.shape_reason(64, 64, 64, "cuda")


# ----------------------------------------------------------------- the guard
def _train(options: dict, steps: int = 2):
    model = Net()
    compiled = torch.compile(model, backend="enn", options={**OPTS, **options})
    x = _x()
    for _ in range(steps):
        model.zero_grad()
        compiled(x).backward()
    return model


def _pins() -> dict[str, list[str]]:
    """graph id -> the modules of its pinned ops."""
    out = {}
    for g in enn_backend.report().graphs:
        out[g.id] = sorted({g.sites.get(n, {}).get("module", "?") for n in g.pinned})
    return out


def _assert_close_to_bf16(grads: list[torch.Tensor]) -> None:
    """Each gradient points where eager bf16's does (cosine >= 0.95): FP8's rounding in the
    layer's GEMMs moves it by a few percent; a wrong or non-finite value does not pass."""
    model = Net()
    model(_x()).backward()
    for got, want in zip(grads, [p.grad for p in model.parameters()]):
        cos = torch.nn.functional.cosine_similarity(got.flatten().double(), want.flatten().double(), dim=0)
        assert float(cos) >= 0.95, float(cos)


@pytest.mark.parametrize("spec, phase", [("enn.fp8_mm:nan:bwd", "backward"),
                                         ("enn.fp8_mm:inf:fwd", "forward"),
                                         ("enn.fp8_mm:scale1.5:fwd", "forward"),
                                         ("enn.fp8_mm:scale1.05:fwd", "forward")])
def test_injected_fault_demotes_only_the_fp8_layer(spec, phase, tmp_path):
    model = _train({"fp8": "rowwise", "fault_inject": spec})
    grads = [p.grad for p in model.parameters()]
    assert all(bool(torch.isfinite(g).all()) for g in grads)  # nothing non-finite reaches an optimizer
    _assert_close_to_bf16(grads)
    pins = _pins()
    faulted = [gid for gid, mods in pins.items() if mods]
    assert all(pins[g] == ["layers.1"] for g in faulted) and any(g.endswith(phase) for g in faulted), pins
    kinds = {f.kind for f in enn_backend.report().fallbacks if f.phase != "compile"}
    assert kinds & {"nonfinite", "value"}
    # the pinned op runs the GEMM in bf16 inside the compiled graph; the rest stays compiled
    rec = next(g for g in enn_backend.report().graphs if g.id.endswith(phase))
    assert rec.path == "inductor" and rec.compiled_nodes > 0
    # recorded in kernel state, with a repro script
    cache = os.environ["ENN_CACHE_DIR"]
    files = [f for f in os.listdir(cache) if f.startswith("kernel_state-inject-") and f.endswith(".json")]
    state = json.dumps([json.load(open(os.path.join(cache, f))) for f in files])
    assert '"enn.fp8_mm|inductor-cpu|cpu|bfloat16|' in state, state
    repros = os.listdir(os.environ["ENN_REPRO_DIR"])
    assert any("fp8_mm" in r for r in repros), repros


def test_no_fault_keeps_fp8_and_trains_close_to_bf16():
    model = _train({"fp8": "tensorwise"})
    assert all(not mods for mods in _pins().values())
    assert enn_backend.report().graphs[0].fusions.get("fp8") == 3
    _assert_close_to_bf16([p.grad for p in model.parameters()])


class Deep(Net):
    """Six 64 x 64 linear layers: four FP8 layers (1-4) between the first and the last."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(i, 64) for i in (32, 64, 64, 64, 64, 64))


def test_fault_scoped_to_one_module_demotes_exactly_that_fp8_layer():
    """``enn.fp8_mm/layers.2`` plants the backward NaN in layer 2's FP8 GEMMs only: the guard
    demotes layer 2 and no other of the four FP8 layers (unscoped, the fault strikes all four)."""
    model = Deep()
    compiled = torch.compile(model, backend="enn", options={"fp8": "rowwise", "persist": False,
                                                            "fault_inject": "enn.fp8_mm/layers.2:nan:bwd"})
    for _ in range(2):
        model.zero_grad()
        compiled(_x()).backward()
        assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    assert enn_backend.report().graphs[0].fusions.get("fp8") == 12  # 4 layers x (forward + 2 gradient GEMMs)
    pins = _pins()
    assert any(g.endswith("backward") and mods == ["layers.2"] for g, mods in pins.items()), pins
    assert all(mods in ([], ["layers.2"]) for mods in pins.values()), pins
    assert not [f for f in enn_backend.report().fallbacks if f.kind == "fault_not_planted"]


# ----------------------------------------------------------------- the guard's FP8 reference
class Net32(Net):
    """:class:`Net` computing in fp32 (no autocast): the value checks' fp32 tolerances (rtol 1e-4)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x = torch.relu(x) if i < len(self.layers) - 1 else x
        return x.pow(2).mean()


def _train32(options: dict, steps: int = 2) -> Net32:
    model = Net32()
    compiled = torch.compile(model, backend="enn", options={**OPTS, **options})
    for _ in range(steps):
        model.zero_grad()
        compiled(_x()).backward()
    return model


@pytest.mark.parametrize("recipe", F8.RECIPES)
def test_reference_path_is_fp8_emulated(recipe):
    """The guard's reference of enn::fp8_mm is FP8 emulated: the kernel's result up to the order
    of its fp32 sums, far closer than the GEMM in its own dtype (the safe path)."""
    from enn_backend.custom_ops.pinned import SAFE_PATHS, reference_path

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 64, generator=g) * 3, torch.randn(64, 48, generator=g) / 5
    bias = torch.randn(48, generator=g)
    for fa, fb in {F8.formats_for(recipe, False, False), F8.formats_for(recipe, True, False)}:
        got = enn.fp8_mm(a, b, bias, recipe, fa, fb)
        ref = reference_path("enn.fp8_mm.default")(a, b, bias, recipe, fa, fb)
        safe = SAFE_PATHS["enn.fp8_mm.default"](a, b, bias, recipe, fa, fb)
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got, safe, rtol=1e-2, atol=1e-2)
        ref64 = reference_path("enn.fp8_mm.default")(a.double(), b.double(), bias.double(), recipe, fa, fb)
        assert ref64.dtype == torch.float64 and torch.allclose(ref64, ref.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", F8.RECIPES)
def test_fp32_model_passes_its_value_checks_with_fp8(recipe):
    """An fp32 model with FP8 GEMMs: its value checks (first calls, forward and backward) find
    nothing -- FP8's rounding is what the reference computes too -- and FP8 stays."""
    _train32({"fp8": recipe})
    graphs = enn_backend.report().graphs
    assert graphs[0].fusions.get("fp8") == 3
    assert all(not mods for mods in _pins().values()), _pins()
    assert {g.phase for g in graphs if g.counters.get("value_checks")} == {"forward", "backward"}
    runtime = [(f.kind, f.reason) for f in enn_backend.report().fallbacks if f.phase != "compile"]
    assert runtime == []
    # the unit's Dynamo-graph reference (un-quantized GEMMs) is off, and says so
    assert enn_backend.report().counters["guard.dynamo_reference_off"] == 1


def test_fp32_model_finite_drift_of_5_percent_demotes_only_that_layer():
    """A finite drift of one FP8 GEMM (its result scaled 1.05) is caught by the forward's first
    value check against FP8 emulated, and demotes layer 1 only. (FP8's worst-case bound,
    ``error_bound``, allows about 2^-3 relative error against the exact product, so 1.05 is
    inside it; the guard does not judge by that bound but against FP8 emulated, at fp32's
    tolerance, where 1.05 is far outside.)"""
    # every call value-checked: after the demotion, the demoted GEMM is judged as the plain GEMM
    model = _train32({"fp8": "rowwise", "fault_inject": "enn.fp8_mm:scale1.05:fwd", "guard_values": 1}, steps=3)
    pins = _pins()
    faulted = [gid for gid, mods in pins.items() if mods]
    assert faulted and all(pins[g] == ["layers.1"] for g in faulted) and any(g.endswith("forward") for g in faulted), pins
    runtime = [f for f in enn_backend.report().fallbacks if f.phase != "compile"]
    # one fault, in the forward; the backward's GEMMs of the layer go with it (kernel state)
    assert [(f.kind, f.graph) for f in runtime if f.kind != "pinned_from_state"] == [("value", "g0/forward")], \
        [(f.kind, f.graph, f.reason) for f in runtime]
    assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())


def test_fp8_kernel_state_is_keyed_by_the_layer_not_by_the_shape():
    """Layers 1 and 4 are FP8 GEMMs of the same shapes (64 x 64, nothing excluded). Their kernel
    state keys name the layer: a pin of layer 1's forward GEMM applies to layer 1's backward
    GEMMs too, and to no GEMM of layer 4 (with a key by shape, a demotion spread to every
    layer's same projection)."""
    from enn_backend.guard.kernel_entry import node_key

    run = run_passes(Net32(), (_x(),), ["fp8"], training=True, options={"fp8": "rowwise", "fp8_exclude": ""})
    keys: dict[str, list[str]] = {}
    for n in find_ops(run.after, enn.fp8_mm):
        keys.setdefault(node_key(n), []).append(n.name)
    assert sorted(k.rsplit("|", 1)[1] for k in keys) == ["layer=layers.1", "layer=layers.4"], keys
    assert all(len(names) == 3 for names in keys.values()), keys  # forward + two gradient GEMMs each


# ----------------------------------------------------------------- the lowering (lowerings/fp8.py)
class Pair(nn.Module):
    """Two FP8 linear layers (``l1``, ``l2``) between a first and a last layer the pass keeps in
    their dtype. Those two have no bias, so that they are the same ``mm`` compiled and eager and
    the FP8 layers see the same operands in both."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(32, 64, bias=False)
        self.l1 = nn.Linear(64, 64)
        self.l2 = nn.Linear(64, 64)
        self.out = nn.Linear(64, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = torch.relu(self.l1(h))
        h = torch.relu(self.l2(h))
        return self.out(h)


def _pair_eager(m: Pair, x: torch.Tensor, recipe: str) -> torch.Tensor:
    """:class:`Pair` with its two FP8 layers as eager ``enn::fp8_mm`` calls (the op's own kernel and autograd)."""
    h = torch.relu(m.inp(x))
    for layer in (m.l1, m.l2):
        y = enn.fp8_mm(h.reshape(-1, h.shape[-1]), layer.weight.t(), layer.bias, recipe, "e4m3", "e4m3")
        h = torch.relu(y.reshape(*h.shape[:-1], -1))
    return m.out(h)


def _skip_unless_cpu_runs(dtype: torch.dtype, recipe: str) -> None:
    ok, why = F8.cpu_scaled_mm_works(dtype, recipe)
    if not ok:
        pytest.skip(f"this torch's CPU _scaled_mm cannot run {recipe} with {dtype} results: {why}")


def _compiled_code(fn):
    """``(fn(), Inductor's output code of every graph compiled meanwhile)``."""
    from torch._inductor.utils import run_and_get_code

    return run_and_get_code(fn)


def _assert_lowered(codes: list[str], gemms: int) -> None:
    """The generated code of a graph holding ``gemms`` lowered enn::fp8_mm: no extern call of the
    op, one ``_scaled_mm`` per GEMM, and the quantization (abs, amax, scale, clamp, cast to FP8)
    inside generated C++ kernels, not as ATen calls."""
    import re

    assert not any("torch.ops.enn.fp8_mm" in c for c in codes)
    assert sum(c.count("extern_kernels._scaled_mm(") for c in codes) == gemms
    kernels = [k for c in codes for k in re.findall(r"async_compile\.cpp_pybinding\(.*?'''\)", c, re.S)]
    assert sum("Float8_e4m3fn" in k for k in kernels) >= 1  # the casts to FP8 are generated code
    called = {name for c in codes for name in re.findall(r"extern_kernels\.(\w+)\(", c)}
    assert called <= {"mm", "addmm", "_scaled_mm"}, called
    assert not any("torch.ops.aten." in c for c in codes)  # no quantization step left to eager ATen


@pytest.mark.parametrize("recipe", F8.RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lowered_fp8_layers_equal_the_eager_op(recipe, dtype):
    """A model with two FP8 linear layers compiled by enn: the FP8 GEMMs are lowered (quantization
    in generated kernels, one ``_scaled_mm`` each) and the forward result and every gradient are
    those of the eager ``enn::fp8_mm`` op (bitwise here; up to fp32 summation order for a bias
    gradient, which Inductor reduces in its own order)."""
    _skip_unless_cpu_runs(dtype, recipe)
    m = Pair().to(dtype)
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    g = torch.randn(4, 16, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    compiled = torch.compile(m, backend="enn", options={"fp8": recipe, "guard": "off", "fx_graph_cache": False})

    def step() -> torch.Tensor:
        y = compiled(x)
        y.backward(g)
        return y

    y, codes = _compiled_code(step)
    grads = [p.grad.clone() for p in m.parameters()]
    assert enn_backend.report().graphs[0].fusions.get("fp8") == 6  # l1, l2: forward + two gradient GEMMs each
    _assert_lowered(codes, 6)
    m.zero_grad()
    want = _pair_eager(m, x, recipe)
    want.backward(g)
    for (name, p), got in zip([("output", None), *m.named_parameters()], [y, *grads]):
        ref = want if p is None else p.grad
        err = float((got.detach() - ref.detach()).abs().max())
        assert got.dtype == ref.dtype and err <= 1e-6 * float(ref.detach().abs().max()), (name, err)


@pytest.mark.parametrize("recipe", F8.RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lowered_op_within_the_fp8_bound(recipe, dtype):
    """The op compiled alone (its forward and both gradient GEMMs lowered): the values and
    gradients of the eager op on the same inputs, each within ``error_bound`` of the exact GEMM."""
    _skip_unless_cpu_runs(dtype, recipe)
    gen = torch.Generator().manual_seed(0)
    a0 = (torch.randn(48, 64, generator=gen) * 3).to(dtype)
    b0 = (torch.randn(64, 32, generator=gen) / 5).to(dtype)
    bias = torch.randn(32, generator=gen).to(dtype)
    grad = torch.randn(48, 32, generator=gen).to(dtype)

    def f(a, b):
        return enn.fp8_mm(torch.relu(a), b, bias, recipe, "e4m3", "e4m3")

    a, b = a0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
    compiled = torch.compile(f, backend="enn", options={"guard": "off", "fx_graph_cache": False})

    def step() -> torch.Tensor:
        out = compiled(a, b)
        out.backward(grad)
        return out

    out, codes = _compiled_code(step)
    _assert_lowered(codes, 3)
    ae, be = a0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
    want = f(ae, be)
    want.backward(grad)
    assert torch.equal(out, want) and torch.equal(a.grad, ae.grad) and torch.equal(b.grad, be.grad)
    r = torch.relu(a0)
    exact = r.double() @ b0.double() + bias.double()
    assert bool(((out.detach().double() - exact).abs() <= F8.error_bound(r, b0, recipe, "e4m3", "e4m3")).all())
    g_fmt = F8.formats_for(recipe, True, False)[0]
    ga = grad.double() @ b0.double().t()
    assert bool(((b.grad.double() - r.double().t() @ grad.double()).abs()
                 <= F8.error_bound(r.t(), grad, recipe, "e4m3", g_fmt)).all())
    assert bool(((a.grad.double() - ga * (r > 0)).abs()
                 <= F8.error_bound(grad, b0.t(), recipe, g_fmt, "e4m3").masked_fill(r <= 0, 0)).all())


def test_lowering_falls_back_to_the_extern_op_where_scaled_mm_refuses(monkeypatch, caplog):
    """Where Inductor's lowering of ``_scaled_mm`` refuses a call, the op is the extern call of its
    eager kernel (same values), counted in the report every time, logged at INFO once per reason, and the scheduler drops the
    quantization the lowering had built."""
    from enn_backend.lowerings import fp8 as LF

    def refuse(*args, **kwargs):
        raise RuntimeError("mat_b must be col_major (test)")

    real = compat.inductor_lowering
    monkeypatch.setattr(LF.compat, "inductor_lowering",
                        lambda op: refuse if op is torch.ops.aten._scaled_mm.default else real(op))
    monkeypatch.setattr(LF, "_logged", set())
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 64, generator=gen).bfloat16(), torch.randn(64, 16, generator=gen).bfloat16()

    def f(a, b):
        return enn.fp8_mm(a, b, None, "tensorwise", "e4m3", "e4m3")

    with caplog.at_level(logging.INFO, logger="enn_backend.lowerings.fp8"):
        for _ in range(2):
            out, codes = _compiled_code(lambda: torch.compile(f, backend="enn", options={
                "guard": "off", "fx_graph_cache": False})(a, b))
    assert torch.equal(out, f(a, b))
    assert all("torch.ops.enn.fp8_mm.default(" in c and "_scaled_mm" not in c and "Float8" not in c for c in codes)
    logged = [r.getMessage() for r in caplog.records if "not lowered" in r.getMessage()]
    assert len(logged) == 1 and "mat_b must be col_major (test)" in logged[0], logged
    assert enn_backend.report().counters["fp8.not_lowered"] == 2  # each compile's GEMM counted


def test_pinned_fp8_gemm_runs_its_safe_path_beside_lowered_ones():
    """With the lowering present, a faulty FP8 GEMM is still demoted alone: a NaN in layer 1's
    gradient GEMMs pins those GEMMs of the backward graph to ``enn::pinned`` (the GEMM in bf16),
    and the forward graph keeps layer 1's FP8 GEMM lowered (no extern call of enn::fp8_mm
    anywhere). (A fault in the forward GEMM demotes the layer's backward GEMMs with it: kernel
    state is keyed by the layer.)"""
    model, codes = _compiled_code(lambda: _train({"fp8": "rowwise", "fault_inject": "enn.fp8_mm:nan:bwd",
                                                  "fx_graph_cache": False}))
    assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    _assert_close_to_bf16([p.grad for p in model.parameters()])
    assert _pins() == {"g0/forward": [], "g0/backward": ["layers.1"]}, _pins()
    assert not any("torch.ops.enn.fp8_mm" in c for c in codes)

    def args_line(code: str) -> str:
        return code[code.index("def call"):].split("\n", 2)[1]

    forward = [c for c in codes if "primals_" in args_line(c) and "tangents_" not in args_line(c)]
    backward = [c for c in codes if "tangents_" in args_line(c)]
    pinned_fp8 = '"op": "enn.fp8_mm.default"'
    assert forward and all(pinned_fp8 not in c and c.count("extern_kernels._scaled_mm(") == 1 for c in forward)
    # the pinned backward: both gradient GEMMs of layer 1 on their safe path, no FP8 GEMM left
    assert any(c.count(pinned_fp8) == 2 and "_scaled_mm" not in c for c in backward)


class SharedInput(nn.Module):
    """Three FP8 projections of one activation (``q``, ``k``, ``v``, as attention's), between a
    first and a last layer the pass keeps in their dtype."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(32, 64, bias=False)
        self.q, self.k, self.v = (nn.Linear(64, 64, bias=False) for _ in range(3))
        self.out = nn.Linear(64, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.out(torch.relu(self.q(h)) * torch.sigmoid(self.k(h)) + self.v(h))


@pytest.mark.parametrize("recipe", F8.RECIPES)
def test_gemms_of_one_graph_quantize_a_shared_operand_once(recipe, monkeypatch):
    """The q, k and v GEMMs read one activation: the forward graph quantizes it once for the three
    (two quantizations shared), and so does the backward for their weight-gradient GEMMs, which
    read it transposed (two more). Under ``tensorwise`` each output gradient's scale, taken for
    its input-gradient GEMM, serves its weight-gradient GEMM too, which reads it transposed (three
    scales shared). Values and gradients are bit for bit those of the same compile with every
    GEMM quantizing its own operands: sharing changes no result."""
    from enn_backend.lowerings import fp8 as LF

    dtype = torch.bfloat16
    _skip_unless_cpu_runs(dtype, recipe)
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    g = torch.randn(4, 16, 16, generator=torch.Generator().manual_seed(2)).to(dtype)

    def run() -> tuple[torch.Tensor, list[torch.Tensor], dict]:
        torch._dynamo.reset()
        enn_backend.reset()
        m = SharedInput().to(dtype)
        y = torch.compile(m, backend="enn", options={"fp8": recipe, "guard": "off", "fx_graph_cache": False})(x)
        y.backward(g)
        assert enn_backend.report().graphs[0].fusions.get("fp8") == 9  # q, k, v: forward + two gradient GEMMs each
        return y, [p.grad for p in m.parameters()], dict(enn_backend.report().counters)

    y, grads, counters = run()
    assert counters["fp8.quantizations_shared"] == 4, counters
    assert counters.get("fp8.scales_shared", 0) == (3 if recipe == "tensorwise" else 0), counters

    monkeypatch.setattr(LF._Shared, "of_this_graph", classmethod(lambda cls: cls()))  # each GEMM on its own
    y_alone, grads_alone, counters = run()
    assert not counters.get("fp8.quantizations_shared") and not counters.get("fp8.scales_shared"), counters
    assert torch.equal(y, y_alone)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_alone))


# ----------------------------------------------------------------- FP8 in the user's own code
def _user_fp8_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A dynamically scaled FP8 linear written by hand, as torchao's ``Float8Linear`` emits it:
    FP8 casts and ``torch._scaled_mm`` in the graph Dynamo hands over."""
    fmax = torch.finfo(torch.float8_e4m3fn).max
    sx = fmax / x.abs().amax().float().clamp(min=1e-12)
    sw = fmax / w.abs().amax().float().clamp(min=1e-12)
    qx = (x.float() * sx).clamp(-fmax, fmax).to(torch.float8_e4m3fn)
    qw = (w.float() * sw).clamp(-fmax, fmax).to(torch.float8_e4m3fn)
    return torch._scaled_mm(qx, qw.t(), scale_a=sx.reciprocal(), scale_b=sw.reciprocal(), out_dtype=x.dtype)


def test_a_unit_computing_in_fp8_itself_has_no_dynamo_graph_reference():
    """A unit whose own code quantizes to FP8 (torchao, hand-written) is compiled and guarded as
    any other, but not compared with its Dynamo graph run eagerly: compiled and eager quantization
    may round values to neighbouring FP8 values with no fault, and that reference's fp64 judge
    cannot run ``_scaled_mm`` (fp32 scales only). Said once, counted; nothing blamed."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=gen).bfloat16()
    w = torch.randn(48, 64, generator=gen).bfloat16()
    got = torch.compile(_user_fp8_linear, backend="enn")(x, w)
    want = _user_fp8_linear(x, w)
    torch.testing.assert_close(got.float(), want.float(), rtol=0.1, atol=0.1 * float(want.abs().max()))
    assert enn_backend.report().counters["guard.dynamo_reference_off"] == 1
    assert enn_backend.report().to_dict()["fallbacks"] == []
