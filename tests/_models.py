"""Tiny models shared by the tests (plain PyTorch, the way people write them)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, d_hidden: int = 32, d_out: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """A pre-norm GPT block with hand-written causal attention."""

    def __init__(self, d: int = 32, heads: int = 2, max_t: int = 64) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.register_buffer("mask", torch.tril(torch.ones(max_t, max_t, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(~self.mask[:T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def make(kind: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP(), torch.randn(8, 16)
    if kind == "block":
        return Block(), torch.randn(2, 16, 32)
    raise ValueError(kind)


def train_step(model: nn.Module, x: torch.Tensor, fn=None, autocast: torch.dtype | None = None):
    """Forward + backward; returns (output, {param name: grad})."""
    fn = model if fn is None else fn
    for p in model.parameters():
        p.grad = None
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        out = fn(x)
    out.float().square().mean().backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def assert_close_step(a, b, dtype: torch.dtype | None = None) -> None:
    tol = dict(atol=2e-2, rtol=2e-2) if dtype in (torch.bfloat16, torch.float16) else dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(a[0], b[0], **tol)
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], **tol, msg=lambda m, n=name: f"grad of {n}: {m}")
