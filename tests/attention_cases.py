"""Attention written by hand the ways models write it, near misses that are not attention, and
the checks tests/test_attention*.py run on them with the pass harness. CPU, tiny shapes."""

from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn.functional as F

import enn_backend
from pass_harness import assert_ops, count_ops, find_ops, run_passes

aten = torch.ops.aten
enn = torch.ops.enn
B, H, T, D = 2, 4, 8, 8
CPU_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_FLASH_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
UNFUSED = [aten.bmm, aten._softmax, aten.exp]  # what a fused site leaves none of
# enn::attention's arguments: (q, k, v, bias, mask, alibi, scale, causal, window, dropout_p, masked_rows, backend)
BIAS, MASK, ALIBI, CAUSAL, WINDOW, MASKED_ROWS, BACKEND = 3, 4, 5, 7, 8, 10, 11


# ----------------------------------------------------------------------------- checks
def choices() -> list[dict]:
    return [c for g in enn_backend.report().to_dict()["graphs"] for c in g["kernel_choices"]]


def the(graph: fx.Graph, op) -> fx.Node:
    (node,) = find_ops(graph, op)
    return node


def fused(fn, args, train=True, **kw):
    """Run the attention pass; one site fused, nothing of the hand-written attention left, values
    (and gradients) equal eager's."""
    run = run_passes(fn, args, ["attention"], training=train, **kw)
    assert run.matches == {"attention": 1}, run.matches
    assert_ops(run.after, absent=UNFUSED)
    run.check_eager()
    return run


def untouched(fn, args, train=False):
    """Run the attention pass; no site matches and no stage of it changes the attention's ops."""
    run = run_passes(fn, args, ["attention"], training=train)
    assert run.matches == {"attention": 0}, run.matches
    for stage in run.stages:
        for op in (aten.bmm, aten.exp, aten._softmax):
            assert count_ops(stage.after, op) == count_ops(stage.before, op), (stage.stage, op)
        assert_ops(stage.after, absent=[enn.attention, CPU_FLASH, CPU_FLASH_BWD])
    run.check_eager()
    return run


# ----------------------------------------------------------------------------- cases
def qkv(dtype=torch.float32, hkv=H, grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    k = torch.randn(B, hkv, T, D, generator=g, dtype=dtype)
    v = torch.randn(B, hkv, T, D, generator=g, dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def causal_tril(q, k, v):
    t = q.size(-2)
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
    att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
    att = att.masked_fill(~mask, float("-inf"))
    return F.softmax(att, dim=-1) @ v


def causal_triu_where_min(q, k, v):
    t = q.size(-2)
    upper = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    att = torch.matmul(q * (1.0 / math.sqrt(q.size(-1))), k.transpose(-1, -2))
    att = torch.where(upper, torch.finfo(att.dtype).min, att)
    return torch.softmax(att, dim=-1) @ v


def causal_arange(q, k, v):
    t = q.size(-2)
    keep = torch.arange(t)[:, None] >= torch.arange(t)[None, :]
    att = torch.matmul(q, k.transpose(-1, -2)) * 0.3
    att = att.masked_fill(keep.logical_not(), float("-inf"))
    return att.softmax(-1) @ v


def scale_q_div(q, k, v):
    att = (q / math.sqrt(q.size(-1))) @ k.transpose(-2, -1)
    t = q.size(-2)
    att = att.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
    return torch.softmax(att, dim=-1) @ v


def sliding_window(q, k, v):
    t = q.size(-2)
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    band = (j <= i) & (i - j < 3)
    att = (q @ k.transpose(-2, -1)) * 0.5
    att = att.masked_fill(~band, float("-inf"))
    return torch.softmax(att, -1) @ v


def padding_bias(q, k, v, pad):
    att = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1)) + (1.0 - pad[:, None, None, :]) * -10000.0
    return att.softmax(-1) @ v


def finfo_min_padding(q, k, v, pad):
    """HF's padding mask: ``(1 - mask) * finfo.min`` added to the scores."""
    att = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1)) + (1.0 - pad[:, None, None, :]) * torch.finfo(q.dtype).min
    return att.softmax(-1) @ v


def int_padding(fill):
    def attend(q, k, v, pad):  # pad: an integer attention mask (1 keep, 0 pad), as HF passes it
        att = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1)) + (1.0 - pad[:, None, None, :].to(q.dtype)) * fill
        return att.softmax(-1) @ v
    return attend


def learned_bias(q, k, v, bias):
    att = torch.matmul(q, k.transpose(-1, -2)) * 0.35 + bias
    return F.softmax(att.float(), dim=-1).to(q.dtype) @ v


def t5_bias(q, k, v, pos, mask):
    """T5's scores: no scale, a learned relative-position bias ``[1, H, Tq, Tk]`` and the extended
    padding mask added one after the other (two bias terms, the first one with a gradient)."""
    att = torch.matmul(q, k.transpose(3, 2)) + pos
    return F.softmax(att + mask, dim=-1) @ v


def t5_bias_scaled(q, k, v, pos, mask):
    """The position bias scaled with the scores: its gradient is 0.5 times the scores'."""
    att = (torch.matmul(q, k.transpose(-1, -2)) + pos) * 0.5 + mask
    return att.softmax(-1) @ v


