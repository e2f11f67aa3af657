"""The guard never makes a result worse than no guard: its reference run reads exactly what the
compiled call was given, NaN/Inf that eager makes too is not a fault (and never switches the
check off), and concurrent calls share one ladder."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import enn_backend
from enn_backend import backend as backend_module
from enn_backend import compat
from enn_backend import fx_utils
from enn_backend.guard import graph_edit as E
from enn_backend.guard.ladder import FaultLadder
from enn_backend.guard import runtime as R
from enn_backend.guard import screen as S

from _models import assert_close_step, make, train_step
from attention_cases import B, D, H, T, heads_of_hidden

ISOLATED = {"attention": False, "epilogue": False, "persist": False, "repro": False}


def _guard_of(record) -> R.GuardedGraph:
    return next(o for o in gc.get_objects() if type(o) is R.GuardedGraph and o.record is record)


def test_backward_rerun_reads_the_inputs_it_was_given(monkeypatch):
    """A faulty backward is re-run on the inputs its compiled call received. AOT Autograd donates
    a backward's saved tensors and Inductor may write into them (torch 2.14+ does, for this block
    in bf16), so the guard compiles without donation: the reference must read them unchanged."""
    seen: dict[str, list] = {}
    init = R.GuardedGraph.__init__

    def spying_init(self, compiler, compiled, record):
        init(self, compiler, compiled, record)
        assert compiler.written == compiler.mutated, "a guarded backward got donated buffers"

        def spy(args):
            if record.phase == "backward":
                seen["given"] = [a.clone() for a in args]
            return compiled(args)

        spy._boxed_call = True
        self.compiled = spy

    rerun = FaultLadder.rerun

    def spying_rerun(self, run, call, eager):
        if self.record.phase == "backward" and eager:
            seen.setdefault("rerun", [a.clone() for a in call.rerun_inputs()])
        return rerun(self, run, call, eager)

    monkeypatch.setattr(R.GuardedGraph, "__init__", spying_init)
    monkeypatch.setattr(FaultLadder, "rerun", spying_rerun)
    model, x = make("block")
    # localize_budget=0: the re-run is under test, not the search for the culprit (all suspects pinned)
    compiled = torch.compile(model, backend="enn",
                             options={**ISOLATED, "fault_inject": "aten.erf:nan:bwd", "localize_budget": 0})
    got = train_step(model, x, compiled, torch.bfloat16)
    assert_close_step(got, train_step(model, x, autocast=torch.bfloat16), torch.bfloat16)
    changed = [i for i, (a, b) in enumerate(zip(seen["given"], seen["rerun"])) if not torch.equal(a, b)]
    assert changed == [], f"backward inputs {changed} changed between the compiled call and the re-run"


class _Log(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 2.0, 8))

    def forward(self, x):
        return torch.log(x) * self.w


def test_models_own_nan_does_not_switch_the_check_off():
    """One batch where eager makes a NaN too (log of a negative number) must not stop the guard
    from catching a kernel that breaks later, inside the warm-up where every call is checked."""
    model = _Log()
    compiled = torch.compile(model, backend="enn", options=ISOLATED)
    own, good = torch.linspace(-1.0, 1.0, 8), torch.linspace(0.1, 1.0, 8)
    with torch.no_grad():
        got = compiled(own)
        assert torch.equal(torch.isnan(got), torch.isnan(model(own))) and torch.isnan(got).any()
        assert enn_backend.report().to_dict()["fallbacks"] == []
        (record,) = enn_backend.report().graphs
        guard = _guard_of(record)
        kernels = guard.compiled
        guard.compiled = lambda args: [torch.full_like(t, float("nan")) for t in kernels(args)]  # a kernel gone bad
        fixed = compiled(good)
        torch.testing.assert_close(fixed, model(good))
        again = compiled(own)  # the model's own NaN again: still not a fault
    assert torch.equal(torch.isnan(again), torch.isnan(model(own)))
    rep = enn_backend.report().to_dict()
    (fb,) = rep["fallbacks"]
    # a fresh compile of the graph does not have this fault: the guard adopts it and blames no node
    assert fb["kind"] == "nonfinite" and fb["node"] == "<graph>" and "did not reproduce" in fb["action"], fb
    assert rep["graphs"][0]["pinned"] == [] and rep["graphs"][0]["counters"]["model_nonfinite"] == 2


def test_nan_parameters_are_said_to_come_from_earlier_not_blamed():
    """When eager is non-finite only because a parameter already is, the report says so."""
    model = _Log()
    compiled = torch.compile(model, backend="enn", options=ISOLATED)
    x = torch.linspace(0.1, 1.0, 8)
    with torch.no_grad():
        compiled(x)
        model.w[3] = float("nan")
        got = compiled(x)
        compiled(x)
    assert torch.equal(torch.isnan(got), torch.isnan(model(x).detach()))
    rep = enn_backend.report().to_dict()
    assert [f["kind"] for f in rep["fallbacks"]] == ["nonfinite_inputs"]  # once, repeats counted
    assert "already hold NaN/Inf" in rep["fallbacks"][0]["reason"] and rep["graphs"][0]["pinned"] == []


def test_threads_share_one_ladder_and_blame_only_the_culprit():
    """One compiled block called from 4 threads with one faulty kernel: no thread sees an error
    from enn's machinery, every result equals eager's, the ladder runs once, and only the faulty
    op's nodes are pinned."""
    model, _ = make("block")
    compiled = torch.compile(model, backend="enn", options={**ISOLATED, "fault_inject": "aten.erf:nan:fwd"})
    xs = [torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(xs))

    def work(i: int) -> None:
        try:
            start.wait()
            with torch.no_grad():
                for _ in range(3):
                    results[i] = compiled(xs[i])
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with torch.no_grad():
        for i, x in enumerate(xs):
            torch.testing.assert_close(results[i], model(x))
    rep = enn_backend.report().to_dict()
    assert {f["kind"] for f in rep["fallbacks"]} == {"nonfinite"}, rep["fallbacks"]
    # Dynamo may compile the frame once per thread: one graph localizes the fault, the others
    # find its culprit in kernel state and confirm it with one trial
    localized = [f for f in rep["fallbacks"] if "records as faulty" not in f["action"]]
    assert len(localized) == 1, rep["fallbacks"]
    for g in rep["graphs"]:
        assert g["pinned"] and all(n.startswith("erf") for n in g["pinned"]), g["pinned"]


