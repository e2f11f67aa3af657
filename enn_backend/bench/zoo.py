"""A model zoo written in plain PyTorch, the way people really write these models.

Nothing here knows about enn: the attention is spelled out as users spell it
(nanoGPT's ``tril`` buffer + ``masked_fill(-inf)``, HF BERT's additive padding
mask, Meta LLaMA's ``softmax(scores.float()).type_as(q)``, T5's bucketed relative
position bias, ...), so the benchmark measures what enn does to real code.

Every model has two sizes:

- ``cpu-small``: tiny, so a compile + a few steps take seconds on 2 CPU cores;
- ``gpu-real``:  real widths and sequence lengths (GPT-2 small / BERT base / a
  LLaMA-1B-like layer ...) with few layers, so a GPU preset compiles in minutes.

:func:`build` returns a :class:`ZooEntry` ``(model, make_inputs, loss_fn)``:

    model, make_inputs, loss_fn = build("gpt2_naive", "cpu-small")
    batch = make_inputs()                  # Batch(args=(...), target=...)
    loss = loss_fn(model(*batch.args), batch.target)

Dropout is 0 everywhere, so a model is a deterministic function of its inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

SIZES = ("cpu-small", "gpu-real")


class Batch(NamedTuple):
    """One batch: ``model(*args)`` gives the output, ``loss_fn(output, target)`` the loss."""

    args: tuple
    target: torch.Tensor


class ZooEntry(NamedTuple):
    model: nn.Module
    make_inputs: Callable[..., Batch]  # make_inputs(seed=0) -> Batch on the model's device
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    builder: Callable[..., ZooEntry]
    sizes: dict[str, dict[str, Any]] = field(default_factory=dict)


# ============================================================== losses / inputs
def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token / per-token cross entropy, as in nanoGPT."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), target.view(-1))


def class_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), target)


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _token_batch(device: torch.device, batch: int, seq: int, vocab: int) -> Callable[..., Batch]:
    def make(seed: int = 0) -> Batch:
        g = _gen(1000 + seed)
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        return Batch(args=(idx[:, :-1].contiguous().to(device),), target=idx[:, 1:].contiguous().to(device))

    return make


# ============================================================== MLP
class MLP(nn.Module):
    """Linear + bias + GELU layers, then a classifier (GEMM + bias + activation epilogues)."""

    def __init__(self, d_in: int, d_hidden: int, n_layers: int, n_classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        d = d_in
        for _ in range(n_layers):
            layers += [nn.Linear(d, d_hidden), nn.GELU()]
            d = d_hidden
        layers.append(nn.Linear(d, n_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build_mlp(device: torch.device, *, batch: int, d_in: int, d_hidden: int, n_layers: int, n_classes: int) -> ZooEntry:
    model = MLP(d_in, d_hidden, n_layers, n_classes).to(device)

    def make(seed: int = 0) -> Batch:
        g = _gen(1000 + seed)
        x = torch.randn(batch, d_in, generator=g)
        y = torch.randint(0, n_classes, (batch,), generator=g)
        return Batch(args=(x.to(device),), target=y.to(device))

    return ZooEntry(model, make, class_loss)


# ============================================================== GPT-2 (nanoGPT)
class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: ``naive`` (tril buffer + masked_fill + softmax) or ``sdpa`` (is_causal)."""

    def __init__(self, d_model: int, n_head: int, block_size: int, impl: str) -> None:
        super().__init__()
        assert d_model % n_head == 0
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.n_head = n_head
        self.impl = impl
        if impl == "naive":
            self.register_buffer(
                "bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size), persistent=False
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.impl == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class GPTMLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class GPTBlock(nn.Module):
    def __init__(self, d_model: int, n_head: int, block_size: int, impl: str) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, block_size, impl)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = GPTMLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """GPT-2 as nanoGPT writes it: learned positions, pre-LN blocks, tied LM head."""

    def __init__(self, vocab: int, block_size: int, d_model: int, n_head: int, n_layer: int, impl: str) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(block_size, d_model)
        self.h = nn.ModuleList([GPTBlock(d_model, n_head, block_size, impl) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as GPT-2 does
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return self.lm_head(x)


def build_gpt(device: torch.device, *, impl: str, batch: int, seq: int, vocab: int, d_model: int, n_head: int,
              n_layer: int) -> ZooEntry:
    model = GPT(vocab, seq, d_model, n_head, n_layer, impl).to(device)
    return ZooEntry(model, _token_batch(device, batch, seq, vocab), token_loss)


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
        g = _gen(1000 + seed)
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
        mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()  # right padding, >= half real tokens
        ids = ids * mask
        y = torch.randint(0, n_classes, (batch,), generator=g)
        return Batch(args=(ids.to(device), mask.to(device)), target=y.to(device))

    return ZooEntry(model, make, class_loss)


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
    return ZooEntry(model, _token_batch(device, batch, seq, vocab), token_loss)


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
    return ZooEntry(model, _token_batch(device, batch, seq, vocab), token_loss)


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
    return ZooEntry(model, _token_batch(device, batch, seq, vocab), token_loss)


# ============================================================== ViT (timm style)
class ViTAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class ViTBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = ViTAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, img: int, patch: int, dim: int, depth: int, num_heads: int, num_classes: int) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        n_patches = (img // patch) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, n_patches + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[ViTBlock(dim, num_heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def _image_batch(device: torch.device, batch: int, img: int, n_classes: int) -> Callable[..., Batch]:
    def make(seed: int = 0) -> Batch:
        g = _gen(1000 + seed)
        x = torch.randn(batch, 3, img, img, generator=g)
        y = torch.randint(0, n_classes, (batch,), generator=g)
        return Batch(args=(x.to(device),), target=y.to(device))

    return make


def build_vit(device: torch.device, *, batch: int, img: int, patch: int, dim: int, depth: int, heads: int,
              n_classes: int) -> ZooEntry:
    model = ViT(img, patch, dim, depth, heads, n_classes).to(device)
    return ZooEntry(model, _image_batch(device, batch, img, n_classes), class_loss)


# ============================================================== small ResNet-like conv net
class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ConvNet(nn.Module):
    def __init__(self, widths: tuple[int, ...], n_classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks = []
        c = widths[0]
        for i, w in enumerate(widths):
            blocks.append(BasicBlock(c, w, stride=1 if i == 0 else 2))
            c = w
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(c, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_convnet(device: torch.device, *, batch: int, img: int, widths: tuple[int, ...], n_classes: int) -> ZooEntry:
    model = ConvNet(tuple(widths), n_classes).to(device)
    return ZooEntry(model, _image_batch(device, batch, img, n_classes), class_loss)


# ============================================================== registry
def _gpt(impl: str) -> Callable[..., ZooEntry]:
    def build(device: torch.device, **cfg: Any) -> ZooEntry:
        return build_gpt(device, impl=impl, **cfg)

    return build


_GPT_SMALL = dict(batch=2, seq=64, vocab=512, d_model=64, n_head=4, n_layer=2)
_GPT_REAL = dict(batch=8, seq=1024, vocab=50304, d_model=768, n_head=12, n_layer=2)

MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec("mlp", "MLP: Linear+bias+GELU layers (GEMM epilogues)", build_mlp, {
            "cpu-small": dict(batch=64, d_in=128, d_hidden=256, n_layers=3, n_classes=16),
            "gpu-real": dict(batch=8192, d_in=1024, d_hidden=4096, n_layers=3, n_classes=1000),
        }),
        ModelSpec("gpt2_naive", "GPT-2 (nanoGPT), causal attention as tril buffer + masked_fill(-inf) + softmax", _gpt("naive"), {
            "cpu-small": dict(_GPT_SMALL),
            "gpu-real": dict(_GPT_REAL),
        }),
        ModelSpec("gpt2_sdpa", "GPT-2 (nanoGPT), F.scaled_dot_product_attention(is_causal=True); gpu-real = the ANCHORS 6-block stack",
                  _gpt("sdpa"), {
            "cpu-small": dict(_GPT_SMALL),
            "gpu-real": dict(_GPT_REAL, n_layer=6),
        }),
        ModelSpec("bert", "BERT encoder (HF style): post-LN, additive padding mask (dtype min), classifier", build_bert, {
            "cpu-small": dict(batch=4, seq=64, vocab=512, d_model=64, n_head=4, n_layer=2, n_classes=4),
            "gpu-real": dict(batch=16, seq=512, vocab=30522, d_model=768, n_head=12, n_layer=2, n_classes=4),
        }),
        ModelSpec("llama", "LLaMA (Meta style): RMSNorm, RoPE, SwiGLU, GQA, additive triu(-inf) mask, fp32 softmax", build_llama, {
            "cpu-small": dict(batch=2, seq=64, vocab=512, d_model=64, n_head=4, n_kv_head=2, ffn=172, n_layer=2),
            "gpu-real": dict(batch=4, seq=1024, vocab=32000, d_model=1024, n_head=16, n_kv_head=4, ffn=2816, n_layer=2),
        }),
        ModelSpec("alibi", "ALiBi decoder (BLOOM/MPT style): additive slope*distance bias + causal masked_fill", build_alibi, {
            "cpu-small": dict(batch=2, seq=64, vocab=512, d_model=64, n_head=4, n_layer=2),
            "gpu-real": dict(batch=4, seq=1024, vocab=32000, d_model=1024, n_head=16, n_layer=2),
        }),
        ModelSpec("t5", "T5 v1.0 encoder: bucketed relative position bias, unscaled scores, fp32 softmax, ReLU FFN", build_t5, {
            "cpu-small": dict(batch=2, seq=64, vocab=512, d_model=64, n_head=4, d_ff=256, n_layer=2),
            "gpu-real": dict(batch=8, seq=512, vocab=32128, d_model=768, n_head=12, d_ff=3072, n_layer=2),
        }),
        ModelSpec("sliding", "Mistral-style sliding-window attention (LLaMA block, window mask via masked_fill)",
                  lambda device, **cfg: build_llama(device, **cfg), {
            "cpu-small": dict(batch=2, seq=64, vocab=512, d_model=64, n_head=4, n_kv_head=2, ffn=172, n_layer=2, window=16),
            "gpu-real": dict(batch=4, seq=2048, vocab=32000, d_model=1024, n_head=16, n_kv_head=4, ffn=2816, n_layer=2,
                             window=512),
        }),
        ModelSpec("vit", "ViT (timm style): conv patch embed, cls token, q*scale @ k^T softmax attention", build_vit, {
            "cpu-small": dict(batch=4, img=32, patch=8, dim=64, depth=2, heads=4, n_classes=10),
            "gpu-real": dict(batch=64, img=224, patch=16, dim=768, depth=2, heads=12, n_classes=1000),
        }),
        ModelSpec("convnet", "ResNet-like conv net: conv + BatchNorm + ReLU basic blocks", build_convnet, {
            "cpu-small": dict(batch=8, img=32, widths=(16, 32), n_classes=10),
            "gpu-real": dict(batch=64, img=128, widths=(64, 128, 256), n_classes=1000),
        }),
    ]
}


def names() -> list[str]:
    return list(MODELS)


def config(name: str, size: str = "cpu-small", **overrides: Any) -> dict[str, Any]:
    """The constructor arguments of model ``name`` at ``size`` (plus overrides)."""
    if name not in MODELS:
        raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(MODELS)}")
    if size not in SIZES:
        raise KeyError(f"unknown size {size!r}; known: {', '.join(SIZES)}")
    cfg = dict(MODELS[name].sizes[size])
    cfg.update(overrides)
    return cfg


def build(name: str, size: str = "cpu-small", *, device: str | torch.device = "cpu", seed: int = 0,
          **overrides: Any) -> ZooEntry:
    """Build zoo model ``name`` at ``size`` on ``device`` with weights drawn from ``seed``."""
    cfg = config(name, size, **overrides)
    device = torch.device(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        entry = MODELS[name].builder(device, **cfg)
    return entry


def gpt_small(size: str = "cpu-small", *, attention: str = "naive", device: str | torch.device = "cpu", seed: int = 0,
              **overrides: Any) -> ZooEntry:
    """A small GPT-2 (nanoGPT) for demos: ``attention='naive'`` (tril + masked_fill) or ``'sdpa'``.

    ``cpu-small`` is 2 layers, d=64, T=64, vocab 512: compiles in seconds on a CPU.
    """
    if attention not in ("naive", "sdpa"):
        raise ValueError(f"attention must be 'naive' or 'sdpa', got {attention!r}")
    return build(f"gpt2_{attention}", size, device=device, seed=seed, **overrides)