def t5_bias_twice(q, k, v, pos, mask):
    """One bias node in two terms (factors 2 and 1): its gradient is 3 times the scores'."""
    att = (torch.matmul(q, k.transpose(-1, -2)) + pos) * 2.0 + pos + mask
    return att.softmax(-1) @ v


def three_d_bias(q, k, v, bias, mask):
    """``bmm`` on [B, T, D] (no head axis) with a learned bias [1, Tq, Tk] and a padding mask [B, 1, Tk]."""
    return torch.bmm((torch.bmm(q, k.transpose(1, 2)) * 0.3 + bias + mask).softmax(-1), v)


class T5Layers(torch.nn.Module):
    """T5's relative-position bias: looked up in a learned ``[buckets, H]`` table once, in layer 0,
    and reused by the next layer (both attentions add it, with the padding mask)."""

    def __init__(self, buckets: int = 8) -> None:
        super().__init__()
        self.buckets = buckets
        self.table = torch.nn.Embedding(buckets, H)
        torch.nn.init.normal_(self.table.weight, std=0.5, generator=torch.Generator().manual_seed(1))

    def forward(self, q, k, v, mask):
        i = torch.arange(q.size(-2))
        rel = (i[None, :] - i[:, None]).clamp(-(self.buckets // 2), self.buckets // 2 - 1) + self.buckets // 2
        pos = self.table(rel).permute(2, 0, 1).unsqueeze(0)  # [1, H, T, T]
        return t5_bias(t5_bias(q, k, v, pos, mask), k, v, pos, mask)


def t5_cross(q, k, v, mask):
    """T5's cross-attention: the zero position bias of a layer without relative positions, the
    encoder's padding mask, Tk == D. Inductor's joint clean-up folds ``+ zeros`` away and
    replaces the ``* 1.0`` with a node of its own: the backward of that ``mul`` is left with a
    ``seq_nr`` no forward node has."""
    att = torch.matmul(q, k.transpose(3, 2)) * 1.0
    att = att + torch.zeros(1, q.size(1), q.size(2), k.size(2), dtype=q.dtype)
    return torch.matmul(F.softmax((att + mask).float(), dim=-1).type_as(att), v)


def bool_padding_neg_inf(q, k, v, keep):
    att = torch.matmul(q, k.transpose(-1, -2)) * 0.35
    att = att.masked_fill(~keep[:, None, None, :], float("-inf"))
    return torch.softmax(att, -1) @ v


def gqa_repeat_interleave(q, k, v):
    n_rep = q.size(1) // k.size(1)
    k = k.repeat_interleave(n_rep, dim=1)
    v = v.repeat_interleave(n_rep, dim=1)
    t = q.size(-2)
    att = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    att = att.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    return att.softmax(-1) @ v


def alibi_causal(q, k, v, slopes):
    t = q.size(-2)
    pos = torch.arange(t)
    rel = (pos[None, :] - pos[:, None]).float()
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1))) + slopes.view(1, -1, 1, 1) * rel
    att = att.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool)), float("-inf"))
    return F.softmax(att, dim=-1) @ v


def three_d_causal(q, k, v):
    t = q.size(-2)
    mask = torch.zeros(t, t).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.bmm((torch.bmm(q, k.transpose(1, 2)) * 0.3 + mask).softmax(-1), v)


def heads_of_hidden(q, k, v):
    """BERT's layout: q / k / v ``[B, T, H * D]`` split into heads by view + permute, the context
    merged back the same way; the key enters the scores transposed. The gradients leave the fused
    kernel in another layout than the unfused graph's, and reach the inputs through views."""
    b, t, _ = q.shape
    heads = lambda x: x.view(b, t, H, -1).permute(0, 2, 1, 3)  # noqa: E731
    att = (heads(q) @ heads(k).transpose(-1, -2) / math.sqrt(D)).softmax(-1)
    return (att @ heads(v)).permute(0, 2, 1, 3).contiguous().view(b, t, -1)


def softmax_over_queries(q, k, v):
    # (without the mask, Inductor's own fuse_attention rewrites this to SDPA on 2.13 and gets it
    # wrong: it does not check the softmax axis)
    t = q.size(-2)
    att = (q @ k.transpose(-1, -2) * 0.3).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return att.softmax(-2) @ v


def softmax_over_dim1_3d(q, k, v):
    return torch.bmm((torch.bmm(q, k.transpose(1, 2)) * 0.3).softmax(1), v)  # [B, Tq, Tk]: dim 1 is the queries


def intermediate_reused(q, k, v):
    p = (q @ k.transpose(-1, -2) * 0.3).softmax(-1)
    return p @ v, p.sum()


def exp_not_softmax(q, k, v):
    att = torch.exp(q @ k.transpose(-1, -2) * 0.3)
    return att @ v


def alibi_bf16_positions(q, k, v, slopes):
    t = q.size(-2)
    pos = torch.arange(t)
    rel = (pos[None, :] - pos[:, None]).to(torch.bfloat16)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1))) + slopes.view(1, -1, 1, 1) * rel
    att = att.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool)), float("-inf"))
    return F.softmax(att.float(), dim=-1).to(q.dtype) @ v
