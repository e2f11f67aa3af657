"""The graph compiler pins the nodes compat.KNOWN_MISCOMPILES lists (ATen nodes Inductor is known
to compute wrong on this torch and device) before it compiles: each runs its eager kernel, with a
``known_miscompile`` report line and one log line naming the upstream issue. CPU, tiny shapes."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._subclasses import FakeTensorMode

import enn_backend
from enn_backend import compat
from enn_backend.report import fallback_line, format_report

# Inputs where Inductor is wrong on CPU (2.11 - 2.15): 1.0 // 0.1 gives 10 (eager 9, #197895);
# 1e20 % 3 gives 0 (eager 2, #198057).
A = [1.0, 1e20, 5.5]
B = [0.1, 7.0, 2.0]


def floor_and_remainder(a, b):
    return (a // b) * 2 + torch.remainder(a, 3.0)


def known(kind: str = "known_miscompile") -> list:
    return [f for f in enn_backend.report().fallbacks if f.kind == kind]


def test_known_miscompiles_are_pinned_reported_and_logged_once(caplog):
    a, b = torch.tensor(A), torch.tensor(B)
    fn = torch.compile(floor_and_remainder, backend="enn")
    with caplog.at_level(logging.INFO, logger="enn_backend"):
        out = fn(a, b)
        fn(a, b)  # a second call logs nothing more
    assert torch.equal(out, floor_and_remainder(a, b))

    (graph,) = enn_backend.report().graphs
    pins = known()
    assert sorted(f.node for f in pins) == graph.pinned and len(pins) == 2
    assert graph.counters["pinned_in_graph"] == 2  # the compiled artifact holds them as enn::pinned
    assert graph.compiled_nodes == graph.compute_nodes - 2
    assert all(f.graph == graph.id and f.phase == "inference" for f in pins)
    assert [f.kind for f in enn_backend.report().fallbacks] == ["known_miscompile"] * 2  # no fault met
    by_issue = {issue: [f for f in pins if f"pytorch/pytorch#{issue}" in f.reason] for issue in (197895, 198057)}
    assert all(len(v) == 1 for v in by_issue.values()), pins
    assert "1.0 // 0.1 gives 10" in by_issue[197895][0].reason and "1e20 % 3 gives 0" in by_issue[198057][0].reason

    data = enn_backend.report().to_dict()
    text = format_report(data)
    lines = [r.getMessage() for r in caplog.records if "[known_miscompile]" in r.getMessage()]
    assert len(lines) == 2 and all(r.levelno == logging.INFO for r in caplog.records if "[known_miscompile]" in r.getMessage())
    for f in data["fallbacks"]:
        line = fallback_line(f)
        assert line in text and any(m.endswith(line) for m in lines)  # the report and the log say the same
        assert f"[{f['node']}]" in line and f["reason"] in line and "pinned to its eager kernel" in line


def test_gradients_through_a_known_miscompile_equal_eager():
    """remainder's gradient for its divisor is -floor(a / b): Inductor's is one too high at 1.0 % 0.1."""
    def run(fn):
        a, b = torch.tensor(A[:1] + [7.5, 5.5], requires_grad=True), torch.tensor(B, requires_grad=True)
        fn(a, b).sum().backward()
        return b.grad

    remainder = torch.remainder
    assert torch.equal(run(torch.compile(remainder, backend="enn")), run(remainder))
    reasons = " ".join(f.reason for f in known())
    assert "pytorch/pytorch#197895" in reasons and "pytorch/pytorch#198057" in reasons


def test_graph_without_known_miscompiles_gets_no_pin():
    def exact(i, f, g):  # integer floor division and remainder, truncating float division: right
        return torch.div(i, 3, rounding_mode="floor") + torch.remainder(i, 3), torch.div(f, g, rounding_mode="trunc")

    i, f, g = torch.arange(-6, 6, dtype=torch.int32), torch.tensor(A), torch.tensor(B)
    out = torch.compile(exact, backend="enn")(i, f, g)
    for got, want in zip(out, exact(i, f, g)):
        assert torch.equal(got, want)
    (graph,) = enn_backend.report().graphs
    assert not known() and graph.pinned == [] and graph.counters["pinned_in_graph"] == 0


def test_known_miscompiles_are_pinned_with_the_guard_off():
    """The pins are not a run-time check: guard="off" compiles them the same way."""
    a, b = torch.tensor(A), torch.tensor(B)
    out = torch.compile(floor_and_remainder, backend="enn", options={"guard": "off"})(a, b)
    assert torch.equal(out, floor_and_remainder(a, b))
    assert len(known()) == 2


@pytest.mark.parametrize("device,pinned", [("cpu", ["floor_divide", "remainder"]),
                                           ("cuda", ["floor_divide"]),  # remainder: CPU code generation
                                           ("meta", [])])
def test_known_miscompiles_follow_the_device(device, pinned):
    """Entries apply on the device types they list (the node's output device): floating floor
    division is a device-independent lowering, the vectorized remainder CPU code generation."""
    with FakeTensorMode():
        a, b = torch.empty(3, device=device), torch.empty(3, device=device)
    gm = compat.make_fx(lambda a, b: (a // b, torch.remainder(a, 3.0)))(a, b)
    assert [name for name, _ in compat.known_miscompiles(gm)] == pinned
