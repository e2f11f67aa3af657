"""Under torch.distributed every rank takes the same fallback decision (no divergence, no hang)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

_RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, torch, torch.distributed as dist
    import enn_backend
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(4, 8)
    # only rank 0 has a broken kernel: rank 1 must follow its decisions step by step
    opts = {"attention": False, "epilogue": False, "persist": False}
    if rank == 0:
        opts["fault_inject"] = "aten.addmm:nan:fwd"
    f = torch.compile(m, backend="enn", options=opts)
    for _ in range(3):
        y = f(x)
        y.sum().backward()
    torch.testing.assert_close(y, m(x))
    rep = enn_backend.report().to_dict()
    print("RESULT " + json.dumps({"fallbacks": [(fb["kind"], fb["node"], fb["phase"]) for fb in rep["fallbacks"]],
                                  "pinned": {g["id"]: g["pinned"] for g in rep["graphs"]}}))
    dist.destroy_process_group()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_ranks_agree_on_fallback_and_pins():
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=400)
        assert p.returncode == 0, err[-3000:]
        line = next(line for line in out.splitlines() if line.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT "):]))
    r0, r1 = results
    assert r0["pinned"] == r1["pinned"] and r0["pinned"]["g0/forward"], results
    assert [(k, n) for k, n, _ in r0["fallbacks"]] == [(k, n) for k, n, _ in r1["fallbacks"]], results
