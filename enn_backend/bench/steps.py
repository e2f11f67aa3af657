"""What one step of a workload is, for every backend alike.

A training step is ``zero_grad, forward + loss (under autocast for bf16 / fp16), backward,
AdamW step`` with the model compiled and the optimizer run eagerly (as most users run it);
an inference step is the forward under ``no_grad`` (+ autocast).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from ..models import Batch
from . import accuracy

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
MODES = ("train", "infer")


def autocast(device: str | torch.device, dtype: str) -> Callable[[], Any]:
    """A context factory: autocast to ``dtype`` (a key of :data:`DTYPES`) on ``device``'s type,
    or nothing for fp32."""
    if DTYPES[dtype] is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=torch.device(device).type, dtype=DTYPES[dtype])


def to_fp64(batch: Batch) -> Batch:
    """The batch with its floating-point inputs in float64 (the reference run's)."""
    args = tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in batch.args)
    return Batch(args, batch.target)


def result_step(fn: Callable, module: torch.nn.Module, batch: Batch, loss_fn: Callable, mode: str,
                autocast: Callable[[], Any]) -> list[torch.Tensor]:
    """One accuracy sample: outputs (inference) or loss + every gradient (training)."""
    # copies, not the tensors returned: under CUDA graphs those are overwritten by the next replay
    if mode == "infer":
        with torch.no_grad(), autocast():
            return [t.clone() for t in accuracy.flatten(fn(*batch.args))]
    module.zero_grad(set_to_none=True)
    with autocast():
        loss = loss_fn(fn(*batch.args), batch.target)
    loss.backward()
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return [loss.detach().clone()] + grads


def timed_step(fn: Callable, opt: torch.optim.Optimizer | None, batch: Batch, loss_fn: Callable, mode: str,
               autocast: Callable[[], Any]) -> Callable[[], Any]:
    """The step that is timed: ``fn`` is the (compiled) model, ``opt`` its optimizer (training)."""
    if mode == "infer":
        def infer() -> Any:
            with torch.no_grad(), autocast():
                return fn(*batch.args)

        return infer

    def train() -> Any:
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_fn(fn(*batch.args), batch.target)
        loss.backward()
        opt.step()
        return loss

    return train
