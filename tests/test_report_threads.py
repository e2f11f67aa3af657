"""The report is written by many threads at once: a compile in one thread records into the
process's report while another thread re-traces a cache-loaded graph into a throwaway one
(report.detached_report), and concurrent recording loses nothing."""

from __future__ import annotations

import threading

import torch

import enn_backend
from enn_backend.report import FallbackKind, detached_report, report


def test_a_compile_in_another_thread_records_into_the_report_while_a_retrace_is_detached():
    inside, done = threading.Event(), threading.Event()
    detached_records: list[int] = []

    def retrace() -> None:
        with detached_report() as throwaway:
            inside.set()
            done.wait(timeout=120)
            throwaway.add_fallback(FallbackKind.PASS_SKIPPED, node="n", phase="compile", reason="re-trace",
                                   action="counted in the throwaway report only")
            detached_records.append(len(throwaway.fallbacks))

    t = threading.Thread(target=retrace)
    t.start()
    assert inside.wait(timeout=60)
    try:
        model = torch.nn.Linear(4, 4)
        compiled = torch.compile(model, backend="enn", options={"persist": False, "repro": False})
        with torch.no_grad():
            torch.testing.assert_close(compiled(torch.ones(2, 4)), model(torch.ones(2, 4)))
    finally:
        done.set()
        t.join()
    rep = enn_backend.report().to_dict()
    assert [g["phase"] for g in rep["graphs"]] == ["inference"], rep["graphs"]
    assert rep["fallbacks"] == [] and detached_records == [1]


def test_concurrent_recording_loses_nothing():
    threads, per_thread = 4, 200

    def record(i: int) -> None:
        for j in range(per_thread):
            report().add_fallback(FallbackKind.PASS_SKIPPED, node=f"t{i}.{j}", phase="compile", reason="r", action="a",
                                  level=5)
            report().count("test.concurrent")

    workers = [threading.Thread(target=record, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    rep = enn_backend.report().to_dict()
    assert len(rep["fallbacks"]) == threads * per_thread
    assert rep["counters"]["test.concurrent"] == threads * per_thread
