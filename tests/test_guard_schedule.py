"""What the guard decides per call: its schedule (warm-up, screens, value checks, the Dynamo-graph
reference) is decided on the calls it is due, and the calls between cost one comparison; and the
value check's comparison of two results (guard/screen.py), whose common case is a shortcut."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import enn_backend
from enn_backend.guard.dynamo_reference import DynamoReference
from enn_backend.guard.runtime import GuardedGraph
from enn_backend.guard.schedule import Action, Schedule
from enn_backend.guard.screen import compiled_is_worse, finite_close, same_nonfinite, same_values

from _models import make

ISOLATED = {"attention": False, "epilogue": False, "persist": False}
INF, NAN = float("inf"), float("nan")


def _counting(monkeypatch, cls: type, name: str) -> list[int]:
    """Record the call count each time ``cls.name`` runs."""
    seen: list[int] = []
    inner = getattr(cls, name)

    def counted(self, *args):
        seen.append(self.calls)
        return inner(self, *args)

    monkeypatch.setattr(cls, name, counted)
    return seen


DEFAULTS = Schedule(warmup=20, every=50, value_every=1000, values_always=False, checks_outputs=True, keep_inputs=False)
FEW = Schedule(warmup=3, every=10, value_every=25, values_always=False, checks_outputs=True, keep_inputs=False)
B, H, S, L, V = Action.BARE, Action.HOLD, Action.SCREEN, Action.SCREEN_LATER, Action.VALUES


@pytest.mark.parametrize("schedule, n, k, first_call_values, screen_later, action", [
    # the defaults: the first call compared with eager, the warm-up screened, then every 50th
    (DEFAULTS, 1, 1, True, False, V),
    (DEFAULTS, 1, 1, False, False, S),  # an artifact loaded from a cache: checked when compiled
    (DEFAULTS, 2, 2, True, False, S),
    (DEFAULTS, 20, 20, True, True, S),  # the warm-up is screened synchronously even on a GPU
    (DEFAULTS, 21, 21, True, False, B),
    (DEFAULTS, 50, 50, True, False, S),
    (DEFAULTS, 50, 50, True, True, L),  # past the warm-up, outputs on one GPU: read on the next call
    (DEFAULTS, 1000, 1000, True, True, V),  # every guard_values-th call: compared with eager
    (DEFAULTS, 1001, 1, True, False, V),  # a new artifact's first call (after a fault was pinned)
    (DEFAULTS, 1001, 1, False, False, S),
    (FEW, 4, 4, True, False, B),
    (FEW, 10, 10, True, True, L),
    (replace(FEW, every=1), 10, 10, True, True, S),  # every call screened: none read late
    (FEW, 25, 25, True, True, V),
    (replace(FEW, value_every=0), 25, 25, True, False, B),  # value checks off (random draws, or ranks)
    (replace(FEW, value_every=0), 1, 1, True, False, S),
    (replace(FEW, values_always=True), 10, 10, True, True, V),  # mode "values": every check compares
    (replace(FEW, values_always=True), 4, 4, True, True, B),
    (replace(FEW, checks_outputs=False, keep_inputs=True, value_every=0), 1, 1, True, False, H),  # "exceptions"
    (replace(FEW, checks_outputs=False, keep_inputs=True, value_every=0), 7, 7, True, False, H),
])
def test_schedule_table(schedule, n, k, first_call_values, screen_later, action):
    assert schedule.action(n, k, first_call_values, screen_later) is action


@pytest.mark.parametrize("schedule, n, k, late_pending, due", [
    (DEFAULTS, 1, 1, False, 2),  # the warm-up: every call
    (DEFAULTS, 19, 19, False, 20),
    (DEFAULTS, 20, 20, False, 50),  # then the next multiple of guard_every ...
    (DEFAULTS, 950, 950, False, 1000),  # ... or of guard_values, whichever comes first
    (DEFAULTS, 50, 50, True, 51),  # a late screen is read on the next call
    (FEW, 3, 3, False, 10),
    (FEW, 20, 20, False, 25),
    (replace(FEW, warmup=0), 0, 0, False, 1),  # no warm-up: the artifact's first call still decides
    (replace(FEW, keep_inputs=True), 5, 5, False, 6),  # mode "exceptions": every call holds its inputs
])
def test_next_due_table(schedule, n, k, late_pending, due):
    assert schedule.next_due(n, k, late_pending) == due


def test_only_due_calls_leave_the_fast_path(monkeypatch):
    slow = _counting(monkeypatch, GuardedGraph, "_scheduled")
    sampled = _counting(monkeypatch, DynamoReference, "_due_call")
    model, x = make("mlp")
    compiled = torch.compile(model, backend="enn",
                             options={**ISOLATED, "guard_warmup": 3, "guard_every": 10, "guard_values": 25})
    with torch.no_grad():
        for _ in range(60):
            compiled(x)
    # the warm-up (calls 1-3), every 10th call (screens) and every 25th (value checks); nothing else
    assert slow == [1, 2, 3, 10, 20, 25, 30, 40, 50, 60], slow
    assert sampled == [1, 25, 50], sampled  # the Dynamo-graph reference: the first call, every 25th
    (g,) = enn_backend.report().to_dict()["graphs"]
    # calls 25 and 50, and the first call unless the graph came from AOTAutograd's cache (an
    # earlier test in this process may have compiled the same model: checked when compiled)
    value_checks = 2 if g.get("from_cache") else 3
    assert g["counters"]["calls"] == 60 and g["counters"]["checks"] == 10
    assert g["counters"]["value_checks"] == value_checks, (g["counters"], g.get("from_cache"))


def test_restarting_the_warm_up_checks_the_next_calls(monkeypatch):
    """Setting ``since_build`` (what the ladder does when it adopts an artifact, and the tests do to
    force a check) moves the next due call to the very next one."""
    import gc

    model, x = make("mlp")
    compiled = torch.compile(model, backend="enn", options={**ISOLATED, "guard_warmup": 3, "guard_every": 1000,
                                                            "guard_values": 0})
    with torch.no_grad():
        for _ in range(20):
            compiled(x)
        (record,) = enn_backend.report().graphs
        guard = next(o for o in gc.get_objects() if type(o) is GuardedGraph and o.record is record)
        checks = record.counters["checks"]
        assert guard.due == 1000 and checks == 3
        guard.since_build = 0
        slow = _counting(monkeypatch, GuardedGraph, "_scheduled")
        for _ in range(5):
            compiled(x)
    assert slow == [21, 22, 23] and record.counters["checks"] == checks + 3, (slow, record.counters)
    assert guard.due == 1000


# ----------------------------------------------------------------------------- comparisons
def _t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_same_values_within_and_beyond_the_tolerance(dtype):
    """fp32's band: |a - b| <= 1e-5 * max(1, max |b|) + 1e-4 * |b|; here 3e-3 + 1e-4 at b = 1."""
    b = _t([1.0, -2.0, 300.0, 0.0], dtype)
    for delta, same in ((1.5e-3, True), (3.0e-3, True), (3.2e-3, False), (1.2e-2, False)):
        a = b.clone()
        a[0] += delta
        assert same_values(a, b) is same, delta
    assert same_values(b * (1 + 0.9e-4), b) and not same_values(b * (1 + 1.1e-4) + 3.1e-3, b)
    assert not same_values(b, b.to(torch.float16))  # another dtype


