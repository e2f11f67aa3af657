"""Option ``blocks``: a graph's repeated layers are compiled once per distinct layer
(enn_backend/blocks.py), with the values and gradients of the graph compiled whole, each layer
under its own guard."""

from __future__ import annotations

import copy
import dataclasses
import gc

import pytest
import torch

import enn_backend
from enn_backend import blocks
from enn_backend.guard import runtime as R
from enn_backend.options import Options, OptionsError

import _hf

pytest.importorskip("transformers")


def _spec(name: str, layers: int) -> _hf.Spec:
    spec = _hf.MODELS[name]
    key = "n_layer" if name == "gpt2" else "num_hidden_layers"
    return dataclasses.replace(spec, cfg={**spec.cfg, key: layers})


def _build(name: str, layers: int, impl: str = "sdpa"):
    import transformers

    torch.manual_seed(0)
    spec = _spec(name, layers)
    model = spec.make(transformers, impl)
    model.config.use_cache = False
    _hf.no_dropout(model)
    return model.train(), _hf._inputs(model, spec.padding)


def _train_step(model, kwargs, options):
    enn_backend.reset()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="enn", options=options)
    loss = _hf.loss_of(compiled(**kwargs))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, enn_backend.report().to_dict()


def _captured(model, kwargs) -> torch.fx.GraphModule:
    seen = []

    def capture(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=capture)(**kwargs)
    return max(seen, key=lambda gm: len(gm.graph.nodes))  # the graph with the layers (GPT-2 breaks once)


def test_the_plan_cuts_a_decoder_into_head_layers_and_tail():
    model, kwargs = _build("llama", 3)
    plan, why = blocks.plan(_captured(model, kwargs))
    assert plan is not None, why
    assert plan.names == ["head", "model.layers.0", "model.layers.1", "model.layers.2", "tail"], plan.names
    assert plan.layers == 3


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_a_single_layer_is_not_split(name):
    """One layer is one region: the graph is compiled whole (no plan), and says why."""
    model, kwargs = _build(name, 1)
    plan, why = blocks.plan(_captured(model, kwargs))
    assert plan is None and "2 or more layers" in why


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
@pytest.mark.parametrize("layers", [2, 4])
def test_hf_models_compile_each_distinct_layer_once(name, layers):
    """Head, one layer and tail are traced and compiled (forward and backward); every other layer
    runs the first layer's compiled unit; loss and gradients equal those of the graph compiled whole (LLaMA;
    GPT-2 and BERT against eager, to keep the suite short: the whole graph's own agreement with
    eager is the HF sweep's)."""
    model, kwargs = _build(name, layers)
    twin = copy.deepcopy(model)
    if name == "llama":
        want_loss, want_grads, _ = _train_step(twin, kwargs, {"blocks": "off"})
    else:
        want_loss = _hf.loss_of(twin(**kwargs))
        want_loss.backward()
        want_grads = {n: p.grad for n, p in twin.named_parameters() if p.grad is not None}
    loss, grads, rep = _train_step(model, kwargs, {"blocks": "on"})
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-6, atol=1e-7)
    assert grads.keys() == want_grads.keys()
    for n, g in grads.items():
        torch.testing.assert_close(g, want_grads[n], rtol=1e-5, atol=1e-6, msg=n)
    counters = rep["counters"]
    assert counters["blocks.compiled"] == 6, counters  # head, a layer, tail; forward and backward
    assert counters["blocks.reused"] == 2 * (layers - 1), counters
    # the other layers run the first layer's unit: not traced, no graphs of their own
    units = {g["unit"] for g in rep["graphs"]}
    assert len(units) == 3 + (name == "gpt2"), sorted(units)  # GPT-2: and the graph before its graph break
    assert rep["fallbacks"] == []


class Mix(torch.nn.Module):
    """Two kinds of layers: a plain MLP block and one with a gate."""

    def __init__(self, gated: bool) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
        self.gate = torch.nn.Linear(16, 32) if gated else None

    def forward(self, x):
        h = torch.relu(self.up(x))
        if self.gate is not None:
            h = h * torch.sigmoid(self.gate(x))
        return x + self.down(h)


