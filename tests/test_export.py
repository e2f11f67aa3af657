"""The export boundary: a model enn compiles for training still exports, before and after.

``torch.export.export`` and ``torch.onnx.export(..., dynamo=True)`` of the same module that
``backend="enn"`` compiled (in place, ``module.compile``) must give the model's own ATen ops --
no ``enn::`` op -- and compute what eager computes. torch skips a compiled region while it
exports; when export asks for the compile itself (``force_compile_during_fx_trace``), enn
compiles nothing and hands the captured graph back (enn_backend/backend.py ``_exported``).
"""

from __future__ import annotations

import copy

import pytest
import torch

import enn_backend
from enn_backend import compat
from tests import _hf, _models


def _gpt():
    model, x = _models.make("block")
    return model.train(), (x,), {}, lambda out: out


def _llama():
    model, kwargs = _hf.build("llama")
    kwargs.pop("labels")  # the logits are the output (with labels the loss comes first)
    return model, (), kwargs, lambda out: out.logits


MODELS = {"gpt_block": _gpt, "hf_llama": _llama}


def _train_under_enn(model, args, kwargs, pick):
    model.compile(backend="enn")  # in place: the module itself now runs enn's compiled code
    out = pick(model(*args, **kwargs))
    out.float().square().mean().backward()
    graphs = enn_backend.report().to_dict()["graphs"]
    assert {g["phase"] for g in graphs} >= {"forward", "backward"}, graphs  # enn compiled it for training


def _ops(ep) -> set[str]:
    return {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("name", list(MODELS))
def test_torch_export_of_a_model_enn_compiles(name, when):
    model, args, kwargs, pick = MODELS[name]()
    eager = copy.deepcopy(model)
    if when == "after":
        _train_under_enn(model, args, kwargs, pick)
    before = len(enn_backend.report().graphs)
    ep = torch.export.export(model, args, kwargs)
    assert len(enn_backend.report().graphs) == before  # export compiled nothing with enn
    assert not [op for op in _ops(ep) if "enn" in op], _ops(ep)
    assert "aten.addmm.default" in _ops(ep) or "aten.linear.default" in _ops(ep)
    with torch.no_grad():
        torch.testing.assert_close(pick(ep.module()(*args, **kwargs)), pick(eager(*args, **kwargs)),
                                   rtol=1e-5, atol=1e-5)
    if when == "before":  # and enn still compiles the module after it was exported
        _train_under_enn(model, args, kwargs, pick)


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("name", list(MODELS))
def test_onnx_export_of_a_model_enn_compiles(name, when):
    pytest.importorskip("onnxscript")
    from onnx.reference import ReferenceEvaluator

    model, args, kwargs, pick = MODELS[name]()
    eager = copy.deepcopy(model)
    if when == "after":
        _train_under_enn(model, args, kwargs, pick)
    program = torch.onnx.export(model, args, kwargs=kwargs, dynamo=True, verbose=False)
    domains = {n.domain for n in program.model_proto.graph.node}
    assert domains <= {"", "pkg.onnxscript.torch_lib", "pkg.onnxscript.torch_lib.common"}, domains
    feeds = {i.name: t.numpy() for i, t in zip(program.model_proto.graph.input, [*args, *kwargs.values()])}
    got = torch.from_numpy(ReferenceEvaluator(program.model_proto).run(None, feeds)[0])
    with torch.no_grad():
        want = pick(eager(*args, **kwargs))
    if "attention_mask" in kwargs:  # the rows of pad tokens (they see no key) differ under onnx's
        keep = kwargs["attention_mask"].bool()  # reference evaluator, with or without enn: not compared
        got, want = got[keep], want[keep]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not compat.export_traces_compiled_regions(),
                    reason="this torch's export fails on a compiled region with any backend "
                           "(compat.export_traces_compiled_regions)")
def test_a_compile_that_export_asks_for_runs_as_captured():
    """With ``force_compile_during_fx_trace`` export compiles a torch.compile'd region while it
    traces, and traces through what the backend returns (Inductor's kernels cannot take export's
    fake tensors). enn returns the captured graph: the export holds its ATen ops, equals eager,
    and the report says so; nothing is compiled, guarded or localized."""
    lin = torch.nn.Linear(32, 32)
    region = torch.compile(lambda t: torch.nn.functional.gelu(t) * 2, backend="enn")

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return region(self.lin(x))

    model, x = Model(), torch.randn(2, 16, 32)
    with torch._dynamo.config.patch(force_compile_during_fx_trace=True):
        ep = torch.export.export(model, (x,), strict=False)
    rep = enn_backend.report().to_dict()
    assert [f["kind"] for f in rep["fallbacks"]] == ["exporting"], rep["fallbacks"]
    assert rep["graphs"] == []  # nothing compiled
    assert _ops(ep) == {"aten.linear.default", "aten.gelu.default", "aten.mul.Tensor"}, _ops(ep)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x), torch.nn.functional.gelu(lin(x)) * 2)
