"""A function Dynamo compiles again for every new size (enn_backend/size_recompiles.py): counted,
logged once with what to do, and a ``recompile_limit`` fallback line when Dynamo stops compiling it
and runs new sizes eagerly; nothing said where Dynamo makes the size dynamic."""

from __future__ import annotations

import logging

import torch

import enn_backend
from enn_backend import compat

SIZE_RECOMPILES = "dynamo.size_recompiles"


def _f(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) * 2 + 1


def _run(compiled, sizes) -> None:
    for n in sizes:
        x = torch.randn(n)
        torch.testing.assert_close(compiled(x), _f(x))


def test_static_recompiles_for_sizes_are_counted_logged_once_and_the_limit_is_a_fallback(caplog):
    limit = compat.recompile_limit()
    compiled = torch.compile(_f, backend="enn", dynamic=False, options={"persist": False})
    with caplog.at_level(logging.WARNING, logger="enn_backend"):
        _run(compiled, range(3, 3 + limit + 2))  # past the limit: the last sizes run eagerly
    rep = enn_backend.report().to_dict()
    assert rep["counters"].get(SIZE_RECOMPILES) == limit - 1  # every compile after the first
    (fb,) = rep["fallbacks"]
    assert fb["kind"] == "recompile_limit" and fb["node"] == "<frame>"
    assert f"{limit} times" in fb["reason"] and "L['x'] [3] ->" in fb["reason"]
    assert "eagerly" in fb["action"] and "dynamic=True" in fb["action"]
    logged = [r.getMessage() for r in caplog.records if "again for new sizes" in r.getMessage()]
    assert len(logged) == 1 and "[3] -> [4]" in logged[0] and "mark_dynamic" in logged[0], logged


def test_a_size_made_dynamic_by_dynamo_is_not_a_size_recompile():
    """Automatic dynamic shapes: the second size compiles a symbolic graph, which serves the rest."""
    compiled = torch.compile(_f, backend="enn", options={"persist": False})
    _run(compiled, range(3, 9))
    rep = enn_backend.report().to_dict()
    assert SIZE_RECOMPILES not in rep["counters"] and rep["fallbacks"] == []


def test_a_frame_compiled_again_after_a_reset_starts_a_new_history():
    compiled = torch.compile(_f, backend="enn", dynamic=False, options={"persist": False})
    _run(compiled, [3])
    torch.compiler.reset()
    _run(compiled, [4])  # the frame's first compile again: no earlier size to compare with
    assert SIZE_RECOMPILES not in enn_backend.report().to_dict()["counters"]


def _g(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x) - 1


def test_a_frame_id_given_again_after_a_reset_starts_the_new_functions_history(caplog):
    """Dynamo numbers frames from 0 again after a reset: another function compiled as frame 0
    is compared with its own earlier sizes, never with those of the function that held the id."""
    torch.compiler.reset()  # _g is frame 0, and after the next reset _f is
    torch.compile(_g, backend="enn", dynamic=False, options={"persist": False})(torch.randn(64))
    torch.compiler.reset()
    compiled = torch.compile(_f, backend="enn", dynamic=False, options={"persist": False})
    with caplog.at_level(logging.WARNING, logger="enn_backend"):
        _run(compiled, [3, 4])
    assert enn_backend.report().to_dict()["counters"][SIZE_RECOMPILES] == 1
    (logged,) = [r.getMessage() for r in caplog.records if "again for new sizes" in r.getMessage()]
    assert "[3] -> [4]" in logged, logged


def test_a_recompile_for_another_reason_is_not_counted():
    """A new dtype (another kind of input) compiles again, but not for a size."""
    compiled = torch.compile(_f, backend="enn", dynamic=False, options={"persist": False})
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(5, dtype=dtype)
        torch.testing.assert_close(compiled(x), _f(x))
    assert SIZE_RECOMPILES not in enn_backend.report().to_dict()["counters"]


def test_a_graph_break_gives_two_frames_each_counted_and_limited_on_its_own():
    """After a graph break Dynamo compiles the rest of the function as a frame of its own (its
    resume function): a new size recompiles both, each a size recompile of its own frame, and
    each frame reaches the limit once."""
    def broken(x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x) * 2
        torch._dynamo.graph_break()
        return y.sin() + 1

    limit = compat.recompile_limit()
    compiled = torch.compile(broken, backend="enn", dynamic=False, options={"persist": False})
    for n in range(3, 3 + limit + 1):
        x = torch.randn(n)
        torch.testing.assert_close(compiled(x), broken(x))
    rep = enn_backend.report().to_dict()
    assert rep["counters"].get(SIZE_RECOMPILES) == 2 * (limit - 1)
    frames = sorted(f["reason"].split("]")[0] for f in rep["fallbacks"] if f["kind"] == "recompile_limit")
    assert frames == ["Dynamo compiled frame [0/*", "Dynamo compiled frame [1/*"], frames
