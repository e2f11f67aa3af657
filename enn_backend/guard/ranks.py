"""One guard for all ranks of a torch.distributed run: the same pins, the same path, no hang.

Rules (every rank runs the same program: SPMD):

- **Its own channel.** The guard talks over a gloo process group of its own (CPU tensors),
  made at its first exchange, never over the model's group: its exchanges do not interleave
  with DDP's or FSDP's collectives (NCCL included), and a rank that dies closes its sockets,
  so its peers' exchange fails at once instead of waiting (otherwise: torch's default group
  timeout bounds it). Every exchange opens with an all-gather of (kind of exchange, value):
  ranks at different kinds of exchange (one compiles a graph another does not: Dynamo's cache
  or options that differ per rank) raise the same RanksError rather than pair unlike collectives.
- **Compile.** Each guarded graph is agreed on in two exchanges (:func:`compile_agreed`):
  before its build, every rank sends the graph's code hash and its pins, and every rank
  compiles with the union of the pins of the ranks with that code (their kernel state may
  differ); after its build, whether it raised (and what). A compile that raised on any rank
  raises the same :class:`RanksError` on every rank (in whichever of the two exchanges the
  others are at), and so does any RanksError in a compile. A unit that falls back to plain
  Inductor on one rank does so on every rank. A rank whose error came out of an exchange does
  not exchange again for it. AOTAutograd cache hits are refused (enn_backend.aot_cache): a hit
  is one rank's (its disk, its options) and would skip the exchanges the others make.
- **Run time: agreed calls.** Every call the guard can re-run (it holds the inputs: each
  checked call, every call in ``exceptions`` mode) is agreed on by one all-gather of two ints
  per rank (:func:`gather_levels`: the header and ok / NaN-Inf / raised). The check schedule
  depends only on call counts, which are the same on every rank, and it changes only on a
  decision every rank shares, so every rank meets the same agreed calls. The steady state adds one tiny
  collective per checked call (every ``guard_every``-th call after the warm-up), none on the
  others. Value checks are off under torch.distributed.
- **One rank localizes.** On an agreed call where some rank faulted, the lowest such rank
  (the leader) runs the fallback ladder alone (its trial recompiles issue no collective), then
  broadcasts its decision (:func:`share`): the graph's code hash and its pins by node name,
  fp32, eager, or the error it raised. Every other rank applies it: one rebuild with the same
  pins (none when they already match), no localization, no repro. A rank that faulted too
  answers this call with its eager reference (or its own result, if the infinities the leader
  learned to be the model's own explain it); a rank that did not keeps its own result. An error
  the leader raises is raised on every rank.
- **Calls the guard cannot re-run** (unchecked: the compiled code freed the inputs) are not
  agreed on: a kernel exception there is raised on that rank alone, as in one process, and
  the check schedule stays as it is (a change on one rank would desynchronize the exchanges).
"""

from __future__ import annotations

import collections
import json
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from .. import compat
from ..report import FallbackKind, report
from .calls import LADDER, EnnGuardError, distributed
from .kernel_entry import graph_key
from .ladder import Decision
from .screen import nonfinite_outputs

if TYPE_CHECKING:
    from .runtime import GuardedGraph


class RanksError(EnnGuardError):
    """Raised on every rank for a failure one rank met (compile error, leader's error)."""


_group: dict[int, Any] = {}  # id(default group) -> the guard's gloo group
_group_lock = threading.Lock()
# The last exchanges' work handles and tensors, referenced from Python a while longer. Gloo's
# worker thread drops its own reference to a collective's work after the call has returned,
# while it holds its queue's lock; were that the last reference, freeing the work's Python
# object would need the GIL, which this thread holds while it waits for that lock at its next
# collective: a deadlock (met under load, torch 2.13). Held here, the worker's is never the last.
_held: collections.deque = collections.deque(maxlen=16)


def _run(collective: Callable[..., Any], *args: Any) -> None:
    """``collective(*args)`` on the guard's group, waited for, its handle and tensors held (see _held)."""
    work = collective(*args, group=group(), async_op=True)
    _held.append((work, args))
    work.wait()


def rank() -> int:
    return torch.distributed.get_rank()


def group() -> Any:
    """The guard's own gloo group (made by every rank at the same exchange: its first)."""
    dist = torch.distributed
    key = id(dist.group.WORLD)
    with _group_lock:
        if key not in _group:
            _group[key] = dist.new_group(backend="gloo")
        return _group[key]


_COMPILE, _CALL, _DECISION = 1, 2, 3  # what an exchange is for: the first int of its header
_NAMES = {_COMPILE: "compiles a graph", _CALL: "runs an agreed call", _DECISION: "shares a decision"}


