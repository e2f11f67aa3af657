"""Inductor's own silent miscompiles: enn keeps Inductor's attention rewrites off its compiles
(compat.inductor_attention_rewrites_off), and the upstream corpus in minifier_repros/ is
consistent. CPU, tiny shapes."""

from __future__ import annotations

import threading

import pytest
import torch

from enn_backend import compat


@pytest.fixture(autouse=True)
def _compile_afresh():
    """Joint-graph passes (where the attention patterns apply) do not run on an AOTAutograd
    cache hit: each compile here must run them."""
    with compat.no_aot_autograd_cache():
        yield


def attention(q, k, v):
    return (q @ k.transpose(-2, -1) * 0.125).softmax(dim=-1) @ v


def over_heads(q, k, v):  # pytorch/pytorch#196468: not attention, Inductor rewrites it as such
    return (q @ k.transpose(-2, -1) * 0.125).softmax(dim=1) @ v


def qkv():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 4, 16, 8, generator=g) for _ in range(3)]


def inductor_attention_fusions() -> int:
    return compat.dynamo_counters["inductor"]["fuse_attention"]


def test_inductor_attention_rewrites_recognized():
    """enn finds Inductor's attention patterns among the joint-graph patterns (a torch that
    registers them differently fails here, not silently at run time)."""
    compat.dynamo_counters.clear()
    torch.compile(attention, backend="inductor")(*qkv())  # Inductor registers its patterns lazily
    assert compat.inductor_attention_rewrites() >= 27  # 2.11: 27 patterns, each in several variants
    assert inductor_attention_fusions() == 1


def test_enn_compiles_without_inductor_attention_rewrites():
    """Under enn, Inductor's patterns rewrite nothing (the softmax over heads stays eager's), and
    backend="inductor" in the same process keeps them."""
    x = qkv()
    compat.dynamo_counters.clear()
    out = torch.compile(over_heads, backend="enn")(*x)
    torch.testing.assert_close(out, over_heads(*x))
    out = torch.compile(attention, backend="enn")(*x)
    torch.testing.assert_close(out, attention(*x))
    assert inductor_attention_fusions() == 0
    assert "apply" not in compat._joint_patterns().__dict__  # the registry is as Inductor made it

    torch._dynamo.reset()
    wrong = torch.compile(over_heads, backend="inductor")(*x)
    assert inductor_attention_fusions() == 1
    assert (wrong - over_heads(*x)).abs().max() > 0.1  # the upstream bug, still there on this torch


def test_other_threads_keep_inductor_attention_rewrites():
    """The patterns are off only for the thread inside enn's compile: a plain Inductor compile in
    another thread meanwhile still fuses attention."""
    compat.dynamo_counters.clear()
    x = qkv()
    done = []
    with compat.inductor_attention_rewrites_off():
        t = threading.Thread(target=lambda: done.append(torch.compile(attention, backend="inductor")(*x)))
        t.start()
        t.join()
    assert done and inductor_attention_fusions() == 1
