"""enn's logs in fresh processes: TORCH_LOGS switches them on, nothing is printed otherwise."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import torch
m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
with torch.no_grad():
    out = torch.compile(m, backend="enn")(torch.randn(3, 4))
print("done", tuple(out.shape))
"""


def _run(tmp_path, **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENN_", "TORCH_LOGS", "TORCH_TRACE"))}
    env["ENN_CACHE_DIR"] = str(tmp_path / "cache")
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)



@pytest.mark.slow
def test_torch_logs_prints_one_line_per_graph_and_trace_artifact(tmp_path):
    trace_dir = tmp_path / "trace"
    res = _run(tmp_path, TORCH_LOGS="enn_backend", TORCH_TRACE=str(trace_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    graph_lines = [ln for ln in res.stderr.splitlines() if "enn graph " in ln]
    # an inference compile: exactly one graph, so exactly one line
    assert len(graph_lines) == 1, res.stderr[-3000:]
    line = graph_lines[0]
    for field in ("g0/inference", "path=inductor", "nodes=", "fusions=", "kernels=", "fallbacks=none",
                  "pinned=none", "compile="):
        assert field in line, (field, line)
    logs = "".join(open(p).read() for p in glob.glob(str(trace_dir / "*")))
    assert '"name": "enn_graph_report"' in logs
    assert '"unit": "g0"' in logs or "g0/inference" in logs


@pytest.mark.slow
def test_without_torch_logs_enn_prints_nothing(tmp_path):
    res = _run(tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "done (3, 2)"
    enn = [ln for ln in res.stderr.splitlines() if "enn" in ln]
    assert not enn, enn


def test_torch_logs_name_parses_in_a_fresh_process(tmp_path):
    # An unregistered TORCH_LOGS name makes `import torch` raise: enn's documented
    # spelling must parse (torch resolves it as an importable module), '+enn' must not.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENN_", "TORCH_LOGS"))}
    ok = subprocess.run([sys.executable, "-c", "import torch"], env={**env, "TORCH_LOGS": "+enn_backend"},
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-c", "import torch"], env={**env, "TORCH_LOGS": "+enn"},
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "Invalid log settings" in bad.stderr


def test_graph_line_fields():
    from enn_backend.debug.log import graph_line
    from enn_backend.report import GraphRecord

    rec = GraphRecord(id="g3/forward", unit="g3", phase="forward", compute_nodes=10, compiled_nodes=9,
                      compile_time_s=1.25, fusions={"attention": 1, "epilogue": 2},
                      kernel_choices=[{"node": "attn", "choice": "flash", "reason": "fast"}],
                      pinned=["mm_1"], events=[{"kind": "pinned_from_state", "node": "mm_1"}])
    line = graph_line(rec)
    assert line == ("enn graph g3/forward: path=inductor nodes=10 compiled=9 fusions=attention=1,epilogue=2 "
                    "kernels=attn:flash fp32=0 fallbacks=pinned_from_state@mm_1 pinned=mm_1 compile=1.25s")
