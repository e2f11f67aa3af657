"""Warm starts from AOT Autograd's cache: the graphs come back guarded, reported and exact.

One cold compile (the zoo's one-layer nanoGPT, its ``tril`` buffer compiled as a causal
flag) fills an Inductor cache folder; each test starts warm from it: a hit skips the
trace, the joint passes and ``inner_compile`` (enn_backend/aot_cache.py).
"""

from __future__ import annotations

import copy
import gc
import glob
import json
import logging
import os
import shutil

import pytest
import torch

import enn_backend
from enn_backend import compat, models
from enn_backend.bench.backends import cache_dir
from enn_backend.guard.runtime import GuardedGraph

OPTIONS = {"attention_backend": "flash", "persist": False}


def _step(compiled, model, batch, loss_fn):
    loss = loss_fn(compiled(*batch.args), batch.target)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _compile_and_step(cache, options=OPTIONS, model=None, device="cpu"):
    """Fresh Dynamo and in-memory caches, then one training step compiled from ``cache``."""
    torch.compiler.reset()
    enn_backend.reset()
    entry = models.build("gpt2_naive", "cpu-small", n_layer=1, device=device)
    model = model or copy.deepcopy(entry.model)
    batch = entry.make_inputs(0)
    with cache_dir(cache):
        compiled = torch.compile(model, backend="enn", options=options)
        loss, grads = _step(compiled, model, batch, entry.loss_fn)
    return compiled, model, batch, entry.loss_fn, loss, grads


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """The cold compile: its cache folder, report and results."""
    cache = str(tmp_path_factory.mktemp("inductor"))
    torch.manual_seed(0)
    *_, loss, grads = _compile_and_step(cache)
    rep = enn_backend.report().to_dict()
    assert not any(g["from_cache"] for g in rep["graphs"])
    return cache, rep, loss, grads


def _warm(cold_cache, tmp_path, options=OPTIONS, device="cpu"):
    cache = str(tmp_path / "inductor")
    shutil.copytree(cold_cache, cache)  # each test may damage its own copy
    return cache, _compile_and_step(cache, options, device=device)


def _cache_loaded_guard(phase):
    """The GuardedGraph of the report's cache-loaded ``phase`` graph (earlier tests' may be alive)."""
    (record,) = [g for g in enn_backend.report().graphs if g.phase == phase and g.from_cache]
    return next(o for o in gc.get_objects() if type(o) is GuardedGraph and o.record is record)


def _without_times(graphs):
    skip = {"compile_time_s", "compile_phases", "from_cache", "counters", "events", "id"}
    return [{k: v for k, v in g.items() if k not in skip} for g in graphs]


def test_warm_start_is_a_guarded_reported_cache_hit(cold, tmp_path):
    cache, rep_cold, loss_cold, grads_cold = cold
    _, (_, model, *_, loss, grads) = _warm(cache, tmp_path)
    rep = enn_backend.report().to_dict()
    assert rep["counters"].get("aot_cache.hits") == 1, rep["counters"]
    assert [g["from_cache"] for g in rep["graphs"]] == [True, True]
    # what the report says of the graphs is what the cold compile said (fusions, kernel choices)
    assert _without_times(rep["graphs"]) == _without_times(rep_cold["graphs"])
    assert rep["fusions"] == rep_cold["fusions"] and rep["fusions"]["attention"] == 1
    # the same kernels: bit-identical loss and gradients
    assert torch.equal(loss, loss_cold)
    assert all(torch.equal(grads[n], grads_cold[n]) for n in grads)
    # both graphs run under the guard (its first calls are checked)
    assert all(g["counters"].get("checks") == 1 for g in rep["graphs"]), rep["graphs"]