@pytest.mark.parametrize("phase,op", [("fwd", "aten.addmm"), ("bwd", "aten.mm")])
def test_a_finite_perturbation_is_caught_by_the_value_check(phase, op):
    """A kernel whose values are finite but 1% off: the value check on a graph's first call
    compares it with eager, an fp64 run says eager is right, the culprit is localized and
    pinned, and the step's results equal eager's."""
    model, x = make("mlp")
    compiled = torch.compile(model, backend="enn", options={**ISOLATED, "fault_inject": f"{op}:scale1.01:{phase}"})
    for _ in range(2):
        assert_close_step(train_step(model, x, compiled), train_step(model, x))
    rep = enn_backend.report().to_dict()
    (fb,) = [f for f in rep["fallbacks"] if f["kind"] != "pinned_from_state"]
    assert fb["kind"] == "value" and fb["phase"] == {"fwd": "forward", "bwd": "backward"}[phase], fb
    g = next(g for g in rep["graphs"] if g["id"] == fb["graph"])
    assert g["pinned"] and all(n.startswith(op.split(".")[1]) for n in g["pinned"]), g["pinned"]


def test_values_that_only_the_reference_gets_wrong_blame_nobody():
    """Compiled code closer to fp64 than eager (eager rounds an intermediate to bf16, the
    compiled kernel keeps fp32): the values differ, but the reference is the outlier."""
    def f(x):
        return (x.to(torch.bfloat16) * 3.0).float() - x * 3.0

    compiled = torch.compile(f, backend="enn", options={**ISOLATED, "guard": "values"})
    x = torch.randn(64) * 100
    compiled(x)
    rep = enn_backend.report().to_dict()
    assert rep["fallbacks"] == [] and rep["graphs"][0]["pinned"] == []
    assert rep["graphs"][0]["counters"]["value_reference_outlier"] == 1  # they did differ
    assert enn_backend.report().counters["guard.dynamo_reference_outlier"] == 1  # the Dynamo graph rounds too


