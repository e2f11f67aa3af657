"""enn's kernel state and AOT sidecars travel in torch.compiler's cache artifacts.

Three processes run the same program (an MLP with an injected NaN in its matmuls, so that
they are pinned, and a clean GPT block, which AOT Autograd caches): the cold one saves
``torch.compiler.save_cache_artifacts()``; a warm start on the same folders; and a "second
machine": fresh, empty enn and Inductor folders, ``load_cache_artifacts()`` of the saved
bytes, then the same program. The second machine must warm-start as the first machine
does: nothing compiled by Inductor, nothing localized, the same pins and the same report.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch

import enn_backend
from enn_backend import aot_sidecar
from enn_backend.bench.backends import cache_dir
from enn_backend.guard import kernel_entry
from tests import _models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROGRAM = textwrap.dedent(
    """
    import json, sys
    import torch
    from tests import _models

    load, save = sys.argv[1:3]
    faulty, x = _models.make("mlp")
    clean, y = _models.make("block", seed=1)
    # torch.compile resolves backend="enn" through its entry point: enn's artifact types are
    # registered from here on, as they must be before load_cache_artifacts()
    f = torch.compile(faulty, backend="enn", options={"fault_inject": "aten.addmm:nan:fwd"})
    c = torch.compile(clean, backend="enn")
    loaded = {}
    if load:
        with open(load, "rb") as fh:
            info = torch.compiler.load_cache_artifacts(fh.read())
        loaded = {k: len(v) for k, v in info.artifacts.items()}
    steps = [_models.train_step(faulty, x, f) for _ in range(2)] + [_models.train_step(clean, y, c)]
    import enn_backend
    from enn_backend import compat

    saved = {}
    if save:
        data, info = torch.compiler.save_cache_artifacts()
        with open(save, "wb") as fh:
            fh.write(data)
        saved = {k: len(v) for k, v in info.artifacts.items()}
    values = [[out.double().sum().item()] + [g.double().sum().item() for g in grads.values()] for out, grads in steps]
    print("RESULT " + json.dumps({"report": enn_backend.report().to_dict(), "fx": compat.fx_graph_cache_counters(),
                                  "loaded": loaded, "saved": saved, "values": values}))
    """
)


def _run(folder: str, load: str = "", save: str = "") -> dict:
    env = {**os.environ, "ENN_CACHE_DIR": os.path.join(folder, "enn"), "ENN_REPRO_DIR": os.path.join(folder, "repros"),
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, "inductor"),
           "TRITON_CACHE_DIR": os.path.join(folder, "inductor", "triton"),
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", _PROGRAM, load, save], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=500)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(line for line in p.stdout.splitlines() if line.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    result["stderr"] = p.stderr
    return result


def _comparable(report: dict, folder: str) -> dict:
    """The report without compile times and clock times, with this run's folder named alike."""
    def timeless(items: list) -> list:
        return [{k: v for k, v in item.items() if k != "time"} for item in items]

    graphs = [{**{k: v for k, v in g.items() if k not in ("compile_time_s", "compile_phases")}, "events": timeless(g["events"])}
              for g in report["graphs"]]
    report = {**report, "graphs": graphs, "fallbacks": timeless(report["fallbacks"])}
    return json.loads(json.dumps(report).replace(folder, "<folder>"))


