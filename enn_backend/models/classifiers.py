"""Classifiers: an MLP of Linear + bias + GELU layers, a timm-style ViT and a small ResNet-like conv net."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import Batch, ZooEntry, class_loss, image_batch, seeded


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
        g = seeded(1000 + seed)
        x = torch.randn(batch, d_in, generator=g)
        y = torch.randint(0, n_classes, (batch,), generator=g)
        return Batch(args=(x.to(device),), target=y.to(device))

    return ZooEntry(model, make, class_loss)


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



def build_vit(device: torch.device, *, batch: int, img: int, patch: int, dim: int, depth: int, heads: int,
              n_classes: int) -> ZooEntry:
    model = ViT(img, patch, dim, depth, heads, n_classes).to(device)
    return ZooEntry(model, image_batch(device, batch, img, n_classes), class_loss)


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
    return ZooEntry(model, image_batch(device, batch, img, n_classes), class_loss)