def test_fault_in_a_cache_loaded_graph_is_handled_after_a_fresh_trace(cold, tmp_path, caplog):
    """A cached artifact that starts giving NaN: the guard traces the graph again (it has no copy
    of a graph it did not compile), re-runs it eagerly, and recompiles it, as after a cold compile.
    The fault lives in that artifact only, so the fresh compile does not have it: no node is blamed."""
    _check_fault_after_warm_start(*cold, tmp_path, caplog, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fault_in_a_cache_loaded_cuda_graph(tmp_path, caplog):
    # where the C++ wrapper's kernels are tuned on real inputs (torch 2.11), enn's default builds a
    # backward on its first call, which keeps the unit out of AOT Autograd's cache (next test)
    options = {"persist": False, **({"cpp_wrapper": False} if compat.cpp_wrapper_tunes_on_real_inputs() else {})}
    cache = str(tmp_path / "cold")
    torch.manual_seed(0)
    *_, loss, grads = _compile_and_step(cache, options=options, device="cuda")
    _check_fault_after_warm_start(cache, None, loss, grads, tmp_path, caplog, "cuda", options=options)


@pytest.mark.parametrize("tunes_on_real_inputs", [False, True], ids=["torch-2.12+", "torch-2.11"])
def test_a_training_warm_start_with_enns_cpp_wrapper(tunes_on_real_inputs, tmp_path, monkeypatch):
    """enn's C++ wrapper default (CUDA's; here on the CPU) on both graphs of a training unit: where
    Inductor compiles the wrapper's kernels on its first call (2.12+) the unit is an AOT Autograd
    cache hit on a warm start; where it tunes them on the real inputs (2.11) the backward is built
    on its first call, after AOT Autograd would have saved the unit: a miss, both graphs from
    Inductor's FX graph cache. The cold start's values either way (the GPU test below: 2.11 on CUDA)."""
    from enn_backend import graph_compiler

    monkeypatch.setitem(graph_compiler.INDUCTOR_DEFAULTS, "cpu", {})
    monkeypatch.setitem(graph_compiler.COMPILE_FX_DEFAULTS, "cpu", {"cpp_wrapper": True})
    monkeypatch.setattr(compat, "cpp_wrapper_tunes_on_real_inputs", lambda: tunes_on_real_inputs)
    cold_cache = str(tmp_path / "cold")
    *_, loss_cold, grads_cold = _compile_and_step(cold_cache, options={"persist": False})
    assert [g["path"] for g in enn_backend.report().to_dict()["graphs"]] == ["inductor", "inductor"]
    compat.dynamo_counters.clear()
    _, (*_, loss, grads) = _warm(cold_cache, tmp_path, {"persist": False})
    assert enn_backend.report().counters.get("aot_cache.hits", 0) == (0 if tunes_on_real_inputs else 1)
    assert compat.dynamo_counters["inductor"]["fxgraph_cache_hit"] == 2  # no Inductor compile either way
    assert torch.equal(loss, loss_cold) and all(torch.equal(grads[n], grads_cold[n]) for n in grads)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_training_warm_start_with_enns_cpp_wrapper(tmp_path):
    """With enn's defaults on CUDA both graphs of a training unit get the C++ wrapper. Where its
    kernels are tuned on the real inputs (torch 2.11) the backward is built on its first call, after
    AOT Autograd would have saved the unit to its cache: a warm start traces the unit again (an
    AOT cache miss) and loads both graphs from Inductor's FX graph cache (no Inductor compile).
    From torch 2.12 the unit is an AOT cache hit. The values are the cold start's either way."""
    options = {"persist": False}
    cold_cache = str(tmp_path / "cold")
    torch.manual_seed(0)
    *_, loss_cold, grads_cold = _compile_and_step(cold_cache, options=options, device="cuda")
    assert [g["path"] for g in enn_backend.report().to_dict()["graphs"]] == ["inductor", "inductor"]
    compat.dynamo_counters.clear()
    _, (*_, loss, grads) = _warm(cold_cache, tmp_path, options, device="cuda")
    hits = enn_backend.report().counters.get("aot_cache.hits", 0)
    if compat.cpp_wrapper_tunes_on_real_inputs():
        assert hits == 0 and compat.dynamo_counters["inductor"]["fxgraph_cache_hit"] == 2, dict(compat.dynamo_counters)
    else:
        assert hits == 1
    torch.testing.assert_close(loss, loss_cold)
    for n in grads:
        torch.testing.assert_close(grads[n], grads_cold[n])


def _check_fault_after_warm_start(cache, _report, loss_cold, grads_cold, tmp_path, caplog, device, options=OPTIONS):
    _, (compiled, model, batch, loss_fn, *_) = _warm(cache, tmp_path, options, device=device)
    assert enn_backend.report().counters["aot_cache.hits"] == 1
    forward = _cache_loaded_guard("forward")
    forward.since_build = 0  # check the next call, as in the warm-up
    cached_kernels = forward.compiled

    def broken(args):  # the cached artifact (only it) now returns NaN logits
        out = list(cached_kernels(args))
        out[0] = torch.full_like(out[0], float("nan"))
        return out

    forward.compiled = broken
    for p in model.parameters():
        p.grad = None
    with caplog.at_level(logging.INFO, logger="enn_backend"), cache_dir(cache):
        loss, grads = _step(compiled, model, batch, loss_fn)
    tol = dict(rtol=1e-5, atol=1e-5) if device == "cpu" else dict(rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(loss, loss_cold, **tol)  # eager's result, not NaN
    for n in grads:
        torch.testing.assert_close(grads[n], grads_cold[n], rtol=10 * tol["rtol"], atol=tol["atol"])
    assert "traced g0 again" in caplog.text
    rep = enn_backend.report().to_dict()
    (fb,) = rep["fallbacks"]
    assert fb["kind"] == "nonfinite" and fb["phase"] == "forward" and fb["node"] == "<graph>", fb
    assert "did not reproduce" in fb["action"], fb
    g = next(g for g in rep["graphs"] if g["phase"] == "forward")
    assert g["pinned"] == [] and g["counters"]["recompiles"] == 1
    assert forward.compiled is not broken


def test_a_nan_weight_in_a_cache_loaded_graph_blames_nothing(cold, tmp_path):
    cache, *_ = cold
    _, (compiled, model, batch, loss_fn, *_) = _warm(cache, tmp_path)
    forward = _cache_loaded_guard("forward")
    forward.since_build = 0
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")  # the model's own NaN: eager has it too
    with cache_dir(cache):
        loss = loss_fn(compiled(*batch.args), batch.target)
    assert torch.isnan(loss)
    rep = enn_backend.report().to_dict()
    assert [f["kind"] for f in rep["fallbacks"]] == ["nonfinite_inputs"]  # a NaN weight: said, nobody blamed
    assert all(not g["pinned"] for g in rep["graphs"])


def test_buffer_content_is_still_guarded_after_a_warm_start(cold, tmp_path):
    cache, *_ = cold
    _, (compiled, model, batch, *_) = _warm(cache, tmp_path)
    assert enn_backend.report().counters["aot_cache.hits"] == 1
    reference = copy.deepcopy(model)
    for m in (model, reference):
        dict(m.named_buffers())["h.0.attn.bias"].fill_(1.0)  # attend to every key
    with cache_dir(cache):  # (grad mode on: the cached training graph, not a new compile)
        got, want = compiled(*batch.args), reference(*batch.args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert enn_backend.report().counters["aot_cache.hits"] == 1 and len(enn_backend.report().graphs) == 2
    assert [f["kind"] for f in enn_backend.report().to_dict()["fallbacks"]] == ["buffer_changed"]


def test_a_kernel_pinned_since_refuses_the_hit(cold, tmp_path):
    """Kernel state recorded after the entry was written (a fault in another run) must not be
    bypassed by a warm start: the entry is refused and the graph compiled with the pin."""
    from enn_backend.guard.kernel_state import forget_loaded_states, state_for
    from enn_backend.options import Options

    cache, *_ = cold
    options = {**OPTIONS, "persist": True, "cache_dir": str(tmp_path / "enn")}
    sidecar = next(json.load(open(p)) for p in glob.glob(os.path.join(cache, "enn", "aot", "*.json"))
                   if json.load(open(p))["phase"] == "forward")
    key = next(k for k in sidecar["node_keys"] if k.startswith("aten.addmm|"))
    state_for(Options.from_sources(options, None)).record(key, "pinned", reason="recorded by an earlier run")
    forget_loaded_states()
    _, (*_, loss, _) = _warm(cache, tmp_path, options)
    rep = enn_backend.report().to_dict()
    assert rep["counters"].get("aot_cache.refused") == 1 and not rep["counters"].get("aot_cache.hits")
    assert not any(g["from_cache"] for g in rep["graphs"])
    assert [f["kind"] for f in rep["fallbacks"]] == ["pinned_from_state"]
    assert torch.isfinite(loss)


@pytest.mark.parametrize("content", ["{\"format\": \"enn-aot-graph\", \"vers", "garbage\x00",
                                     "{\"format\": \"enn-aot-graph\", \"version\": 1, \"key\": \"x\"}"],
                         ids=["truncated", "garbage", "foreign-key"])
def test_corrupt_sidecar_means_a_compile_with_a_warning(cold, tmp_path, caplog, content):
    cache, rep_cold, loss_cold, _ = cold
    cache = str(tmp_path / "inductor")
    shutil.copytree(cold[0], cache)
    for path in glob.glob(os.path.join(cache, "enn", "aot", "*.json")):
        with open(path, "w") as f:
            f.write(content)
    with caplog.at_level(logging.WARNING, logger="enn_backend"):
        *_, loss, _ = _compile_and_step(cache)
    assert "ignoring" in caplog.text and "compiled instead of loaded" in caplog.text
    rep = enn_backend.report().to_dict()
    assert not rep["counters"].get("aot_cache.hits") and not any(g["from_cache"] for g in rep["graphs"])
    assert rep["fusions"] == rep_cold["fusions"]
    assert torch.equal(loss, loss_cold)


def test_injected_faults_never_reach_the_cache(cold, tmp_path):
    """A compile with planted faults is not offered to AOT Autograd's cache, and a warm start
    with fault injection on does not take clean entries (faults are planted at compile time)."""
    options = {**OPTIONS, "fault_inject": "aten.addmm:raise:compile"}
    fresh = str(tmp_path / "fresh")
    _compile_and_step(fresh, options)
    assert [f["kind"] for f in enn_backend.report().to_dict()["fallbacks"]] == ["compile_error"]
    assert not glob.glob(os.path.join(fresh, "enn", "aot", "*.json"))
    _, (*_, loss, _) = _warm(cold[0], tmp_path, options)
    rep = enn_backend.report().to_dict()
    assert not rep["counters"].get("aot_cache.hits")  # (fault_inject is in enn's cache key, too)
    assert [f["kind"] for f in rep["fallbacks"]] == ["compile_error"] and torch.isfinite(loss)


def test_inference_graph_from_cache_is_traced_again_outside_the_runtime_wrappers(tmp_path):
    """An inference graph runs inside AOT Autograd's runtime wrappers with autograd and
    functionalization switched off; tracing it again from there must not inherit that."""
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    cache = str(tmp_path / "inductor")
    for warm in (False, True):
        torch.compiler.reset()
        enn_backend.reset()
        with torch.no_grad(), cache_dir(cache):
            got = torch.compile(lambda t: torch.log(lin(t)) * 2.0, backend="enn", options={"persist": False})(x)
        rep = enn_backend.report().to_dict()
        assert [g["from_cache"] for g in rep["graphs"]] == [warm]
        want = torch.log(lin(x)) * 2.0
        assert torch.isnan(want).any() and torch.equal(torch.isnan(got), torch.isnan(want))
        torch.testing.assert_close(got, want.detach(), equal_nan=True)
        assert rep["fallbacks"] == []  # eager makes the same NaN: nothing fell back
        assert rep["graphs"][0]["counters"]["model_nonfinite"] == 1


def _cold_then_warm(cache, compile_and_run):
    """The report of a cold compile into ``cache``, then of a warm start from it."""
    reports = []
    for _ in range(2):
        torch.compiler.reset()
        enn_backend.reset()
        with cache_dir(cache):
            compile_and_run()
        reports.append(enn_backend.report().to_dict())
    assert [[g["from_cache"] for g in r["graphs"]] for r in reports] == [[False], [True]]
    return reports


def test_a_warm_start_names_compile_time_fallbacks_as_the_cold_compile(tmp_path, monkeypatch):
    """A pass's fallback (here an epilogue declined on a CPU without fp16 GEMMs) is named by its
    module path and source line; a warm start replays it from the sidecar with the same sites."""
    from enn_backend.custom_ops import gemm as G
    from enn_backend.report import fallback_line

    monkeypatch.setattr(G, "hw_caps", lambda device_type: G.HwCaps("cpu", onednn=True, onednn_bf16=True))
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()).to(torch.float16)
    x = torch.randn(4, 16, dtype=torch.float16)

    def run():
        with torch.no_grad():
            torch.compile(mlp, backend="enn", options={"persist": False})(x)

    cold, warm = _cold_then_warm(str(tmp_path / "inductor"), run)
    lines = [[fallback_line(f) for f in r["fallbacks"] if f["kind"] == "pass_skipped"] for r in (cold, warm)]
    assert len(lines[0]) == 1 and lines[1] == lines[0], lines
    assert lines[0][0].startswith("[pass_skipped] g0 (compile) at 1 ["), lines  # the GELU, item 1 of the Sequential
    assert [f["sites"] for f in warm["fallbacks"]] == [f["sites"] for f in cold["fallbacks"]]


def test_a_fault_in_a_warm_started_graph_is_blamed_as_on_a_cold_compile(tmp_path, monkeypatch):
    """The same injected fault, once in a cold compile and once in a graph loaded from the cache
    (its artifact made faulty, the fresh compile the guard makes planted): the report's blame line
    and the repro's header name the same module, source line and op."""
    from enn_backend import aot_cache
    from enn_backend.guard.faults import parse_fault_spec

    spec = "aten.addmm:nan:fwd"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    x = torch.randn(4, 8)
    cache = str(tmp_path / "inductor")

    def compile_and_run(options):
        torch.compiler.reset()
        enn_backend.reset()
        with torch.no_grad(), cache_dir(cache):
            compiled = torch.compile(model, backend="enn", options={"persist": False, **options})
            compiled(x)
        return compiled

    def blamed():
        rep = enn_backend.report().to_dict()
        [fault] = [f for f in rep["fallbacks"] if f["kind"] == "nonfinite"]
        [path] = [e["repro"] for g in rep["graphs"] for e in g["events"] if "repro" in e]
        return fault["sites"], open(path).read().split("\n\nWritten by")[0]

    compile_and_run({"fault_inject": spec})
    cold_sites, cold_header = blamed()
    assert [s["module"] for s in cold_sites] == ["0"] and "[addmm]" in cold_header

    compile_and_run({})  # fills the cache
    compiled = compile_and_run({})
    assert enn_backend.report().counters["aot_cache.hits"] == 1
    guard = _cache_loaded_guard("inference")
    guard.since_build = 0
    artifact = guard.compiled

    def broken(args):
        out = list(artifact(args))
        out[0] = torch.full_like(out[0], float("nan"))
        return out

    class Planted(aot_cache.GraphCompiler):  # the graph the guard traces again gets the fault too
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "fault_specs": parse_fault_spec(spec)})

    guard.compiled = broken
    monkeypatch.setattr(aot_cache, "GraphCompiler", Planted)
    with torch.no_grad(), cache_dir(cache):
        compiled(x)
    warm_sites, warm_header = blamed()
    assert warm_sites == cold_sites and warm_header == cold_header