class Stack(torch.nn.Module):
    def __init__(self, kinds: list[bool]) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.layers = torch.nn.ModuleList(Mix(k) for k in kinds)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x).square().mean()


def test_two_kinds_of_layers_compile_two_layer_graphs():
    torch.manual_seed(0)
    model, x = Stack([False, True, False, True, False]), torch.randn(4, 8)
    want = copy.deepcopy(model)
    want(x).backward()
    enn_backend.reset()
    torch.compile(model, backend="enn", options={"blocks": "on"})(x).backward()
    for (n, p), q in zip(model.named_parameters(), want.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)
    rep = enn_backend.report().to_dict()
    # head, the two kinds of layer and tail, each forward and backward; three layers reuse
    assert rep["counters"]["blocks.compiled"] == 8 and rep["counters"]["blocks.reused"] == 6, rep["counters"]
    # four units traced (head, one layer of each kind, tail): layers 3 to 5 run the units of 1 and 2
    assert sorted(g["id"] for g in rep["graphs"]) == sorted(f"g{i}/{p}" for i in range(4) for p in ("forward", "backward"))


class Scaled(torch.nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.lin, self.scale = torch.nn.Linear(16, 16), scale

    def forward(self, x):
        return x + self.scale * torch.tanh(self.lin(x))


def test_layers_that_differ_in_a_constant_do_not_share_a_unit():
    """A Python number is a constant of the Dynamo graph: layers scaled by 1 and by 2 are two
    units, whatever else they share."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Sequential(*[Scaled(s) for s in (1.0, 2.0, 1.0)]))
    want = copy.deepcopy(model)
    x = torch.randn(4, 8)
    want(x).square().mean().backward()
    enn_backend.reset()
    torch.compile(model, backend="enn", options={"blocks": "on"})(x).square().mean().backward()
    for (n, p), q in zip(model.named_parameters(), want.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)
    forwards = [g for g in enn_backend.report().graphs if g.phase == "forward"]
    assert len(forwards) == 3, [g.id for g in forwards]  # the head and two kinds of layer (no tail)


def test_each_backward_compiles_with_its_own_forwards_metadata(monkeypatch):
    """AOT Autograd compiles a backward on its first call, with the forward metadata it takes
    from a stack. Layers A B A B A: the backwards compile in the order tail, A, B, head (each unit
    at its last use), not the forwards' order reversed; each must still get its own forward's."""
    from enn_backend import graph_compiler

    seen: dict[tuple[str, str], object] = {}
    init = graph_compiler.GraphCompiler.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen[(self.unit, self.phase)] = getattr(self.tracing_ctx, "fw_metadata", None)

    monkeypatch.setattr(graph_compiler.GraphCompiler, "__init__", spy)
    torch.manual_seed(0)
    model, x = Stack([False, True, False, True, False]), torch.randn(4, 8)
    enn_backend.reset()
    torch.compile(model, backend="enn", options={"blocks": "on"})(x).backward()
    units = sorted({u for u, _ in seen})
    assert len(units) == 4, seen.keys()
    for u in units:
        assert seen[(u, "backward")] is seen[(u, "forward")] is not None, u


def _guards() -> dict[str, R.GuardedGraph]:
    """The guards of the graphs in the current report (earlier tests' may still be alive)."""
    mine = {id(g) for g in enn_backend.report().graphs}
    return {o.record.id: o for o in gc.get_objects() if type(o) is R.GuardedGraph and id(o.record) in mine}


def test_a_fault_in_a_shared_unit_is_handled_by_its_guard_for_every_layer_that_runs_it():
    """Layers 0 and 2 run one unit, layer 1 another. The shared forward returns NaN on its second
    call (layer 2's): that unit's guard gives eager's result and builds an artifact without the
    faulty code, which layers 0 and 2 both run from then on; layer 1's unit, the head's and the
    tail's report nothing and keep their artifacts."""
    torch.manual_seed(0)
    model, x = Stack([False, True, False]), torch.randn(4, 8)
    want = copy.deepcopy(model)
    enn_backend.reset()
    f = torch.compile(model, backend="enn", options={"blocks": "on", "persist": False, "repro": False})
    f(x)
    guards = _guards()
    assert sorted(guards) == ["g0/forward", "g1/forward", "g2/forward", "g3/forward"], sorted(guards)
    shared, other = guards["g1/forward"], guards["g2/forward"]
    artifacts = {k: g.compiled for k, g in guards.items()}
    calls = []

    def nan_on_second_call(args):
        out = artifacts["g1/forward"](args)
        calls.append(1)
        if len(calls) == 2:
            out[0] = torch.full_like(out[0], float("nan"))
        return out

    nan_on_second_call._boxed_call = True
    shared.compiled = nan_on_second_call
    got = f(x)
    torch.testing.assert_close(got, want(x), rtol=1e-5, atol=1e-6)
    rep = enn_backend.report().to_dict()
    assert rep["fallbacks"] and {fb["graph"] for fb in rep["fallbacks"]} == {"g1/forward"}, rep["fallbacks"]
    assert shared.compiled is not nan_on_second_call and shared.compiled is not artifacts["g1/forward"]
    assert all(guards[k].compiled is artifacts[k] for k in ("g0/forward", "g2/forward", "g3/forward"))
    assert other.compiled is artifacts["g2/forward"]
    torch.testing.assert_close(f(x), want(x), rtol=1e-5, atol=1e-6)


def test_blocks_option_values():
    assert Options.from_sources({"blocks": "on"}).blocks == "on"
    assert Options.from_sources({}).blocks == "off"
    with pytest.raises(OptionsError, match="off, on"):
        Options.from_sources({"blocks": "sometimes"})


@pytest.mark.parametrize("options, why", [({"blocks": "off"}, "off"), ({"blocks": "on", "nvtx": True}, "nvtx"),
                                          ({"blocks": "on", "fault_inject": "aten.mm:nan"}, "fault_inject")])
def test_where_blocks_do_not_split_the_graph_says_why(options, why):
    model, kwargs = _build("llama", 2)
    ok, reason = blocks.wanted(_captured(model, kwargs), list(kwargs.values()), Options.from_sources(options))
    assert not ok and why in reason


def test_each_layer_sees_where_its_mask_comes_from():
    """HF LLaMA builds its attention mask once, before the layers (left padding here). Each
    layer recomputes it, so the attention pass reads a causal flag and a key-padding bias in every
    layer, as in the graph compiled whole -- not an opaque T x T bias (which it reads when the
    layers are handed the head's mask tensor)."""
    def choices(mode: str) -> list:
        torch._dynamo.reset()
        enn_backend.reset()
        model, kwargs = _hf.build("llama", "eager")
        torch.compile(model, backend="enn", options={"blocks": mode, "attention_order": "flash,explicit"})(**kwargs)
        rep = enn_backend.report().to_dict()
        return [(c["choice"], c["causal"], c["key_padding"], c["mask"]) for g in rep["graphs"]
                for c in g["kernel_choices"] if "causal" in c]

    whole = choices("off")
    assert len(whole) == 2 and all(c[1] and c[2] for c in whole), whole
    assert choices("on") == whole[:1]  # the second layer runs the first layer's unit


def test_each_distinct_layer_is_charged_its_own_trace():
    """One compile holds a unit per distinct segment: each kind of layer's AOT Autograd trace is
    charged to that layer's forward graph (not all to the head's), and the phases still add up
    to the wall time."""
    import time

    torch.manual_seed(0)
    model, x = Stack([False, True, False]), torch.randn(4, 8)
    enn_backend.reset()
    t0 = time.perf_counter()
    torch.compile(model, backend="enn", options={"blocks": "on"})(x).backward()
    wall = time.perf_counter() - t0
    graphs = enn_backend.report().graphs
    layers = [g for g in graphs if g.phase == "forward" and g.unit in ("g1", "g2")]
    assert len(layers) == 2 and all(g.compile_phases.get("aot_autograd", 0) > 0 for g in layers), \
        [(g.id, g.compile_phases) for g in layers]
    total = sum(sum(g.compile_phases.values()) for g in graphs)
    assert abs(total - wall) <= 0.1 * wall, (total, wall)


def test_a_graph_left_whole_under_blocks_is_counted_and_logged(caplog):
    import logging

    torch.manual_seed(0)
    model, x = Stack([False]), torch.randn(4, 8)
    enn_backend.reset()
    with caplog.at_level(logging.INFO, logger="enn_backend"):
        torch.compile(model, backend="enn", options={"blocks": "on"})(x)
    assert enn_backend.report().to_dict()["counters"].get("blocks.not_split") == 1
    assert any("compiled whole" in r.getMessage() and "2 or more layers" in r.getMessage() for r in caplog.records)


class NormLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # no bias before the norm: its gradient is zero up to rounding, which AdamW would amplify
        self.lin, self.bn = torch.nn.Linear(16, 16, bias=False), torch.nn.BatchNorm1d(16)

    def forward(self, x):
        return x + torch.relu(self.bn(self.lin(x)))


def test_layers_that_write_buffers_leave_eagers_state():
    """Each layer updates its BatchNorm's running statistics: after two training steps under
    blocks (layers sharing one artifact) every buffer, parameter and AdamW state equals eager's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Sequential(*[NormLayer() for _ in range(3)]),
                                torch.nn.Linear(16, 4))  # layers 1.0, 1.1, 1.2
    want = copy.deepcopy(model)
    x = torch.randn(6, 8)
    enn_backend.reset()
    f = torch.compile(model, backend="enn", options={"blocks": "on"})
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, want)]
    for _ in range(2):
        for run, opt in ((f, opts[0]), (want, opts[1])):
            run(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert enn_backend.report().to_dict()["counters"].get("blocks.reused", 0) >= 2
    for (n, a), b in zip(model.state_dict().items(), want.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)
    for sa, sb in zip(opts[0].state.values(), opts[1].state.values()):
        for k in sa:
            torch.testing.assert_close(sa[k], sb[k], rtol=1e-5, atol=1e-6, msg=k)


def _marked(t: torch.Tensor, kind: str) -> torch.Tensor:
    t._dynamo_static_input_type = kind  # as Dynamo marks parameters and buffers
    return t


def test_a_segment_key_names_the_buffers_it_reads_not_their_content():
    """Two layers reading equal buffers of their own are two units (the buffer-content check of
    one unit would digest a different buffer every call); layers reading one buffer (HF's rotary
    ``inv_freq``) are one. Layouts, and which inputs share storage, tell keys apart too."""
    gm = torch.fx.symbolic_trace(lambda x, b: x * b + 1)
    x = torch.randn(4, 8)
    a, b = (_marked(torch.ones(8), "unguarded") for _ in range(2))
    assert blocks.segment_key(gm, [x, a]) == blocks.segment_key(gm, [torch.randn(4, 8), a])
    assert blocks.segment_key(gm, [x, a]) != blocks.segment_key(gm, [x, b])
    assert blocks.segment_key(gm, [x, a]) != blocks.segment_key(gm, [torch.randn(4, 8).t().contiguous().t(), a])
    y = torch.randn(8, 8)
    assert blocks.segment_key(gm, [y[:4], y[4:, 0]]) != blocks.segment_key(gm, [y[:4], torch.randn(8, 8)[4:, 0]])
    other = torch.fx.symbolic_trace(lambda x, b: x * b + 2)
    assert blocks.segment_key(gm, [x, a]) != blocks.segment_key(other, [x, a])


def test_an_equal_segment_gets_fake_outputs_laid_out_like_the_traced_ones():
    """The next segments are compiled for these outputs: the traced call's strides and gradient
    flags, not leaves; none where a traced output aliases an input or starts inside a storage."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        x = torch.empty(4, 8, requires_grad=True)
        out = (x * 2).t()  # strides (1, 8)
        flat = torch.empty(4, 8)
    seg = blocks.Segment(lambda *a: None, 2)
    seg.traced = ([x], [out, flat])
    new = seg.outputs_for(mode)
    assert [t.stride() for t in new] == [(1, 8), (8, 1)]
    assert new[0].requires_grad and not new[0].is_leaf and not new[1].requires_grad
    seg.traced = ([x], [x[1:]])
    assert seg.outputs_for(mode) is None  # a view of the input
    seg.traced = ([x], [out, out])
    assert seg.outputs_for(mode) is None  # two outputs of one storage