def _header(tag: int, value: int) -> list[int]:
    """Every rank's ``value``, after checking that every rank is at the same kind of exchange:
    every exchange starts with this all-gather of (tag, value), so ranks that diverged (one
    compiles a graph that another does not: Dynamo's cache, options that differ per rank) raise
    the same RanksError instead of pairing unlike collectives."""
    dist = torch.distributed
    got = [torch.zeros(2, dtype=torch.int64) for _ in range(dist.get_world_size())]
    _run(dist.all_gather, got, torch.tensor([tag, value], dtype=torch.int64))
    tags = [int(t[0]) for t in got]
    if any(t != tag for t in tags):
        raise _mark(RanksError(
            "enn: the ranks' guards went out of step: " + "; ".join(f"rank {r} {_NAMES.get(t, t)}" for r, t in
                                                                     enumerate(tags)) +
            ". Every rank must compile the same graphs in the same order (the same enn options on every rank, "
            "except fault_inject, and the same Dynamo recompilations)"))
    return [int(t[1]) for t in got]


def gather_levels(level: int) -> list[int]:
    """Every rank's ``level`` (0 ok, 1 NaN/Inf, 2 raised), in rank order: one all-gather of 2 ints."""
    return _header(_CALL, level)


def _gather_json(obj: Any) -> list[Any]:
    with compat.real_tensor_mode():  # (compiles run under a fake-tensor mode)
        dist = torch.distributed
        data = _encode(obj)
        sizes = _header(_COMPILE, data.numel())
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[:data.numel()] = data
        got = [torch.zeros(max(sizes), dtype=torch.uint8) for _ in sizes]
        _run(dist.all_gather, got, padded)
        return [json.loads(bytes(t[:n].tolist())) for t, n in zip(got, sizes)]


def _encode(obj: Any) -> torch.Tensor:
    return torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)  # (owns its memory)


def share(leader: int, obj: Any = None) -> Any:
    """``obj`` of rank ``leader`` on every rank (JSON: a header with its size, one broadcast)."""
    data = _encode(obj) if rank() == leader else None
    size = _header(_DECISION, data.numel() if data is not None else 0)[leader]
    buf = data if data is not None else torch.zeros(size, dtype=torch.uint8)
    _run(torch.distributed.broadcast, buf, leader)
    return json.loads(bytes(buf.tolist()))


# ------------------------------------------------------------------ compile time
_agreed = threading.local()  # .errors: exceptions that came out of an exchange (not exchanged again)


def agreed(exc: BaseException | None) -> bool:
    """Did ``exc`` (or an exception it wraps) come out of an exchange (every rank knows of it already)?"""
    seen = getattr(_agreed, "errors", ())
    while exc is not None:
        if any(exc is e for e in seen):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _mark(exc: BaseException) -> BaseException:
    _agreed.errors = [*getattr(_agreed, "errors", ())[-7:], exc]
    return exc


def agree_compile(what: str, exc: BaseException | None = None, key: str = "", pins: frozenset[str] = frozenset(),
                  fp32: bool = False, plain: bool = False) -> tuple[frozenset[str], bool]:
    """The compile-time exchange for ``what`` (a graph or unit): raises the same RanksError on
    every rank if a compile raised on any, ``FellBack`` on every rank if one compiles the unit
    with plain Inductor; else the union of the pins (and fp32) of the ranks with this code."""
    error = None
    if exc is not None:
        first = str(exc).strip().splitlines()
        error = f"{type(exc).__name__}: {first[0] if first else ''}"[:500]
    mine = {"what": what, "error": error, "key": key, "pins": sorted(pins), "fp32": fp32, "plain": plain}
    every = _gather_json(mine)
    failed = [(r, e) for r, e in enumerate(every) if e["error"] is not None]
    if failed:
        r, e = failed[0]
        err = RanksError(f"enn: compiling {e['what']} raised on rank(s) {[r for r, _ in failed]} of "
                         f"{len(every)}, so every rank stops here (rank {r}: {e['error']})")
        raise _mark(err) from exc
    if any(e["plain"] for e in every) and not plain:
        raise _mark(FellBack(f"enn: {what}: another rank compiles this unit with plain Inductor, so this one does"))
    same = [e for e in every if e["key"] == key]
    return frozenset(n for e in same for n in e["pins"]), any(e["fp32"] for e in same)


def compile_agreed(make: Callable[[], Any], what: str) -> tuple[Any, Any]:
    """``make()`` (a GraphCompiler) and its build, agreed on by every rank in two exchanges:
    before the build, the pins (the union of what every rank's kernel state gives this code);
    after it, whether it raised (a build that raised on any rank raises on all)."""
    if not distributed():
        compiler = make()
        return compiler, compiler.build()
    try:
        compiler = make()
        key = graph_key(compiler.eager_gm)
        pins, fp32 = agree_compile(compiler.record.id, key=key, pins=compiler.pinned_names, fp32=bool(compiler.fp32))
        extra = pins - compiler.pinned_names
        if extra or fp32 != bool(compiler.fp32):
            compiler.pinned_names, compiler.fp32 = compiler.pinned_names | extra, fp32
            report().add_fallback(FallbackKind.PINNED_FROM_STATE, node=",".join(sorted(extra)) or "<graph>",
                                  phase=compiler.phase, graph=compiler.record,
                                  reason="another rank's kernel state records faults for these kernels",
                                  action=f"compiled with the pins of every rank ({len(compiler.pinned_names)} op(s))"
                                         f"{', fp32 compute' if fp32 else ''}, so that every rank runs the same graph")
        compiled = compiler.build()
    except Exception as exc:  # noqa: BLE001 - every rank hears of it, then it is raised
        if compat.is_dynamo_control_flow(exc) or agreed(exc):
            raise
        agree_compile(what, exc)  # in place of the exchange the others are at: every rank raises there
        raise
    agree_compile(compiler.record.id)
    return compiler, compiled


