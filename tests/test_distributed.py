"""enn under torch.distributed, for real: 2 processes over gloo train a small HF decoder under DDP
(Dynamo's DDP optimizer splitting the graph) and FSDP2 (``fully_shard``) with the scenarios of
bench/distributed.py: a NaN on rank 0 only ends with the same ``pinned`` sets on both ranks (rank 1
adopts rank 0's, with no localization of its own) and eager's parameters; a compile failure on
rank 0 only fails both ranks with the same error; every launch is killed past its timeout."""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")

_spec = importlib.util.spec_from_file_location(
    "bench_distributed", os.path.join(os.path.dirname(__file__), os.pardir, "bench", "distributed.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

TIMEOUT = 300  # seconds per launch; a hang is killed here and fails the test
ENN = {"localize_budget": 3}  # a short localization: this is about the ranks agreeing, not its precision


def _launch(wrapper: str, runs: tuple[str, ...]) -> list[dict]:
    t0 = time.monotonic()
    results = bench.launch(bench.train_job(wrapper, "tiny", 3, runs=runs, **ENN), world_size=2, backend="gloo",
                           device="cpu", timeout=TIMEOUT)
    assert bench.check(results, tol=1e-5) == []  # (names a rank killed at the timeout)
    assert time.monotonic() - t0 < TIMEOUT
    return results


def _adopted(results: list[dict], run: str) -> None:
    """Rank 0 localized; rank 1 took rank 0's pins: no trial recompiles, no pins of its own."""
    r0, r1 = (r["runs"][run] for r in results)
    pinned = {g: p for g, p in r0["pinned"].items() if p}
    assert pinned and pinned == {g: p for g, p in r1["pinned"].items() if p}
    assert any("trial recompile" in action for kind, _, _, action in r0["fallbacks"] if kind == "nonfinite")
    faults = [(kind, action) for kind, _, _, action in r1["fallbacks"] if kind == "nonfinite"]
    assert faults and all("adopted rank 0's decision" in a and "trial" not in a for _, a in faults), r1["fallbacks"]


def test_ddp_nan_on_one_rank_and_compile_failure_on_one_rank():
    results = _launch("ddp", ("eager", "enn nan@rank0", "enn compile-fault@rank0 strict"))
    r0, r1 = (r["runs"] for r in results)
    assert r0["enn nan@rank0"]["units"] > 1  # Dynamo's DDP optimizer split the model at DDP's buckets
    _adopted(results, "enn nan@rank0")
    err = r0["enn compile-fault@rank0 strict"]["error"]
    assert err == r1["enn compile-fault@rank0 strict"]["error"] and "raised on rank(s) [0] of 2" in err, err


def test_fsdp2_clean_and_nan_on_one_rank():
    results = _launch("fsdp2", ("eager", "enn", "enn nan@rank0"))
    for r in results:
        assert not any(r["runs"]["enn"]["pinned"].values()) and r["runs"]["enn"]["fallbacks"] == []
    _adopted(results, "enn nan@rank0")


def test_ranks_on_different_devices_name_their_graphs_alike():
    """Rank 1 runs on cuda:1 the graph rank 0 runs on cuda:0: its code names another device
    index (HF's position ids, ``arange(..., device=...)``), yet the ranks must recognise it as the
    same graph, or a follower runs eagerly instead of adopting the leader's pins (seen on 2 GPUs
    over NCCL). A graph on another kind of device stays another graph."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from enn_backend.guard.kernel_entry import graph_key

    def traced(device: torch.device):
        def f(x):
            return x.to(device) + torch.arange(4, device=device)

        gm = make_fx(f)(torch.zeros(4))
        assert "index" in gm.code or device.index is None
        return gm

    def on_cuda(index: int) -> str:  # the same graph written for cuda:index (codegen only: nothing runs)
        gm = traced(torch.device("cpu", 1))
        for node in gm.graph.nodes:
            if "device" in node.kwargs:
                node.kwargs = {**node.kwargs, "device": torch.device("cuda", index)}
        gm.recompile()
        assert f"index={index}" in gm.code
        return graph_key(gm)

    cpu0, cpu1 = graph_key(traced(torch.device("cpu", 0))), graph_key(traced(torch.device("cpu", 1)))
    assert cpu0 == cpu1
    assert on_cuda(0) == on_cuda(1) != cpu0