def test_low_precision_values_are_also_compared_as_a_whole():
    """bf16: every element may move by the wide band (5e-2) that rounding and reordered sums need,
    but a tensor off by a few percent everywhere -- a drifted kernel, x1.05 -- moves its whole
    L2 norm by that share, and fails; rounding noise of the same size per element does not."""
    g = torch.Generator().manual_seed(0)
    b = torch.randn(64, 64, generator=g).to(torch.bfloat16)
    assert not same_values(b * 1.05, b) and not finite_close(b * 1.05, b)
    noise = (b.float() * (1 + 4e-3 * torch.randn(64, 64, generator=g))).to(torch.bfloat16)
    assert same_values(noise, b) and finite_close(noise, b)
    # fp32 keeps its elementwise band alone (tight enough), and near-zero tensors their floor
    assert same_values(_t([1e-7, -2e-7]) * 1.5, _t([1e-7, -2e-7]))
    assert same_values(_t([3e-6, -2e-6], torch.bfloat16), _t([1e-6, -1e-6], torch.bfloat16))


def test_a_drifted_result_is_judged_worse_even_where_the_reference_rounds_coarsely():
    """The fp64 judge: a result scaled by 1.05 is worse than a reference whose own rounding
    (an FP8 GEMM's, 3 mantissa bits) is larger than the drift's RMSE allows for; rounding of the
    same size as the reference's is not."""
    g = torch.Generator().manual_seed(0)
    exact = torch.randn(64, 64, generator=g, dtype=torch.float64) * 0.2
    ref = (exact * (1 + 0.06 * torch.randn(64, 64, generator=g, dtype=torch.float64))).to(torch.bfloat16)
    drifted = (exact * 1.05).to(torch.bfloat16)
    rounded = (exact * (1 + 0.06 * torch.randn(64, 64, generator=g, dtype=torch.float64))).to(torch.bfloat16)
    assert compiled_is_worse(drifted, ref, exact.to(torch.bfloat16), low_precision=True)
    assert not compiled_is_worse(rounded, ref, exact.to(torch.bfloat16), low_precision=True)