def unit_failed(unit: str, exc: BaseException) -> None:
    """A unit's compile raised out of enn (guard=strict): every rank raises the same RanksError."""
    if distributed() and not agreed(exc):
        agree_compile(unit, exc)


def unit_fell_back(unit: str, exc: BaseException) -> None:
    """A unit falls back to plain Inductor here: every other rank does too (at its next exchange)."""
    if distributed() and not agreed(exc):
        agree_compile(unit, plain=True)


class FellBack(Exception):
    """Another rank compiles this unit with plain Inductor: this rank does too."""


# ------------------------------------------------------------------ run time
def across_ranks(graph: "GuardedGraph", levels: list[int], call: Any, exc: BaseException | None, bad: list,
                 out: Any) -> Any:
    """An agreed call of ``graph`` where some rank faulted: the leader (the lowest such rank)
    runs its ladder and sends the decision it returned; every other rank applies it."""
    leader = next(r for r, level in enumerate(levels) if level)
    me = rank()
    with LADDER:
        if me != leader:
            return _follow(graph, share(leader), leader, call, out, exc if levels[me] else None)
        try:
            outcome = graph.ladder.on_fault("exception" if exc is not None else "nonfinite", call, exc=exc, bad=bad,
                                            out=out)
            result = graph.settle(outcome, call)
        except Exception as e:  # noqa: BLE001 - every rank raises what the leader raised
            msg = (f"enn: graph {graph.record.id} on rank {leader} of {len(levels)}: {type(e).__name__}: "
                   f"{e}"[:4000] + " (raised on every rank)")
            share(leader, {"error": msg})
            raise RanksError(msg) from e
        share(leader, _sent(graph, outcome.decision))
        return result


def _sent(graph: "GuardedGraph", d: Decision | None) -> dict[str, Any]:
    """What the leader sends: the decision its ladder returned (None: the graph did not change),
    as data, with the graph's code hash, its whole pin set (by node name, the same on every rank
    that compiled the same code), and the infinities it learned to be the model's own."""
    c = graph.compiler
    return {"error": None, "key": graph_key(c.eager_gm), "allowed": graph.allowed,
            "pinned": sorted(c.pinned_names), "fp32": bool(c.fp32),
            "decision": None if d is None else {"kind": d.kind.value, "nodes": d.nodes, "fp32": d.fp32,
                                                "eager": d.eager, "reason": d.reason}}


def _follow(graph: "GuardedGraph", d: dict[str, Any], leader: int, call: Any, out: Any,
            exc: BaseException | None) -> Any:
    """Apply the leader's decision ``d`` through ``graph.apply``: at most one rebuild, no
    localization, no repro. ``out`` / ``exc``: this rank's result (``exc`` None on a rank that
    did not fault)."""
    if d["error"] is not None:
        raise RanksError(d["error"])
    c, ladder = graph.compiler, graph.ladder
    same_code = d["key"] == graph_key(c.eager_gm)
    if same_code:  # the infinities the leader found to be the model's own
        graph.allowed.update({int(i): v for i, v in d["allowed"].items()})
    sent = d["decision"]
    if sent is not None:
        t0 = time.perf_counter()
        pins, fp32 = frozenset(), False
        if not same_code:
            new, eager = c.eager_callable(), True
            action = (f"this graph runs eagerly: its code differs from rank {leader}'s, so rank {leader}'s pins "
                      "cannot be named here")
        elif sent["eager"]:
            new, eager = c.eager_callable(), True
            action = f"this graph runs eagerly, as on rank {leader} (no localization here)"
        else:
            pins, fp32, eager = frozenset(d["pinned"]) - c.pinned_names, d["fp32"], False
            new = c.build(extra_pins=pins, fp32=fp32) if pins or fp32 != c.fp32 else graph.compiled
            rebuilt = "1 recompile" if new is not graph.compiled else "no recompile (the pins were already here)"
            action = (f"adopted rank {leader}'s decision: {len(c.pinned_names | pins)} op(s) pinned"
                      f"{', fp32 compute' if fp32 else ''}; {rebuilt} in {time.perf_counter() - t0:.1f}s, "
                      "no localization on this rank")
        graph.apply(Decision(FallbackKind(sent["kind"]), sent["nodes"], pins, fp32=fp32, eager=eager,
                             reason=f"rank {leader}: {sent['reason']}", action=action), new)
    if exc is None and not nonfinite_outputs(ladder.results(out, call), graph.allowed):
        return out  # this rank's own result is right
    # this rank faulted too: its answer is its eager reference
    ref = ladder.reference(call)
    if ref.exc is not None:
        raise ref.exc
    return ladder.returning(ref, call)
