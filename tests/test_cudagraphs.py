"""The guard under CUDA graphs (``options={"mode": "reduce-overhead"}``): a fault injected in the
forward or the backward of a training step, or in an inference call, is recovered on the step
that meets it and pinned, every step equal to eager's, with Inductor's CUDA-graph trees holding
the outputs autograd saved (localization trials run outside the trees: graph_compiler.build)."""

from __future__ import annotations

import pytest
import torch

import enn_backend

from _models import assert_close_step, make, train_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

OPTIONS = {"mode": "reduce-overhead", "attention": False, "epilogue": False, "persist": False}
FAULT_OP = {"mlp": {"fwd": "aten.addmm", "bwd": "aten.mm"}, "block": {"fwd": "aten.erf", "bwd": "aten.erf"}}
STEPS = 4  # the first meets the fault; the next ones replay the pinned graph's CUDA graph


def _cuda(kind: str) -> tuple[torch.nn.Module, torch.Tensor]:
    model, x = make(kind)
    return model.cuda(), x.cuda()


def _fallback(phase: str) -> dict:
    """The one fallback of the run: the injected fault, pinned in the graph of ``phase``, which runs
    without CUDA graphs from then on."""
    rep = enn_backend.report().to_dict()
    fallbacks = [f for f in rep["fallbacks"] if f["kind"] != "pinned_from_state"]
    assert len(fallbacks) == 1, fallbacks
    fb = fallbacks[0]
    graph = next(g for g in rep["graphs"] if g["id"] == fb["graph"])
    assert graph["phase"] == phase and graph["pinned"] and set(fb["node"].split(",")) == set(graph["pinned"]), fb
    assert "without CUDA graphs from now on" in fb["action"], fb
    return fb


@pytest.mark.parametrize("model_kind", ["mlp", "block"])
@pytest.mark.parametrize("phase", ["fwd", "bwd"])
@pytest.mark.parametrize("kind", ["raise", "nan"])
def test_training_under_cuda_graphs_recovers_a_fault_on_the_step_that_meets_it(kind, phase, model_kind):
    model, x = _cuda(model_kind)
    op = FAULT_OP[model_kind][phase]
    compiled = torch.compile(model, backend="enn", options={**OPTIONS, "fault_inject": f"{op}:{kind}:{phase}"})
    for _ in range(STEPS):
        assert_close_step(train_step(model, x, compiled), train_step(model, x))
    fb = _fallback({"fwd": "forward", "bwd": "backward"}[phase])
    assert fb["kind"] == {"raise": "exception", "nan": "nonfinite"}[kind]


@pytest.mark.parametrize("kind", ["raise", "nan"])
def test_inference_under_cuda_graphs_recovers_a_fault(kind):
    model, x = _cuda("mlp")
    compiled = torch.compile(model, backend="enn", options={**OPTIONS, "fault_inject": f"aten.addmm:{kind}:fwd"})
    with torch.no_grad():
        want = model(x)
        for _ in range(STEPS):
            torch.testing.assert_close(compiled(x).clone(), want)
    assert _fallback("inference")["kind"] == {"raise": "exception", "nan": "nonfinite"}[kind]
