"""A model's own SDPA call with a causal band and key padding, as FlexAttention: :class:`PaddedCausalFlex`.

transformers' ``sdpa`` attention with left padding (batched generation) hands SDPA a ``[B, 1, T,
T]`` boolean mask: causal, and-ed with the ``[B, T]`` padding vector. The first rows of a
left-padded sequence keep no key ("dead rows"), and what SDPA's CUDA kernels make of them is part
of the result (the retired ``bench/gpu_sdpa_left_padding.py``, torch 2.11, H100: bench/HISTORY.md):

cuDNN adds a finite fill to every score of such a row, so the row is a softmax over *every* key of
its raw scores (offset by the fill, which rounds them in fp32). The memory-efficient kernel gives
it zeros, as it does under the causal flag, so its calls take the flag (sdpa_calls.py).

So the causal flag cannot replace cuDNN's mask (it would drop the keys after the row).
FlexAttention computes exactly the mask's semantics without the ``T x T`` tensor: ``mask_mod``
keeps ``(kv <= q) & keep[b, kv]`` and every key of a dead row, whose scores ``score_mod`` offsets by
the fill.

The block mask follows from the padding vector at block level in closed form (:func:`block_parts`)
on every call: built once per graph call by a few small kernels and shared by every layer reading
that vector. It is built per query head: with one head broadcast over all of them, compiled flex
on torch 2.11 returned wrong values and then an illegal memory access (per-batch masks,
``pytorch/pytorch#172225`` reports the same class of fault).

Inference only. In training flex's forward + backward measured 2x slower than cuDNN with the
materialized mask at T=1024 (1.111 vs 0.563 ms) and 1.28x faster at T=4096 (4.99 vs 6.40); but the
guard's eager reference runs flex's backward op as torch runs it outside a compile, densely and
vmapped over every score with the padding vectors indexed inside: at T=4096 (B=2, 4 heads) one
such backward ran for over 150 s.
So a training call keeps its mask. Forward alone: 0.092 vs 0.176 ms at T=1024, 0.915 vs 1.855 at
T=4096 (the SDPA times include HF's K/V head copy).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .... import compat
from ..emitter import Emitter
from .flex import SPARSE_BLOCK, fake_like, splice_fragment


TENSOR = object()  # a tensor's slot in a BlockMask.as_tuple() template


def dead_rows(keep: torch.Tensor) -> torch.Tensor:
    """``[B, Tq]``: the query rows of a causal band that keep no key (before the first kept key)."""
    return keep.to(torch.int32).cumsum(-1) == 0


def block_parts(keep: torch.Tensor, dead: torch.Tensor, heads: int) -> tuple:
    """The block mask of ``((kv <= q) & keep[b, kv]) | dead[b, q]`` as ``(kv_num_blocks,
    kv_indices, full_kv_num_blocks, full_kv_indices)``, ``[B, heads, ...]``.

    Block (m, n) holds queries [mB, mB + B) and keys [nB, nB + B). A live row keeps some key of it
    when n <= m and the key block keeps some key; every key when n < m and the key block keeps
    every key. A dead row keeps every key: a query block with one needs every key block, and a
    block whose rows are all dead is full. (A query block that follows a wholly kept key block has
    no dead row.) A partial block gets ``mask_mod`` applied inside the kernel; a full one does not.
    """
    b, t = keep.shape
    nb = t // SPARSE_BLOCK
    kb, db = keep.view(b, nb, SPARSE_BLOCK), dead.view(b, nb, SPARSE_BLOCK)
    rows = torch.arange(nb, device=keep.device).view(nb, 1)
    cols = torch.arange(nb, device=keep.device).view(1, nb)
    some = ((cols <= rows) & kb.any(-1)[:, None, :]) | db.any(-1)[:, :, None]
    full = ((cols < rows) & kb.all(-1)[:, None, :]) | db.all(-1)[:, :, None]
    partial = some & ~full

    def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dense = dense[:, None].expand(b, heads, nb, nb).to(torch.int32)
        num = dense.sum(-1).to(torch.int32)
        return num, torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)

    return (*ordered(partial), *ordered(full))


def causal_padding_mask_mod(b, h, q_idx, kv_idx, keep, dead):
    return ((kv_idx <= q_idx) & keep[b, kv_idx]) | dead[b, q_idx]


def dead_row_offset_score_mod(score, b, h, q_idx, kv_idx, offset):
    return score + offset[b, q_idx]


class PaddedCausalFlex:
    """Emits flex for the SDPA calls of one graph that read a causal band with key padding.

    ``fill``: the kernel's score offset of a dead row (the mask's fill as the kernel reads it).
    The block mask of each padding vector is spliced in once, before the first call reading it.
    """

    DEVICES = ("cuda",)  # where the kernels' dead-row semantics were measured

    def __init__(self, graph: fx.Graph, mode: Any) -> None:
        self.graph, self.mode = graph, mode
        self._shared: dict[tuple, tuple[list[fx.Node], list]] = {}

    @staticmethod
    def check(q: torch.Tensor, k: torch.Tensor, training: bool) -> tuple[bool, str]:
        if training:
            return False, ("in training flex's forward + backward is slower than this kernel with the mask at "
                           "T=1024, and at T=4096, where it is faster, the guard's eager run of its backward takes "
                           "minutes (kernels/flex_padding.py)")
        devices = PaddedCausalFlex.DEVICES
        if q.device.type not in devices:
            return False, f"flex with a per-call padding block mask is used on {', '.join(devices)} only"
        if not all(isinstance(s, int) for s in (*q.shape, *k.shape)):
            return False, "the padding block mask is built for fixed sizes (dynamic shapes here)"
        t, d = q.shape[-2], q.shape[-1]
        if t % SPARSE_BLOCK:
            return False, f"sequence length {t} is not a multiple of flex's {SPARSE_BLOCK}-row blocks"
        if d < 16 or d & (d - 1):
            return False, f"flex's Triton template wants a power-of-two head dim >= 16, have {d}"
        return True, ""

    def attend(self, call: fx.Node, q: fx.Node, k: fx.Node, v: fx.Node, keep: fx.Node, fill: float,
               scale: float) -> fx.Node:
        """The attention output of ``call`` computed by flex; nodes go before ``call``."""
        em = Emitter(self.graph, self.mode, call)
        heads = int(q.meta["val"].shape[1])
        key = (keep, heads, fill)
        if key not in self._shared:
            self._shared[key] = self._block_mask(em, keep, heads, fill)
        mask_nodes, template = self._shared[key]
        n_mask = sum(1 for x in template if x is TENSOR)
        with self.mode:
            fq, fk, fv = (fake_like(n, False) for n in (q, k, v))
            fakes = [fake_like(n, False) for n in mask_nodes]
            frag = _attend_fragment(fq, fk, fv, fakes[:n_mask], fakes[n_mask:], template, scale)
        (out,) = splice_fragment(em, frag, [q, k, v, *mask_nodes])
        return out

    def _block_mask(self, em: Emitter, keep: fx.Node, heads: int, fill: float) -> tuple[list, list]:
        """Splice the block-mask builder for ``keep``: (its output nodes, the ``as_tuple`` template)."""
        template: list = []
        t = int(keep.meta["val"].shape[-1])

        def build(keep_v: torch.Tensor):
            from torch.nn.attention.flex_attention import BlockMask

            dead = dead_rows(keep_v)
            parts = block_parts(keep_v, dead, heads)
            # Forward only: the query-side indices (the backward's) are not built.
            bm = BlockMask.from_kv_blocks(*parts, BLOCK_SIZE=SPARSE_BLOCK, mask_mod=causal_padding_mask_mod,
                                          seq_lengths=(t, t), compute_q_blocks=False)
            flat = bm.as_tuple()
            template.extend(TENSOR if isinstance(x, torch.Tensor) else x for x in flat)
            offset = torch.where(dead, fill, 0.0).to(torch.float32)
            return [x for x in flat if isinstance(x, torch.Tensor)] + [keep_v, dead, offset]

        from torch.fx.experimental.proxy_tensor import make_fx

        with self.mode, torch.no_grad():
            frag = make_fx(build, decomposition_table=compat.select_decomp_table())(fake_like(keep, False))
        return splice_fragment(em, frag, [keep]), template


def _attend_fragment(q, k, v, mask_tensors: list, buffers: list, template: list, scale: float) -> fx.GraphModule:
    """Trace the flex forward on (fake) q, k, v with the block mask's tensors as inputs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    flex_hop = compat.flex_attention_hop()
    options = compat.flex_kernel_options(q, k, v, False)
    n_mask = len(mask_tensors)

    def fn(q, k, v, *rest):
        it = iter(rest[:n_mask])
        parts = tuple(next(it) if x is TENSOR else x for x in template)
        keep, dead, offset = rest[n_mask:]
        return flex_hop(q, k, v, dead_row_offset_score_mod, parts, scale, options, (offset,), (keep, dead))[0]

    with torch.no_grad():
        return make_fx(fn, decomposition_table=compat.select_decomp_table())(q, k, v, *mask_tensors, *buffers)

