"""FlexAttention's private helpers."""

from __future__ import annotations

from typing import Any

import torch

# ----------------------------------------------------------------------------- FlexAttention
# FlexAttention's higher-order op and the private helpers enn's attention pass builds it with
# (enn_backend/passes/attention/kernels/flex.py). Their signatures are the same in torch 2.11 and 2.13;
# the block-mask tuple is not (13 vs 17 entries), so enn always builds it with BlockMask.
def flex_attention_hop() -> Any:
    from torch._higher_order_ops.flex_attention import flex_attention

    return flex_attention


def flex_kernel_options(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_lse: bool) -> dict:
    """The kernel options the public ``flex_attention`` would pass its HOP for these inputs."""
    from torch.nn.attention.flex_attention import _apply_kernel_options

    return dict(_apply_kernel_options(q, k, v, return_lse, None))


def flex_dense_to_ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks per row, their column indices first) of a dense block mask, as BlockMask stores them."""
    from torch.nn.attention.flex_attention import _dense_to_ordered

    return _dense_to_ordered(dense)