def test_a_fused_backward_whose_gradients_are_viewed_is_rerun_and_pinned():
    """BERT's layout: the fused backward's gradients reach q / k / v through permutes and views.
    A NaN there is re-run eagerly on the graph as enn compiled it (valid ATen), the kernel is
    pinned, and the step's gradients equal eager's."""
    g = torch.Generator().manual_seed(0)
    x = [torch.randn(B, T, H * D, generator=g, requires_grad=True) for _ in range(3)]
    opts = {**ISOLATED, "attention": True, "attention_backend": "explicit",
            "fault_inject": "enn.attention_backward:nan:bwd"}
    heads_of_hidden(*x).square().sum().backward()
    expected = [t.grad for t in x]
    for t in x:
        t.grad = None
    torch.compile(heads_of_hidden, backend="enn", options=opts)(*x).square().sum().backward()
    for got, want in zip((t.grad for t in x), expected):
        torch.testing.assert_close(got, want)
    (fb,) = enn_backend.report().to_dict()["fallbacks"]
    assert fb["kind"] == "nonfinite" and fb["phase"] == "backward", fb


@pytest.mark.parametrize("target", [torch.float32, torch.float64])
def test_a_promoted_graph_writes_into_its_narrower_inputs(target):
    """The fp32 retry and the fp64 judge run a promoted copy of the graph. What it writes into
    an input (an fp16 running statistic) reaches the input, rounded to its dtype."""
    def step(x, running):
        running.mul_(0.5).add_(x.mean(0), alpha=0.5)
        return (x * 2,)

    x, running = torch.randn(8, 4, dtype=torch.float16), torch.randn(4, dtype=torch.float16)
    gm = make_fx(torch.func.functionalize(step), tracing_mode="fake")(x, running)
    assert fx_utils.mutated_input_indices(gm) == [1]
    expected = running.clone()
    want = step(x, expected)
    got_running = running.clone()
    got = E.promote(gm, target)(x, got_running)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_running, expected, atol=1e-3, rtol=1e-3)
    assert not torch.equal(got_running, running)


def test_integer_results_are_compared_by_value():
    """Integer and boolean results are compared exactly; a difference is judged by the fp64 run:
    a graph of integers alone (its fp64 run equals the reference) blames any difference, an
    integer computed from floats is blamed only when further from fp64 than 2x the reference."""
    ref = torch.arange(12)
    off = ref.clone()
    off[3] += 1
    assert S.diverging([off, ref > 5], [ref, ref > 5]) == [0]
    assert S.diverging([off], [ref], bookkeeping=frozenset({0})) == []  # saved for the backward
    assert not S.diverging([ref > 5], [ref > 5]) and S.diverging([ref > 4], [ref > 5]) == [0]
    assert S.compiled_is_worse(off, ref, ref.clone())  # integers alone: exact
    fp64 = ref.clone()
    fp64[:2] += 1  # the reference rounds 2 boundary values the other way from fp64
    assert not S.compiled_is_worse(off, ref, fp64)  # compiled: 3 differ from fp64, within 2 x 2
    far = off.clone()
    far[5:7] += 1
    assert S.compiled_is_worse(far, ref, fp64)  # 5 differ from fp64: worse