def _pinned(report: dict) -> dict:
    return {g["id"]: g["pinned"] for g in report["graphs"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    first = str(tmp_path_factory.mktemp("first-machine"))
    second = str(tmp_path_factory.mktemp("second-machine"))
    artifacts = os.path.join(first, "artifacts.bin")
    cold = _run(first, save=artifacts)
    warm = _run(first)
    fresh = _run(second, load=artifacts)
    return {"cold": cold, "warm": warm, "fresh": fresh, "first": first, "second": second, "artifacts": artifacts}


def test_the_cold_run_saves_enn_state_and_sidecars(runs):
    cold = runs["cold"]
    assert [f["kind"] for f in cold["report"]["fallbacks"]] == ["nonfinite"], cold["report"]["fallbacks"]
    assert _pinned(cold["report"])["g0/forward"] == ["addmm", "addmm_1"]
    # the two pinned kernels' entries, and the sidecars of the clean block's forward and backward
    assert cold["saved"]["enn_kernel_state"] == 2 and cold["saved"]["enn_aot_graph"] == 2, cold["saved"]


def test_a_second_machine_warm_starts_from_the_artifacts_as_the_first_one(runs):
    cold, warm, fresh = runs["cold"], runs["warm"], runs["fresh"]
    assert fresh["loaded"] == cold["saved"]
    for run in (warm, fresh):
        assert run["fx"]["miss"] == 0, run["fx"]  # Inductor compiled nothing: every graph from its cache
        counters = run["report"]["counters"]
        assert counters.get("aot_cache.hits") == 1 and "guard.faults" not in counters, counters
        assert not any("recompiles" in g["counters"] for g in run["report"]["graphs"])  # nothing localized
        assert _pinned(run["report"]) == _pinned(cold["report"])
        assert [(f["kind"], f["node"]) for f in run["report"]["fallbacks"]] == [("pinned_from_state", "addmm,addmm_1")]
    assert "kernel_state-inject-" in fresh["stderr"] and runs["second"] in fresh["stderr"]  # pins said, from its folder
    assert _comparable(fresh["report"], runs["second"]) == _comparable(warm["report"], runs["first"])
    assert fresh["values"] == warm["values"]


def _corrupted(data: bytes) -> bytes:
    """The saved bytes with every enn artifact made invalid, as an enn that wrote them wrong would
    send them: the same lengths, and torch's seal (a big-endian CRC32 of the rest in the first 4
    bytes, torch/utils/_appending_byte_serializer.py) made anew."""
    payload = data[4:]
    for old, new in ((b'"fail_count": 1,', b'"fail_count": 0,'),
                     (b'"format": "enn-aot-graph"', b'#format": "enn-aot-graph"')):
        assert old in payload, old
        payload = payload.replace(old, new)
    return zlib.crc32(payload).to_bytes(4, "big") + payload


def test_corrupt_enn_artifacts_are_skipped_with_a_warning(runs, tmp_path, monkeypatch, caplog):
    """A bad enn artifact is logged and counted, the rest of the load goes on (torch's own
    artifacts land), and the program compiles what the bad artifact would have spared it."""
    with open(runs["artifacts"], "rb") as f:
        data = _corrupted(f.read())
    monkeypatch.setenv("ENN_CACHE_DIR", str(tmp_path / "enn"))
    inductor = str(tmp_path / "inductor")
    with cache_dir(inductor), caplog.at_level(logging.WARNING, logger="enn_backend"):
        info = torch.compiler.load_cache_artifacts(data)
        assert info is not None and info.artifacts["enn_kernel_state"] and info.artifacts["inductor"]
        warnings = [r.getMessage() for r in caplog.records if "ignoring cache artifact" in r.getMessage()]
        assert len(warnings) == 4, warnings
        assert enn_backend.report().counters["cache_artifacts.ignored"] == 4
        assert not os.path.exists(tmp_path / "enn") and not os.path.exists(os.path.join(inductor, "enn"))
        clean, y = _models.make("block", seed=1)
        got = _models.train_step(clean, y, torch.compile(clean, backend="enn"))
    rep = enn_backend.report().to_dict()
    assert rep["counters"].get("aot_cache.refused") == 1 and not rep["counters"].get("aot_cache.hits")
    _models.assert_close_step(got, _models.train_step(clean, y))


def test_artifact_keys_never_name_a_path():
    e = kernel_entry.KernelEntry(key="aten.addmm|inductor-cpu|cpu|float32|8x32", action="pinned", fail_count=1,
                                 first_time=1.0, last_time=1.0, reason="", last_exc_type="NonFinite", last_exc_msg="",
                                 torch_version=torch.__version__, enn_version=enn_backend.__version__, machine="m")
    key, content = kernel_entry.entry_artifact("kernel_state.json", e)
    assert kernel_entry.parsed_artifact(key, content, 2.0) == ("kernel_state.json", e)
    bad_key, bad = kernel_entry.entry_artifact("../kernel_state.json", e)
    with pytest.raises(ValueError, match="bad state file name"):
        kernel_entry.parsed_artifact(bad_key, bad, 2.0)
    with pytest.raises(ValueError, match="not an FX graph cache key"):
        aot_sidecar._load_artifact("../../escape", b"{}")
