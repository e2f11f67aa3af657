"""The fallback ladder's last rung: a fault that no pin set removes makes the graph run eagerly.

The other rungs (a fault localized and pinned, the model's own NaN/Inf, the fp32 retry, a
value difference no pin explains) are covered by tests/test_guard.py and test_guard_state.py;
this one needs a fault that survives every pin, which no planted kernel fault gives (pinning
its op removes it): every artifact the graph's compiler builds is made faulty instead.
"""

from __future__ import annotations

import gc

import torch

import enn_backend
from enn_backend.graph_compiler import GraphCompiler
from enn_backend.guard.runtime import GuardedGraph

ISOLATED = {"attention": False, "epilogue": False, "persist": False, "repro": False, "localize_budget": 4}


class _Small(torch.nn.Module):
    def forward(self, x):
        return torch.sin(x) * 2.0 + torch.cos(x)


def _nan_first_output(compiled):
    """``compiled`` (a boxed artifact) with NaN written over its first output."""
    def faulty(args):
        out = compiled(args)
        out[0].fill_(float("nan"))
        return out

    faulty._boxed_call = True
    return faulty


def test_a_fault_no_pin_removes_runs_the_graph_eagerly(monkeypatch):
    build = GraphCompiler.build
    monkeypatch.setattr(GraphCompiler, "build", lambda self, *a, **k: _nan_first_output(build(self, *a, **k)))
    model, x = _Small(), torch.randn(4, 8)
    compiled = torch.compile(model, backend="enn", options={**ISOLATED, "nvtx": True})
    want = model(x)
    for _ in range(2):  # the first call meets the fault; the next runs the eager graph
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), want)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, torch.no_grad():
        torch.testing.assert_close(compiled(x), want)
    ranges = {e.name for e in prof.events() if e.name.startswith("enn/")}

    rep = enn_backend.report().to_dict()
    (fb,) = rep["fallbacks"]
    assert fb["kind"] == "nonfinite" and fb["node"] == "<graph>"
    assert fb["action"] == "graph runs eagerly from now on (pinning every op did not remove the fault)"
    (g,) = rep["graphs"]
    assert g["path"] == "eager" and g["counters"]["faults"] == 1 and g["counters"]["calls"] == 3
    assert ranges == {f"enn/eager/graph {g['id']}"}  # option nvtx: the eager-run graph is a named range

    # this graph's guard: the one holding this report's record (an earlier test's graph, still
    # alive in the process, may carry the same id)
    (record,) = enn_backend.report().graphs
    guard = next(o for o in gc.get_objects() if type(o) is GuardedGraph and o.record is record)
    assert guard.decision is not None and guard.decision.eager and not guard.decision.pins


def test_an_attention_kernels_saved_state_is_not_screened():
    """An attention kernel's saved log-sum-exp holds infinities by the kernel's convention (its
    padding, rows that keep no key) that the reference lays out per kernel: the screen skips it,
    as a value check judges it by layout alone; other outputs are screened as before."""
    from enn_backend.guard import screen as S

    out = torch.zeros(2, 3)
    lse = torch.tensor([[1.0, float("inf")], [float("-inf"), float("nan")]])
    assert S.nonfinite_outputs([out, lse]) == [1]
    assert S.nonfinite_outputs([out, lse], {1: S.UNSCREENED}) == []
    assert S.nonfinite_outputs([out.fill_(float("nan")), lse], {1: S.UNSCREENED}) == [0]