def test_a_forwards_saved_integers_are_bookkeeping_its_results_are_not():
    """A training forward's integer outputs saved for its backward (max_pool's indices) are
    compared by dtype and shape only; its user outputs, integer ones included, by value."""
    def f(x):
        y, idx = torch.nn.functional.max_pool2d(x, 2, return_indices=True)
        return y * 2, idx + 1

    x = torch.randn(1, 2, 4, 4, requires_grad=True)
    torch.compile(f, backend="enn", options=ISOLATED)(x)[0].sum().backward()
    fwd = next(r for r in enn_backend.report().graphs if r.phase == "forward")
    compiler = _guard_of(fwd).compiler
    outs = fx_utils.output_nodes(compiler.eager_gm)
    saved_ints = {i for i, n in enumerate(outs) if isinstance(n, torch.fx.Node)
                  and not n.meta["val"].is_floating_point() and i >= 2}
    assert saved_ints and saved_ints <= compiler.bookkeeping and not {0, 1} & compiler.bookkeeping


def test_a_wrong_decomposition_is_caught_against_the_dynamo_graph(monkeypatch):
    """A decomposition applied while AOT Autograd traces (here a wrong one for softplus) makes the
    compiled code and enn's eager copy agree on a wrong value: the graph Dynamo handed over, judged
    right by its fp64 run, gives the call's result and gradients and runs the unit from then on."""
    table = backend_module.decomposition_table
    wrong = {torch.ops.aten.softplus.default: lambda x, beta=1, threshold=20: torch.relu(x)}
    monkeypatch.setattr(backend_module, "decomposition_table", lambda precision: {**table(precision), **wrong})

    def f(x, w):
        return torch.nn.functional.softplus(x * w).sum(-1)

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, generator=g), torch.randn(8, generator=g, requires_grad=True)
    want = f(x, w)
    (want_grad,) = torch.autograd.grad(want.sum(), w)
    with compat.no_aot_autograd_cache():
        compiled = torch.compile(f, backend="enn", options=ISOLATED)
        for _ in range(2):
            got = compiled(x, w)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(torch.autograd.grad(got.sum(), w)[0], want_grad)
    rep = enn_backend.report()
    (fb,) = rep.to_dict()["fallbacks"]
    assert fb["kind"] == "dynamo_graph" and "fp64 run sides with Dynamo's graph" in fb["reason"], fb
    assert rep.counters["fallback.dynamo_graph"] == 1
    fwd = next(r for r in rep.graphs if r.phase == "forward")
    assert fwd.counters["calls"] == 1  # the second call ran the Dynamo graph, not the compiled unit


def test_a_random_unit_is_not_compared_with_the_dynamo_graph():
    """Random draws differ from eager's by design: the unit's first check sees the RNG move and
    turns the Dynamo-graph reference off (counted), blaming nothing."""
    compiled = torch.compile(lambda x: torch.nn.functional.dropout(x, 0.5) + x, backend="enn", options=ISOLATED)
    compiled(torch.randn(64))
    assert enn_backend.report().to_dict()["fallbacks"] == []
    assert enn_backend.report().counters["guard.dynamo_reference_off"] == 1


