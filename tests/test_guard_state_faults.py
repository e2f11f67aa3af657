"""A fault in a step that writes state is handled like one in an output: a NaN or a wrong value
written into a parameter, a buffer or optimizer state is screened on the calls the schedule
checks, localized and pinned, and the call leaves eager's state -- the caller's tensors written
once, by the result the guard returns."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import enn_backend
from enn_backend import compat

BASE = {"persist": False, "repro": False}
STEPS = 12


def _adam_steps(step_fn_of, foreach: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, foreach=foreach)
    step = step_fn_of(opt.step)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        step()
    return model, opt


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"param {n}": p.detach() for n, p in model.named_parameters()}
    names = {p: n for n, p in model.named_parameters()}
    out.update({f"{names[p]} {k}": v for p, st in opt.state.items() for k, v in st.items()})
    return out


def _assert_close_states(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k, w in want.items():
        assert torch.isfinite(got[k]).all(), f"{k} holds NaN/Inf"
        torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("foreach, spec, kind, culprit", [
    (False, "aten.sqrt:nan@5+", "nonfinite", "sqrt"),
    (True, "aten._foreach_sqrt:nan@5+", "nonfinite", "_foreach_sqrt"),
    (False, "aten.div:scale1.01", "value", "div"),
], ids=["nan-from-call-5", "foreach-nan-from-call-5", "drift-1pct"])
def test_a_fault_in_a_compiled_optimizer_step_is_pinned_and_leaves_eagers_state(foreach, spec, kind, culprit):
    """A compiled Adam step whose sqrt makes NaN from call 5 on (its graph has no output: every
    result is a write into a parameter or the optimizer's state), or whose division is 1% off from
    the first call: the fault is found on a checked call, the culprit op pinned, and after 12 steps
    the parameters, moments and step counters equal eager's."""
    want = _state(*_adam_steps(lambda f: f, foreach))
    got = _state(*_adam_steps(lambda f: torch.compile(f, backend="enn", options={**BASE, "fault_inject": spec}),
                              foreach))
    _assert_close_states(got, want)
    fallbacks = enn_backend.report().to_dict()["fallbacks"]
    assert [f["kind"] for f in fallbacks] == [kind], fallbacks
    assert culprit in fallbacks[0]["node"].split(",")[0] and "written in place" in fallbacks[0]["reason"], fallbacks


class _BN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.fc(x))))


def _bn_steps(compile_fn) -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = _BN().train()
    step = compile_fn(model)
    g = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(4):
        loss = step(torch.randn(8, 8, generator=g)).square().mean()
        loss.backward()
        losses.append(loss.detach())
    return model, losses


@pytest.mark.parametrize("spec", ["aten.addmm:nan:fwd", "aten.mm:nan:bwd"], ids=["forward", "backward"])
def test_a_nan_in_a_batchnorm_models_step_leaves_eagers_running_statistics(spec):
    """A NaN planted after a Linear feeding BatchNorm (forward: it reaches the running statistics
    the forward writes; backward: the gradients): the guard pins the kernel and the running
    statistics, the batch count, the losses and the gradients equal eager's."""
    want, want_losses = _bn_steps(lambda m: m)
    got, losses = _bn_steps(lambda m: torch.compile(m, backend="enn", options={**BASE, "fault_inject": spec}))
    for (name, b), w in zip(got.named_buffers(), want.buffers()):
        if b.is_floating_point():
            torch.testing.assert_close(b, w, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        else:
            assert torch.equal(b, w), name
    for (name, p), w in zip(got.named_parameters(), want.parameters()):
        torch.testing.assert_close(p.grad, w.grad, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}.grad: {m}")
    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=1e-5, atol=1e-6)
    fallbacks = enn_backend.report().to_dict()["fallbacks"]
    assert [f["kind"] for f in fallbacks] == ["nonfinite"], fallbacks


def test_without_aot_metadata_the_dynamo_graph_reference_copies_everything_and_writes_nothing(monkeypatch):
    """Where AOT Autograd's metadata does not say what a unit writes, the Dynamo-graph reference
    copies every input and module attribute before the compiled call: BatchNorm's running
    statistics are still updated once (counted in the report)."""
    monkeypatch.setattr(compat, "aot_metadata", lambda ctx: None)
    want, _ = _bn_steps(lambda m: m)
    got, _ = _bn_steps(lambda m: torch.compile(m, backend="enn", options={**BASE, "guard_values": 1}))
    for (name, b), w in zip(got.named_buffers(), want.buffers()):
        torch.testing.assert_close(b, w, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    rep = enn_backend.report().to_dict()
    assert rep["fallbacks"] == [] and rep["counters"].get("guard.dynamo_reference_copies_all", 0) >= 1, rep["counters"]
