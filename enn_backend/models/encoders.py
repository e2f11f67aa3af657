"""Encoders: BERT (HF style, additive padding mask) and the T5 v1.0 encoder (bucketed relative position bias)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import Batch, ZooEntry, class_loss, seeded, token_batch, token_loss


# ============================================================== BERT (HF style, padding mask)
class BertSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.size(0), x.size(1), self.n_head, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, h: torch.Tensor, extended_mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(self.query(h)), self.split(self.key(h)), self.split(self.value(h))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores + extended_mask
        probs = nn.functional.softmax(scores, dim=-1)
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        return ctx.view(ctx.size(0), ctx.size(1), -1)


class BertLayer(nn.Module):
    """Post-LN encoder layer as in HF's BertLayer."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.attention = BertSelfAttention(d_model, n_head)
        self.attn_out = nn.Linear(d_model, d_model)
        self.attn_norm = nn.LayerNorm(d_model, eps=1e-12)
        self.intermediate = nn.Linear(d_model, 4 * d_model)
        self.output = nn.Linear(4 * d_model, d_model)
        self.out_norm = nn.LayerNorm(d_model, eps=1e-12)

    def forward(self, h: torch.Tensor, extended_mask: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(self.attn_out(self.attention(h, extended_mask)) + h)
        return self.out_norm(self.output(F.gelu(self.intermediate(h))) + h)


class BertClassifier(nn.Module):
    def __init__(self, vocab: int, max_pos: int, d_model: int, n_head: int, n_layer: int, n_classes: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, d_model)
        self.position_embeddings = nn.Embedding(max_pos, d_model)
        self.token_type_embeddings = nn.Embedding(2, d_model)
        self.emb_norm = nn.LayerNorm(d_model, eps=1e-12)
        self.layers = nn.ModuleList([BertLayer(d_model, n_head) for _ in range(n_layer)])
        self.pooler = nn.Linear(d_model, d_model)
        self.classifier = nn.Linear(d_model, n_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        seq = input_ids.size(1)
        pos = torch.arange(seq, device=input_ids.device).unsqueeze(0)
        h = self.word_embeddings(input_ids) + self.position_embeddings(pos) + self.token_type_embeddings(torch.zeros_like(input_ids))
        h = self.emb_norm(h)
        # HF's get_extended_attention_mask: 0 where attended, dtype-min where padded
        extended = (1.0 - attention_mask[:, None, None, :].to(h.dtype)) * torch.finfo(h.dtype).min
        for layer in self.layers:
            h = layer(h, extended)
        pooled = torch.tanh(self.pooler(h[:, 0]))
        return self.classifier(pooled)


def build_bert(device: torch.device, *, batch: int, seq: int, vocab: int, d_model: int, n_head: int, n_layer: int,
               n_classes: int) -> ZooEntry:
    model = BertClassifier(vocab, seq, d_model, n_head, n_layer, n_classes).to(device)

    def make(seed: int = 0) -> Batch:
        g = seeded(1000 + seed)
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
        mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()  # right padding, >= half real tokens
        ids = ids * mask
        y = torch.randint(0, n_classes, (batch,), generator=g)
        return Batch(args=(ids.to(device), mask.to(device)), target=y.to(device))

    return ZooEntry(model, make, class_loss)



# ============================================================== T5 encoder (relative position bias)
class T5LayerNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(self.weight.dtype)


def relative_position_bucket(relative_position: torch.Tensor, num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """HF T5's bidirectional bucketing: exact buckets up close, log-spaced ones further out."""
    num_buckets //= 2
    buckets = (relative_position > 0).to(torch.long) * num_buckets
    relative_position = torch.abs(relative_position)
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    large = max_exact + (
        torch.log(relative_position.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(is_small, relative_position, large)


class T5Attention(nn.Module):
    def __init__(self, d_model: int, n_head: int, has_bias: bool, num_buckets: int = 32) -> None:
        super().__init__()
        self.n_head, self.d_kv = n_head, d_model // n_head
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)
        self.num_buckets = num_buckets
        self.relative_attention_bias = nn.Embedding(num_buckets, n_head) if has_bias else None

    def compute_bias(self, q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
        ctx = torch.arange(q_len, dtype=torch.long, device=device)[:, None]
        mem = torch.arange(k_len, dtype=torch.long, device=device)[None, :]
        bucket = relative_position_bucket(mem - ctx, num_buckets=self.num_buckets)
        values = self.relative_attention_bias(bucket)  # (q, k, heads)
        return values.permute([2, 0, 1]).unsqueeze(0)

    def forward(self, h: torch.Tensor, position_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, _ = h.shape

        def shape(x: torch.Tensor) -> torch.Tensor:
            return x.view(B, -1, self.n_head, self.d_kv).transpose(1, 2)

        q, k, v = shape(self.q(h)), shape(self.k(h)), shape(self.v(h))
        scores = torch.matmul(q, k.transpose(3, 2))  # T5 does not scale the scores
        if position_bias is None:
            position_bias = self.compute_bias(T, T, h.device)
        scores = scores + position_bias
        attn = F.softmax(scores.float(), dim=-1).type_as(scores)
        out = torch.matmul(attn, v).transpose(1, 2).contiguous().view(B, -1, self.n_head * self.d_kv)
        return self.o(out), position_bias


class T5Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, d_ff: int, has_bias: bool) -> None:
        super().__init__()
        self.attn_norm = T5LayerNorm(d_model)
        self.attn = T5Attention(d_model, n_head, has_bias)
        self.ff_norm = T5LayerNorm(d_model)
        self.wi = nn.Linear(d_model, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, h: torch.Tensor, position_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        a, position_bias = self.attn(self.attn_norm(h), position_bias)
        h = h + a
        h = h + self.wo(F.relu(self.wi(self.ff_norm(h))))
        return h, position_bias


class T5Encoder(nn.Module):
    """T5 v1.0 encoder; the first layer owns the relative bias table, later layers reuse its bias."""

    def __init__(self, vocab: int, d_model: int, n_head: int, d_ff: int, n_layer: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d_model)
        self.block = nn.ModuleList([T5Block(d_model, n_head, d_ff, has_bias=(i == 0)) for i in range(n_layer)])
        self.final_layer_norm = T5LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        bias = None
        for blk in self.block:
            h, bias = blk(h, bias)
        return self.lm_head(self.final_layer_norm(h))


def build_t5(device: torch.device, *, batch: int, seq: int, vocab: int, d_model: int, n_head: int, d_ff: int,
             n_layer: int) -> ZooEntry:
    model = T5Encoder(vocab, d_model, n_head, d_ff, n_layer).to(device)
    return ZooEntry(model, token_batch(device, batch, seq, vocab), token_loss)
