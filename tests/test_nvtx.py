"""NVTX ranges (option ``nvtx``): the names torch.profiler records for fused sites and pinned ops,
and nothing at all when the option is off."""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from enn_backend import nvtx
from enn_backend.custom_ops import gemm_policy as P
from enn_backend.custom_ops.pinned import make_spec


def _enn_ranges(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sorted({e.name for e in prof.events() if e.name.startswith("enn/")})


class Block(nn.Module):
    """Causal attention (CPU inference: ATen's CPU flash kernel) and a GELU MLP (bf16: oneDNN)."""

    def __init__(self, d: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.up = nn.Linear(d, 64)
        self.down = nn.Linear(64, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in self.qkv(x).split(c, dim=-1))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        keep = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device))
        y = (att.masked_fill(~keep, float("-inf")).softmax(-1) @ v).transpose(1, 2).reshape(b, t, c)
        return y + self.down(F.gelu(self.up(y)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.skipif(not P.hw_caps("cpu").onednn_bf16, reason="needs oneDNN's native bf16 GEMM")
def test_fused_sites_are_named_ranges_and_off_adds_nothing():
    torch.manual_seed(0)
    model = Model().to(torch.bfloat16)
    x = torch.randn(2, 128, 32, dtype=torch.bfloat16)
    on = torch.compile(model, backend="enn", options={"nvtx": True, "guard": "off"})
    off = torch.compile(model, backend="enn", options={"guard": "off"})
    with torch.no_grad():
        want = off(x)
        got = on(x)
        names = _enn_ranges(lambda: on(x))
        assert _enn_ranges(lambda: off(x)) == []
    assert names == ["enn/attention/cpu_flash layers.0", "enn/epilogue/onednn layers.0.up"], names
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_pinned_op_runs_in_its_range():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    template = {"args": {"l": [{"t": 0}, {"t": 1}]}, "kwargs": {}}
    name = nvtx.range_name("pinned", "aten.mm", "model.mlp.up")
    spec = make_spec(torch.ops.aten.mm.default, template, range_name=name)
    assert _enn_ranges(lambda: torch.ops.enn.pinned(spec, [a, b], [])) == ["enn/pinned/aten.mm model.mlp.up"]
    plain = make_spec(torch.ops.aten.mm.default, template)
    assert "range" not in json.loads(plain)
    assert _enn_ranges(lambda: torch.ops.enn.pinned(plain, [a, b], [])) == []


def test_an_op_the_guard_pins_runs_in_its_range(tmp_path, monkeypatch):
    """A NaN planted in the forward GEMMs: the guard pins them, and the rebuilt graph runs each
    pinned op in ``enn/pinned/aten.addmm <module path>`` (with option nvtx only)."""
    monkeypatch.setenv("ENN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ENN_FAULT_INJECT", "aten.addmm:nan:fwd")
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(4, 8)
    opts = {"attention": False, "epilogue": False}
    on = torch.compile(mlp, backend="enn", options={**opts, "nvtx": True})
    with torch.no_grad():
        for _ in range(3):  # the first call finds the fault and pins; later calls run pinned
            got = on(x)
        names = _enn_ranges(lambda: on(x))
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, mlp(x))
        assert names == ["enn/pinned/aten.addmm 0", "enn/pinned/aten.addmm 2"], names
        torch._dynamo.reset()
        off = torch.compile(mlp, backend="enn", options=opts)
        for _ in range(3):
            off(x)
        assert _enn_ranges(lambda: off(x)) == []


def test_the_guards_hooks():
    assert nvtx.range_name("fp32", "graph", "g0") == "enn/fp32/graph g0"
    assert nvtx.range_name("eager", "graph") == "enn/eager/graph"
    with pytest.raises(ValueError, match="kind"):
        nvtx.range_name("fused", "x")
    assert isinstance(nvtx.maybe_range(False, "fp32", "graph", "g0"), contextlib.nullcontext)

    def run():
        with nvtx.maybe_range(True, "fp32", "graph", "g0"):
            torch.ones(2).sum()

    assert _enn_ranges(run) == ["enn/fp32/graph g0"]
    fn = lambda t: t + 1  # noqa: E731
    assert nvtx.wrap(fn, False, "eager", "graph", "g1") is fn
    assert _enn_ranges(lambda: nvtx.wrap(fn, True, "eager", "graph", "g1")(torch.ones(2))) == ["enn/eager/graph g1"]


@pytest.mark.skipif(not P.hw_caps("cpu").onednn_bf16, reason="needs oneDNN's native bf16 GEMM")
def test_training_ranges_cover_forward_and_backward_kernels():
    """bf16 relu MLP with a residual: the forward's oneDNN epilogue, and the backward's input
    gradient plus the residual's (mm + add of the same shape: addmm with the gradient as C)."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)).to(torch.bfloat16)

    def f(x):
        return x + mlp(x)

    x = torch.randn(4, 8, 32, dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(f, backend="enn", options={"nvtx": True, "guard": "off"})
    compiled(x).sum().backward()
    got = x.grad.clone()
    x.grad = None
    names = _enn_ranges(lambda: compiled(x).sum().backward())
    assert "enn/epilogue/onednn mlp.0" in names and any(n.startswith("enn/epilogue/addmm") for n in names), names
    x.grad = None
    f(x).sum().backward()
    torch.testing.assert_close(got, x.grad, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_attention_and_epilogue_ranges():
    torch.manual_seed(0)
    model = Model().cuda().to(torch.bfloat16)
    x = torch.randn(4, 256, 32, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, backend="enn", options={"nvtx": True, "guard": "off"})
    with torch.no_grad():
        want = model(x)
        got = compiled(x)
        names = _enn_ranges(lambda: (compiled(x), torch.cuda.synchronize()))
    assert any(n.startswith("enn/attention/") and n.endswith(" layers.0") for n in names), names
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def _cuda_time_in_ranges(fn) -> dict[str, tuple[int, float]]:
    """enn's ranges a profiled ``fn`` ran: name -> (times entered, device kernel ms inside)."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        torch.cuda.synchronize()
    out: dict[str, tuple[int, float]] = {}
    for e in prof.key_averages():
        if e.key.startswith("enn/"):
            dev_us = getattr(e, "device_time_total", None)
            out[e.key] = (e.count, (e.cuda_time_total if dev_us is None else dev_us) / 1e3)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_pinned_op_and_fused_attention_are_ranges_with_their_kernels(tmp_path, monkeypatch):
    """The guard on, a NaN planted in every forward addmm: the pinned GEMMs run in
    ``enn/pinned/aten.addmm <module>`` ranges, the fused attention in ``enn/attention/...``,
    each with the device kernels it launched inside (the table is printed: run with -s)."""
    monkeypatch.setenv("ENN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ENN_FAULT_INJECT", "aten.addmm:nan:fwd")
    torch.manual_seed(0)
    model = Model().cuda().to(torch.bfloat16)
    x = torch.randn(4, 256, 32, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, backend="enn", options={"nvtx": True, "epilogue": False})
    with torch.no_grad():
        want = model(x)
        for _ in range(3):  # the first call finds the fault and pins; later calls run pinned
            got = compiled(x)
        ranges = _cuda_time_in_ranges(lambda: compiled(x))
    print("\nrange | entered | device ms inside")
    for name, (count, ms) in sorted(ranges.items()):
        print(f"{name} | {count} | {ms:.4f}")
    pinned = [n for n in ranges if n.startswith("enn/pinned/aten.addmm layers.0.")]
    assert pinned and all(ranges[n][1] > 0 for n in pinned), ranges
    assert any(n.startswith("enn/attention/") and n.endswith(" layers.0") and ranges[n][1] > 0 for n in ranges), ranges
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
