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


def _start(tmp_path, name: str, **env_extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENN_", "TORCH_LOGS", "TORCH_TRACE"))}
    env["ENN_CACHE_DIR"] = str(tmp_path / name / "cache")
    env.update(env_extra)
    (tmp_path / name).mkdir()
    return subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=tmp_path / name, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_torch_logs_on_and_off(tmp_path):
    """Two fresh processes side by side: TORCH_LOGS="enn_backend" (+ TORCH_TRACE), and nothing."""
    trace_dir = tmp_path / "trace"
    on = _start(tmp_path, "on", TORCH_LOGS="enn_backend", TORCH_TRACE=str(trace_dir))
    off = _start(tmp_path, "off")
    on_out, on_err = on.communicate(timeout=300)
    off_out, off_err = off.communicate(timeout=300)

    # On: exactly one line for the one (inference) graph, with every field.
    assert on.returncode == 0, on_err[-3000:]
    graph_lines = [ln for ln in on_err.splitlines() if "enn graph " in ln]
    assert len(graph_lines) == 1, on_err[-3000:]
    line = graph_lines[0]
    for field in ("g0/inference", "path=inductor", "ops=", "fusions=", "kernels=", "fallbacks=none",
                  "pinned=0", "compile="):
        assert field in line, (field, line)
    # ... and the graph's record as a TORCH_TRACE artifact for tlparse.
    logs = "".join(open(p).read() for p in glob.glob(str(trace_dir / "*")))
    assert '"name": "enn_graph_report"' in logs and "g0/inference" in logs

    # Off: enn prints nothing at all.
    assert off.returncode == 0, off_err[-3000:]
    assert off_out.strip() == "done (3, 2)"
    enn = [ln for ln in off_err.splitlines() if "enn" in ln]
    assert not enn, enn


def test_torch_logs_rejects_a_name_that_is_not_a_module():
    # torch resolves a TORCH_LOGS name as an importable module (enn_backend parses: the
    # test above imports torch with it); anything else makes `import torch` raise.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENN_", "TORCH_LOGS"))}
    bad = subprocess.run([sys.executable, "-c", "import torch"], env={**env, "TORCH_LOGS": "+enn"},
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "Invalid log settings" in bad.stderr


def test_graph_line_fields():
    from enn_backend.debug.log import graph_line
    from enn_backend.report import GraphRecord

    rec = GraphRecord(id="g3/forward", unit="g3", phase="forward", compute_nodes=10, compiled_nodes=9,
                      compile_time_s=1.25, fusions={"attention": 1, "epilogue": 2},
                      kernel_choices=[{"node": "view_3", "choice": "flash", "reason": "fast",
                                       "site": {"node": "view_3", "module": "h.0.attn"}},
                                      {"node": "view_9", "choice": "flash", "reason": "fast",
                                       "site": {"node": "view_9", "module": "h.1.attn"}},
                                      {"node": "bmm", "choice": "math", "reason": "fp32"}],
                      pinned=["mm_1", "mm_2"], events=[{"kind": "pinned_from_state", "node": "mm_1,mm_2"}],
                      sites={"mm_1": {"node": "mm_1", "op": "aten.mm.default", "module": "h.0.mlp.fc", "file": "/m/model.py",
                                      "line": 12, "function": "forward"}})
    line = graph_line(rec)
    assert line == ("enn graph g3/forward: path=inductor ops=10 compiled=9 fusions=attention=1,epilogue=2 "
                    "kernels=flash:2 [h.0.attn, h.1.attn],math:1 [bmm] fp32=0 fallbacks=pinned_from_state pinned=2 "
                    "compile=1.25s; "
                    "pinned: h.0.mlp.fc (model.py:12, in forward) [mm_1]; mm_2")
