"""What every model of the zoo shares: the batch and entry types, the losses, seeded inputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F


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
    """A model of the zoo or of the third-party suite: how to build it, and its sizes by name."""

    name: str
    description: str
    builder: Callable[..., ZooEntry]
    sizes: dict[str, dict[str, Any]] = field(default_factory=dict)
    requires: tuple[str, ...] = ()  # packages the builder imports (third-party models)
    modes: tuple[str, ...] = ("train", "infer")  # the steps the benchmark runs it in
    stochastic: str = ""  # why its training step is random (dropout on), so no accuracy verdict applies; "" if not


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token / per-token cross entropy, as in nanoGPT."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), target.view(-1))


def class_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), target)


def seeded(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (inputs are drawn on the CPU, then moved)."""
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def token_batch(device: torch.device, batch: int, seq: int, vocab: int) -> Callable[..., Batch]:
    def make(seed: int = 0) -> Batch:
        g = seeded(1000 + seed)
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        return Batch(args=(idx[:, :-1].contiguous().to(device),), target=idx[:, 1:].contiguous().to(device))

    return make



def image_batch(device: torch.device, batch: int, img: int, n_classes: int) -> Callable[..., Batch]:
    def make(seed: int = 0) -> Batch:
        g = seeded(1000 + seed)
        x = torch.randn(batch, 3, img, img, generator=g)
        y = torch.randint(0, n_classes, (batch,), generator=g)
        return Batch(args=(x.to(device),), target=y.to(device))

    return make
