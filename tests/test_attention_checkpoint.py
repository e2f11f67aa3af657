"""Attention inside an activation-checkpointed region (``torch.utils.checkpoint``, non-reentrant,
as transformers' ``gradient_checkpointing_enable()`` runs it): fused, values and gradients equal
eager's, and the fused kernel's forward nodes carry the region's checkpoint tags, so the
partitioner recomputes the kernel in the backward as it would the ops it replaces (emitter.py).
A site with dropout keeps no tag: its kernel draws random numbers. CPU, tiny shapes, pass harness.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from attention_cases import CPU_FLASH, causal_tril, enn, fused, qkv, the
from test_attention_dropout import attend_dropout
from pass_harness import run_passes


@pytest.fixture(autouse=True)
def _fuse_tiny(monkeypatch):
    """Tiny CPU attention is left to Inductor by default; this order makes enn fuse it."""
    monkeypatch.setenv("ENN_ATTENTION_ORDER", "flash,explicit")


def checkpointed(fn):
    def layer(q, k, v):
        return checkpoint(lambda a, b, c: fn(a.sin(), b, c), q, k, v, use_reentrant=False)
    return layer


def test_checkpointed_attention_is_fused_and_recomputed():
    run = fused(checkpointed(causal_tril), qkv())
    kernel = the(run.after, CPU_FLASH)
    assert kernel.meta.get("recompute") in (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE), \
        kernel.meta
    assert all("recompute" in u.meta for u in kernel.users), [u.meta for u in kernel.users]


def test_checkpointed_attention_with_dropout_is_saved_not_recomputed():
    run = run_passes(checkpointed(attend_dropout), qkv(), ["attention"], options={"attention_backend": "explicit"})
    assert run.matches == {"attention": 1}, run.matches
    assert "recompute" not in the(run.after, enn.attention).meta
