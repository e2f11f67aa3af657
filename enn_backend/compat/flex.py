"""FlexAttention's private helpers."""

from __future__ import annotations

from typing import Any

import torch

from .versions import TORCH_VERSION

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


def cpu_flex_needs_distinct_buffers() -> bool:
    """torch < 2.13: Inductor's CPU flex lowering raises "Unsupported for now if query, key, value
    are the same buffer" when q, k, v are views of one buffer (a fused qkv projection's unbind or
    split; pytorch/pytorch#157612); from 2.13 the lowering copies such operands itself
    (``_realize_duplicate_buffer_inputs`` in ``kernel/flex/flex_cpu.py``). Checked in the 2.11 and
    2.13.0 sources; 2.12 is not checked and is treated as 2.11. enn then copies them before the
    flex op (enn_backend/passes/attention/kernels/flex.py); the copies go when enn requires
    torch >= 2.13. Covered by tests/test_attention_models.py::test_flex_in_graph_inference_cpu."""
    return TORCH_VERSION < (2, 13)