@pytest.mark.parametrize("kernel", ["efficient", "flash", "cudnn"])
def test_fp64_run_computes_cuda_attention_kernels_by_math(kernel):
    """CUDA's SDPA kernels have no fp64 version ("Only fp32, half & bf16 supported"), so a graph
    that called one had no fp64 run and its value checks could blame nobody. The fp64 run calls
    their safe paths, enn's attention math in fp64, laid out as the kernel lays out its results.
    Traced with fake tensors (the kernels are CUDA's), run on the CPU: only the math can run here."""
    aten = torch.ops.aten
    q, k, v = (torch.randn(2, 4, 40, 16, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(2, 4, 40, 40, dtype=torch.float64)
    if kernel == "efficient":
        def f(q, k, v, bias):
            return aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, False)[:2]
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    elif kernel == "flash":
        def f(q, k, v, bias):
            return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[:2]
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        def f(q, k, v, bias):
            return aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0, False)[:2]
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    gm = make_fx(f, tracing_mode="fake")(q, k, v, bias)
    with pytest.raises((RuntimeError, NotImplementedError)):
        gm(q, k, v, bias)  # the kernel itself: no CPU (nor fp64) version
    out, lse = E.on_safe_paths(gm)(q, k, v, bias)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    logits = torch.einsum("bhqd,bhkd->bhqk", q, k) / 4.0 + (bias if kernel != "flash" else
                                                            torch.full((40, 40), float("-inf")).triu(1))
    torch.testing.assert_close(lse.reshape(2, 4, -1)[..., :40].double(), logits.logsumexp(-1), rtol=1e-6, atol=1e-6)


class _Region(torch.nn.Module):
    """A residual MLP block whose forward is a nested compile region (invoke_subgraph)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln, self.up, self.down = torch.nn.LayerNorm(d), torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    @torch.compiler.nested_compile_region
    def forward(self, x):
        return x + self.down(torch.nn.functional.silu(self.up(self.ln(x))))


def test_nested_compile_regions_are_inlined_for_the_dynamo_reference(monkeypatch):
    """The reference runs the Dynamo graph eagerly with autograd; its invoke_subgraph calls are
    inlined first (2.13's eager invoke_subgraph has no autograd), so the backward is compared."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Region(), _Region())
    x = torch.randn(4, 16, requires_grad=True)
    captured = []

    def capture(gm, example_inputs):
        captured.append(compat.copy_dynamo_graph(gm))
        return gm.forward

    torch.compile(model, backend=capture)(x)
    hop = torch.ops.higher_order.invoke_subgraph
    (gm,) = captured
    assert sum(n.target is hop for n in gm.graph.nodes) == 2
    inlined = fx_utils.inline_subgraph_calls(gm)
    assert not any(n.target is hop for n in inlined.graph.nodes)
    from enn_backend.guard.dynamo_reference import DynamoReference

    computed: list[int] = []  # reference gradients computed (2.13 without the inlining: raised)
    gradients = DynamoReference._gradients

    def spy(*args):
        grads = gradients(*args)
        computed.append(len(grads))
        return grads

    monkeypatch.setattr(DynamoReference, "_gradients", staticmethod(spy))
    torch._dynamo.reset()
    f = torch.compile(model, backend="enn")
    f(x).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    counters = enn_backend.report().to_dict()["counters"]
    assert counters.get("guard.dynamo_backward_checks", 0) >= 1 and "guard.dynamo_backward_unjudged" not in counters
    assert computed, "the backward was not compared with the Dynamo graph's gradients"
    for a, p in zip(got, model.parameters()):
        torch.testing.assert_close(a, p.grad)


def test_wrong_gradients_of_reused_compile_regions_are_caught(monkeypatch):
    """HF LLaMA with its decoder layers as nested compile regions (two layers, one region reused):
    AOT Autograd's backward of the reused region is wrong on torch 2.13-2.14 (Inductor alone:
    gradients off by 500x); enn's reference, the Dynamo graph with the regions inlined, finds
    it and the step gets eager's gradients, with a dynamo_graph line."""
    LM = pytest.importorskip("transformers.models.llama.modeling_llama")

    from enn_backend.models.real import real_specs

    monkeypatch.setattr(LM.LlamaDecoderLayer, "forward",
                        torch.compiler.nested_compile_region(LM.LlamaDecoderLayer.forward))
    spec = next(s for s in real_specs() if s.name == "hf_llama_sdpa")
    torch.manual_seed(0)
    entry = spec.builder(torch.device("cpu"), **{**spec.sizes["cpu-small"], "seq": 16, "hidden_size": 32,
                                                 "num_attention_heads": 2, "num_key_value_heads": 1,
                                                 "intermediate_size": 64})
    batch, model = entry.make_inputs(0), entry.model
    entry.loss_fn(torch.compile(model, backend="enn")(*batch.args), batch.target).backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    entry.loss_fn(model(*batch.args), batch.target).backward()
    for a, p in zip(got, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-5)
    kinds = [f["kind"] for f in enn_backend.report().to_dict()["fallbacks"]]
    assert kinds in ([], ["dynamo_graph"]), kinds  # [] on a torch whose reused region is right


def test_a_backward_that_cannot_be_compared_is_counted_and_warned_once(monkeypatch, caplog):
    """The reference's gradients raise: every such backward is counted, the first one warned."""
    import logging

    from enn_backend.guard.dynamo_reference import DynamoReference

    def no_gradients(*args):
        raise RuntimeError("no reference gradients here")

    monkeypatch.setattr(DynamoReference, "_gradients", staticmethod(no_gradients))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(4, 8)
    f = torch.compile(model, backend="enn", options={"guard_values": 1})
    with caplog.at_level(logging.WARNING, logger="enn_backend"):
        for _ in range(3):
            f(x).sum().backward()
    counted = enn_backend.report().to_dict()["counters"].get("guard.dynamo_backward_unjudged", 0)
    warned = [r for r in caplog.records if "not compared with the Dynamo graph's gradients" in r.getMessage()]
    assert counted >= 2 and len(warned) == 1, (counted, [r.getMessage() for r in warned])


def test_a_backward_is_compared_when_an_output_gets_no_gradient():
    """A model that returns its loss beside its logits (Hugging Face's ``labels=``) and is trained
    on the loss alone: the logits get no gradient (their hook sees None). The backward is still
    compared with the Dynamo graph's gradients, and a wrong one is caught there."""

    class LossAndLogits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)

        def forward(self, x, y):
            logits = self.lin(x)
            return torch.nn.functional.cross_entropy(logits, y), logits

    torch.manual_seed(0)
    model = LossAndLogits()
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    f = torch.compile(model, backend="enn", options={**ISOLATED, "guard_values": 1})
    for _ in range(2):
        loss, _ = f(x, y)
        loss.backward()
    counters = enn_backend.report().to_dict()["counters"]
    assert counters.get("guard.dynamo_backward_checks", 0) >= 2, counters
    assert counters.get("guard.dynamo_backward_unjudged", 0) == 0, counters


