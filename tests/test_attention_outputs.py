"""Attention whose inputs are also graph outputs: a model that returns its K/V cache
(``use_cache=True``) is fused, for every pattern family; one that returns what the fused kernel
keeps internal -- the scores, the probabilities -- or another form of K is not, and the report
says why, in the model's terms. CPU, tiny shapes, pass harness (training: forward and backward).

The cache is a copy of K/V in their own shape, which the attention reads and the model returns.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import enn_backend
from attention_cases import (B, H, T, D, alibi_causal, bool_padding_neg_inf, causal_tril, finfo_min_padding, fused,
                             gqa_repeat_interleave, learned_bias, padding_bias, qkv, sliding_window, t5_bias,
                             three_d_bias, untouched)
from test_attention_dropout import attend_dropout


@pytest.fixture(autouse=True)
def _fuse_tiny(monkeypatch):
    """Tiny CPU attention is left to Inductor by default; this order makes enn fuse it."""
    monkeypatch.setenv("ENN_ATTENTION_ORDER", "flash,explicit")


def _heads(t):
    """``t`` computed in the graph, laid out as heads split off a projection are: a transposed view
    of [B, T, H, D] memory."""
    return t.sin().transpose(1, 2).contiguous().transpose(1, 2)


def returns_cache(fn):
    """``fn`` reading K / V from a cache -- a contiguous copy of the heads, as a cache stores them --
    and returning the cache; Q, copied the same way, is returned too (a returned state)."""
    def attend(q, k, v, *rest):
        q, k, v = (_heads(t).contiguous() for t in (q, k, v))
        return fn(q, k, v, *rest), q, k, v
    return attend


def _pad():
    pad = torch.ones(B, T)
    pad[1, 5:] = 0.0
    return pad


def _keep():
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, 5:] = False
    return keep


def _three_d():
    """[B, T, D] without a head axis; shapes that tell the gradients apart (see test_attention_passes)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, t, d, generator=g, requires_grad=True) for t, d in ((T, 4), (2 * T, 4), (2 * T, 6)))
    return q, k, v, (0.5 * torch.randn(1, T, 2 * T, generator=g)).requires_grad_(True), torch.zeros(B, 1, 2 * T)


# every pattern family the matcher knows, with its inputs and the options it is fused with
FAMILIES = {
    "causal_tril": (causal_tril, lambda: qkv(), {}),
    "sliding_window": (sliding_window, lambda: qkv(), {}),
    "padding_bias": (padding_bias, lambda: (*qkv(), _pad()), {}),
    "finfo_min_padding": (finfo_min_padding, lambda: (*qkv(), _pad()), {}),
    "learned_bias": (learned_bias, lambda: (*qkv(), (0.1 * torch.randn(1, H, T, T)).requires_grad_()), {}),
    "t5_bias": (t5_bias, lambda: (*qkv(), (0.5 * torch.randn(1, H, T, T)).requires_grad_(),
                                  torch.zeros(B, 1, 1, T)), {}),
    "bool_padding": (bool_padding_neg_inf, lambda: (*qkv(), _keep()), {}),
    "gqa": (gqa_repeat_interleave, lambda: qkv(hkv=2), {}),
    "alibi": (alibi_causal, lambda: (*qkv(), torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)])), {}),
    "three_d_bias": (three_d_bias, _three_d, {}),
    "dropout": (attend_dropout, lambda: qkv(), {"attention_backend": "explicit"}),
}


def _skipped() -> list[str]:
    return [f["reason"] for f in enn_backend.report().to_dict()["fallbacks"] if f["kind"] == "pass_skipped"]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_returned_kv_cache_is_fused(name):
    """The kernel reads the cache's K/V itself; values and gradients (the cache's own gradient
    added to the attention's) equal eager's, and nothing is reported as skipped."""
    fn, args, options = FAMILIES[name]
    if name == "dropout":  # a random draw: the values differ from eager's in distribution only
        from pass_harness import run_passes
        run = run_passes(returns_cache(fn), args(), ["attention"], options=options)
        assert run.matches == {"attention": 1}, run.matches
    else:
        fused(returns_cache(fn), args(), options=options)
    assert not _skipped(), _skipped()


def returns_probabilities(q, k, v):
    p = (q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))).softmax(-1)
    return p @ v, p


def returns_scores(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    return F.softmax(s, dim=-1) @ v, s


def returns_transposed_key(q, k, v):
    kt = k.sin().transpose(-1, -2)
    return (q @ kt).softmax(-1) @ v, kt


@pytest.mark.parametrize("fn,what", [(returns_probabilities, "the attention probabilities"),
                                     (returns_scores, "the attention scores"),
                                     (returns_transposed_key, "a permute of K")])
def test_returned_internal_value_is_not_fused(fn, what):
    """What the kernel keeps internal (scores, probabilities) or computes from K its own way (Kᵀ)
    must stay with the graph: not fused, the reason naming the value, the model's line and that
    it is returned."""
    untouched(fn, qkv(), train=True)
    (reason,) = _skipped()
    assert what in reason and "a graph output" in reason and f"in {fn.__name__})" in reason, reason
    if fn is returns_probabilities:
        assert "output_attentions=True" in reason, reason
    if fn is returns_transposed_key:
        assert "use_cache=True" in reason, reason


def test_probabilities_read_elsewhere_name_their_reader():
    """The probabilities summed beside the attention: the reason names the reader and its line."""
    def reads_probabilities(q, k, v):
        p = (q @ k.transpose(-1, -2) * 0.3).softmax(-1)
        return p @ v, p.sum()

    untouched(reads_probabilities, qkv(grad=False))
    (reason,) = _skipped()
    assert "the attention probabilities" in reason and "also read by sum" in reason, reason
