"""Shared test set-up: enn's and Inductor's state go to temporary folders, the report starts empty."""

from __future__ import annotations

import os

import pytest
import torch

import enn_backend


@pytest.fixture(autouse=True, scope="session")
def _enn_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("enn")
    old = {k: os.environ.get(k) for k in ("ENN_CACHE_DIR", "ENN_REPRO_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    os.environ["ENN_CACHE_DIR"] = str(root / "cache")
    os.environ["ENN_REPRO_DIR"] = str(root / "repros")
    # Inductor's caches (FX graph, AOTAutograd) start empty in each test session: a test that
    # checks what a compile does must not meet an earlier run's cache entry for its graph
    # (tests/test_aot_cache.py tests warm starts on purpose)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def _fresh_report():
    torch._dynamo.reset()
    enn_backend.reset()
    from enn_backend.guard.kernel_state import forget_loaded_states

    forget_loaded_states()
    yield