@pytest.mark.parametrize("free", [0, 10**12])
def test_a_backward_reference_that_would_not_fit_in_device_memory_is_not_run(monkeypatch, free):
    """On a GPU the Dynamo graph's run with autograd holds its activations beside the compiled
    call's until the backward: it runs only where twice what the compiled call holds is free.
    Simulated on the CPU (the memory seams of guard/dynamo_reference.py): with nothing free the
    step's backward is not compared (counted, logged once), its forward is, and the step is eager's;
    with room, the backward is compared."""
    from enn_backend.guard import dynamo_reference as DR

    allocated = iter(range(0, 10**9, 1000))  # every reading 1000 bytes more than the last
    monkeypatch.setattr(DR, "_memory_device", lambda flat: torch.device("cpu"))
    monkeypatch.setattr(DR, "_allocated", lambda device: next(allocated))
    monkeypatch.setattr(DR, "_free", lambda device: free)
    model, x = make("mlp")
    compiled = torch.compile(model, backend="enn", options=ISOLATED)
    assert_close_step(train_step(model, x, compiled), train_step(model, x))
    counters = enn_backend.report().to_dict()["counters"]
    if free:
        assert counters.get("guard.dynamo_backward_checks", 0) >= 1 and "guard.dynamo_backward_no_room" not in counters
    else:
        assert counters.get("guard.dynamo_backward_no_room") == 1, counters
        assert "guard.dynamo_backward_checks" not in counters, counters
    assert enn_backend.report().to_dict()["fallbacks"] == []
