"""Decoders with hand-written masks: LLaMA / Mistral (RMSNorm, RoPE, SwiGLU, GQA, sliding window) and ALiBi."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import ZooEntry, token_batch, token_loss


# ============================================================== LLaMA / Mistral (RMSNorm, RoPE, SwiGLU, GQA)
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x.float()).type_as(x) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(head_dim: int, seq: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(seq).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class LlamaAttention(nn.Module):
    """Meta LLaMA attention with GQA; ``window`` > 0 makes it Mistral's sliding window."""

    def __init__(self, d_model: int, n_head: int, n_kv_head: int, window: int = 0) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = n_head, n_kv_head
        self.head_dim = d_model // n_head
        self.window = window
        self.wq = nn.Linear(d_model, n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(d_model, n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(d_model, n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(n_head * self.head_dim, d_model, bias=False)

    @staticmethod
    def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
        b, h, t, d = x.shape
        if n_rep == 1:
            return x
        return x[:, :, None, :, :].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq, self.n_kv_head, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = self.repeat_kv(k, self.n_head // self.n_kv_head)
        v = self.repeat_kv(v, self.n_head // self.n_kv_head)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        if self.window:
            i = torch.arange(seq, device=x.device)[:, None]
            j = torch.arange(seq, device=x.device)[None, :]
            allowed = (j <= i) & (i - j < self.window)
            scores = scores.masked_fill(~allowed, float("-inf"))
        else:
            mask = torch.full((seq, seq), float("-inf"), device=x.device).triu(1)
            scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(q)
        out = torch.matmul(scores, v)
        return self.wo(out.transpose(1, 2).contiguous().view(bsz, seq, -1))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, d_model: int, n_head: int, n_kv_head: int, ffn: int, window: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(d_model)
        self.attention = LlamaAttention(d_model, n_head, n_kv_head, window)
        self.ffn_norm = RMSNorm(d_model)
        self.feed_forward = SwiGLU(d_model, ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, vocab: int, seq: int, d_model: int, n_head: int, n_kv_head: int, ffn: int, n_layer: int,
                 window: int = 0) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList([LlamaBlock(d_model, n_head, n_kv_head, ffn, window) for _ in range(n_layer)])
        self.norm = RMSNorm(d_model)
        self.output = nn.Linear(d_model, vocab, bias=False)
        cos, sin = rope_tables(d_model // n_head, seq)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.size(1)
        h = self.tok_embeddings(tokens)
        cos, sin = self.cos[:seq].to(h.dtype), self.sin[:seq].to(h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def build_llama(device: torch.device, *, batch: int, seq: int, vocab: int, d_model: int, n_head: int, n_kv_head: int,
                ffn: int, n_layer: int, window: int = 0) -> ZooEntry:
    model = Llama(vocab, seq, d_model, n_head, n_kv_head, ffn, n_layer, window).to(device)
    return ZooEntry(model, token_batch(device, batch, seq, vocab), token_loss)


# ============================================================== ALiBi decoder (BLOOM / MPT style)
def alibi_slopes(n_heads: int) -> torch.Tensor:
    """The ALiBi paper's head slopes (geometric, 2^(-8/n) ...), for any head count."""

    def pow2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n_heads).is_integer():
        return torch.tensor(pow2(n_heads))
    closest = 2 ** math.floor(math.log2(n_heads))
    return torch.tensor(pow2(closest) + pow2(2 * closest)[0::2][: n_heads - closest])


class AlibiAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, alibi: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * (C // self.n_head) ** -0.5 + alibi
        scores = scores.masked_fill(causal, float("-inf"))
        attn = scores.softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, T, C))


class AlibiBlock(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = AlibiAttention(d_model, n_head)
        self.ln_2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor, alibi: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), alibi, causal)
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x))))


class AlibiDecoder(nn.Module):
    def __init__(self, vocab: int, d_model: int, n_head: int, n_layer: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList([AlibiBlock(d_model, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("slopes", alibi_slopes(n_head), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        distance = (pos[None, :] - pos[:, None]).to(self.slopes.dtype)  # j - i: <= 0 for the past
        alibi = self.slopes.view(1, -1, 1, 1) * distance.view(1, 1, T, T)
        causal = pos[None, :] > pos[:, None]
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, alibi, causal)
        return self.head(self.ln_f(x))


def build_alibi(device: torch.device, *, batch: int, seq: int, vocab: int, d_model: int, n_head: int,
                n_layer: int) -> ZooEntry:
    model = AlibiDecoder(vocab, d_model, n_head, n_layer).to(device)
    return ZooEntry(model, token_batch(device, batch, seq, vocab), token_loss)
