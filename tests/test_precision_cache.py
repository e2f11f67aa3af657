"""enn's decomposition table keeps Inductor's FX graph cache working across processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_CACHE_SCRIPT = textwrap.dedent("""
    import torch
    from torch._dynamo.utils import counters
    def f(x):
        return torch.logsumexp(x, -1) + x.sum(-1) * 1e-3
    x = torch.ones(2, 4096, dtype=torch.float16)
    torch.compile(f, backend="enn")(x)
    from enn_backend.decompositions import source_hash
    print("HITS", counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_bypass"], source_hash())
""")


def test_fx_graph_cache_hit_in_second_process(tmp_path):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "ind"), ENN_CACHE_DIR=str(tmp_path / "enn"),
               TORCHINDUCTOR_FX_GRAPH_CACHE="1")
    outs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        hits, bypass, src = r.stdout.split("HITS")[1].split()
        outs.append((int(hits), int(bypass), src))
    if outs[0][2] != outs[1][2]:
        pytest.skip("enn's sources changed between the two processes (files edited meanwhile)")
    assert outs[0][1] == 0 and outs[1][1] == 0  # never bypassed (the table pickles)
    assert outs[1][0] >= 1  # the second process hits
