"""Shared test set-up: every test gets its own enn state (kernel state, repros), Inductor's
caches live per session, the report starts empty.

``--enn-reverse`` runs the collected tests in reverse order: the suite must pass in any order
(serially, reversed, and spread over xdist workers), which only holds while no test can see
state another test left behind.
"""

from __future__ import annotations

import os

# One intra-op thread per process. The suite runs as `pytest -n 2` on 2-core machines: with
# torch's default (a thread per core) each worker, and each subprocess a test starts, runs an
# OpenMP team as wide as the machine, and on these tiny tensors the threads spend their time
# waiting for cores the other worker holds (a small eager training step measured 40x slower
# than on one thread). Set before torch is imported, so that subprocesses inherit it too; a
# value the caller set is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor's CPU vector-ISA probe off: left on, every process that compiles C++ (each xdist worker
# and each of the many subprocesses the tests start) builds a test library per candidate ISA and
# dlopens each in a new Python process -- ~10 s of CPU with a fresh Inductor cache folder, ~3 s
# with a warm one, per process. With it off Inductor takes the best ISA /proc/cpuinfo lists, as
# the probe does wherever the compiler builds it (as it does on these machines); a compiler
# that could not would fail the tests' compiles loudly. Nothing in enn reads the probe's result.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ["OMP_NUM_THREADS"].isdigit():  # (torch may have been imported before this file)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import enn_backend


def pytest_addoption(parser):
    parser.addoption("--enn-reverse", action="store_true", default=False,
                     help="run the collected tests in reverse order (checks that no test depends on another)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--enn-reverse"):
        items.reverse()


@pytest.fixture(autouse=True, scope="session")
def _session_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("session")
    old = {k: os.environ.get(k) for k in ("ENN_CACHE_DIR", "ENN_REPRO_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    # Inductor's caches (FX graph, AOTAutograd, compiled kernels) start empty in each test
    # session: a test that checks what a compile does must not meet an earlier run's cache entry
    # for its graph (tests/test_aot_cache.py tests warm starts on purpose). The xdist workers of
    # one run share them, as the tests of one worker do: a kernel one worker built is not built
    # again by the other (Inductor's caches take concurrent processes).
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    shared = tmp_path_factory.getbasetemp().parent if worker else root  # (this run's folder, above popen-gwN)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(shared / "inductor")
    # enn's folders for fixtures wider than one test (each test gets its own: _enn_state);
    # nothing a test session does reaches the user's ~/.cache/enn
    os.environ["ENN_CACHE_DIR"] = str(root / "enn-cache")
    os.environ["ENN_REPRO_DIR"] = str(root / "enn-repros")
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def _enn_state(tmp_path, monkeypatch):
    """enn's kernel state and repro scripts go to folders of this test alone: a fault one test
    records (a pinned kernel) must not change what a later test compiles."""
    monkeypatch.setenv("ENN_CACHE_DIR", str(tmp_path / "_enn" / "cache"))
    monkeypatch.setenv("ENN_REPRO_DIR", str(tmp_path / "_enn" / "repros"))


@pytest.fixture(autouse=True)
def _fresh_report(_enn_state):
    torch._dynamo.reset()
    enn_backend.reset()
    from enn_backend.guard.kernel_state import forget_loaded_states

    forget_loaded_states()
    yield