def test_same_values_compares_nonfinite_places_exactly():
    a = _t([1.0, NAN, INF, -INF])
    assert same_values(a, a.clone())
    assert not same_values(a, _t([1.0, NAN, INF, INF]))  # an infinity of the other sign
    assert not same_values(a, _t([1.0, 0.0, INF, -INF]))  # a NaN where the reference is finite
    assert not same_values(_t([1.0, 2.0]), _t([1.0, NAN]))  # the shortcut's "not all finite" goes exact
    assert not same_values(_t([1.0, 2.0, INF]), _t([1.5, 2.0, INF]))  # finite values still compared
    assert same_nonfinite(a, a.clone()) and finite_close(a, _t([1.0, 5.0, -INF, INF]))


def test_same_values_when_an_fp64_sum_overflows():
    """The shortcut sums in fp64; fp64 values near its range overflow there and take the exact path,
    which must judge them as before."""
    big = _t([1e308, 1e308, -1e308], torch.float64)
    assert same_values(big, big.clone())
    off = big.clone()
    off[2] = -9e307
    assert not same_values(off, big)


def test_same_values_of_empty_and_integer_tensors():
    assert same_values(torch.empty(0), torch.empty(0))
    assert not same_values(torch.empty(0), torch.empty(1))
    assert same_values(torch.arange(3), torch.arange(3)) and not same_values(torch.arange(3), torch.arange(1, 4))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_device_screen_flags_nan_and_inf_but_not_an_overflowing_sum(dtype, device):
    """The steady-state screen on a GPU is read back after its call returned, with no exact
    re-check behind it, so its flag must be exact: a NaN or an infinity anywhere, and nothing for
    finite outputs whose magnitudes sum beyond fp32's range (a ``finfo.min`` mask in bf16, as
    BLOOM and T5 return for their backward, made every such screen a false NaN/Inf report)."""
    from enn_backend.guard.screen import nonfinite_flag

    low = torch.finfo(dtype).min
    mask = torch.full((4, 64), low, dtype=dtype, device=device)
    mask[:, :8] = 0
    others = [torch.randn(3, 5).to(dtype=dtype, device=device), mask.clone()]

    def flag(*outs):
        return bool(nonfinite_flag(list(outs), list(range(len(outs)))))

    assert not flag(mask, *others)  # L1 beyond fp32's range, every value finite
    big = torch.finfo(dtype).max
    assert not flag(torch.tensor([big, -big] * 32, dtype=dtype, device=device))  # a signed sum: inf - inf
    large = torch.randn(4096, 1024, dtype=dtype, device=device)  # many blocks of a reduction
    for at in (0, large.numel() // 2, large.numel() - 1):
        one = large.clone()
        one.view(-1)[at] = float("nan")
        assert flag(others[0], one), at  # a single NaN anywhere
    assert not flag(others[0])
    for bad in (float("nan"), float("inf"), -float("inf")):
        broken = mask.clone()
        broken[2, 3] = bad
        assert flag(mask, broken, *others), bad
        assert flag(broken), bad
    nan_and_inf = others[0].clone()
    nan_and_inf[0, 0], nan_and_inf[1, 1] = float("nan"), float("inf")
    assert flag(nan_and_inf, mask)


def test_the_guard_uses_its_graph_through_two_typed_seams():
    """GraphCompiler is a full GuardedCompiler; the stand-in of a cache-loaded graph provides the
    facts the fast path reads, and its full() the rest (enn_backend.guard.seams)."""
    import gc
    from types import SimpleNamespace

    from enn_backend.aot_cache import CachedGraph
    from enn_backend.guard.seams import GraphFacts, GuardedCompiler
    from enn_backend.options import Options

    model, x = make("mlp")
    with torch.no_grad():
        torch.compile(model, backend="enn", options=ISOLATED)(x)
    (record,) = enn_backend.report().graphs
    guard = next(o for o in gc.get_objects() if type(o) is GuardedGraph and o.record is record)
    assert isinstance(guard.compiler, GraphFacts)  # a stand-in, if an earlier test cached the same graph
    assert isinstance(guard.compiler.full(), GuardedCompiler)
    meta = {"phase": "forward", "graph_key": "k", "mutated": [], "random": False}
    stand_in = CachedGraph(SimpleNamespace(opts=Options()), meta, guard.record)
    assert isinstance(stand_in, GraphFacts) and not isinstance(stand_in, GuardedCompiler)
