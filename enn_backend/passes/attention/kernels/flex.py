"""FlexAttention in the graph: causal / sliding-window / ALiBi attention as Inductor's flex kernels.

For attention whose structure is positions only -- a causal or sliding-window band, ALiBi's
``slopes[h] * (j - i)`` -- :class:`FlexKernel` emits torch's FlexAttention higher-order ops
(``flex_attention`` and, in training, ``flex_attention_backward``) into the joint graph.
Inductor lowers them to its Triton flex templates: block-sparse (a window skips the blocks
outside the band), no ``T x T`` tensor in memory, and no Python at run time. Calling flex from
inside an extern op instead runs it uncompiled (measured 31 ms vs 0.5 ms).

How: the fragment is traced the way Inductor traces its own training replacements
(``pattern_matcher.joint_fwd_bwd``: AOT Autograd's joint forward + backward of a function that
calls the HOP), on fake tensors of the graph's own fake mode. The block mask depends on the fixed
lengths only: it is built once at compile time (in closed form at block level for a band:
:func:`block_mask`) and enters the graph as constants. Its nodes are then copied into the graph:
forward nodes before the attention output, nodes that read the output gradient before the first
backward node, and its subgraphs (score_mod / mask_mod and their backward graphs) registered on
the graph's module. The HOPs have no safe path: the guard's reference runs them as they are.

Semantics: the causal / window band keeps key ``i`` for query ``i``, so no row is ever fully
masked, and ALiBi adds a finite bias: what flex computes is what the hand-written code computes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from .... import compat
from ....custom_ops.attention import band_mask_mod
from ....fx_utils import tensor_dtype, val
from ...manager import EnnPass, PassContext
from ..emitter import Emitter, Operands
from ..problem import AttentionProblem

if TYPE_CHECKING:
    from ..plan import Plan

BLOCK_MASK_ATTR = "enn_flex_block_mask"
SPARSE_BLOCK = 128  # FlexAttention's default sparse block size
_LOW = (torch.bfloat16, torch.float16)


def check_flex(p: AttentionProblem) -> tuple[bool, str]:
    if p.device == "cpu" and p.training:
        return False, "FlexAttention on CPU is inference-only (no backward)"
    if p.device not in ("cuda", "cpu"):
        return False, f"FlexAttention is used on CUDA (and CPU inference when asked for), device is {p.device}"
    if not p.static_shapes:
        return False, "flex's block mask is built for fixed sequence lengths (dynamic shapes here)"
    if p.dropout:
        return False, "FlexAttention has no dropout"
    if p.has_mask or p.has_bias:
        return False, "flex is used for structure only (causal / window / ALiBi slopes), not mask tensors"
    if not (p.window > 0 or p.alibi):
        return False, "no window or ALiBi for flex to exploit; SDPA's kernels take causal / no mask without a compile"
    if p.head_dim < 16 or p.head_dim & (p.head_dim - 1):
        return False, f"flex's Triton template wants a power-of-two head dim >= 16, have {p.head_dim}"
    return True, "FlexAttention in the graph: structure as score_mod / block_mask, Inductor's Triton flex kernels"


def block_mask(causal: bool, window: int, tq: int, tk: int, device: torch.device):
    """The BlockMask of a causal and/or sliding-window band, built in closed form at block level.

    ``create_block_mask`` evaluates the mask at every (query, key) position and reduces it to
    blocks: inside a graph that is dozens of ops over a T x T grid, run on every call and
    compiled as extra kernels. For a band the blocks follow from the block indices alone: block
    (m, n) holds queries [mB, mB + B) and keys [nB, nB + B), so its smallest and largest
    ``q - kv`` are ``(m - n)B -+ (B - 1)``; it is *full* when every pair is kept and *partial*
    (mask_mod applied inside) when some may be. Lengths that are not whole blocks use
    ``create_block_mask``.
    """
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    mask_mod = band_mask_mod(causal, window)
    if tq != tk or tq % SPARSE_BLOCK:
        return create_block_mask(mask_mod, None, None, tq, tk, device=device)
    nb = tq // SPARSE_BLOCK
    m = torch.arange(nb, device=device).view(nb, 1)
    n = torch.arange(nb, device=device).view(1, nb)
    lo = (m - n) * SPARSE_BLOCK - (SPARSE_BLOCK - 1)  # smallest q - kv in the block
    hi = (m - n) * SPARSE_BLOCK + (SPARSE_BLOCK - 1)  # largest
    some = torch.ones(nb, nb, dtype=torch.bool, device=device)
    full = torch.ones(nb, nb, dtype=torch.bool, device=device)
    if causal:
        some, full = some & (hi >= 0), full & (lo >= 0)
    if window > 0:
        some, full = some & (lo < window), full & (hi < window)
    partial = some & ~full
    kv_num, kv_idx = compat.flex_dense_to_ordered(partial.view(1, 1, nb, nb))
    full_num, full_idx = compat.flex_dense_to_ordered(full.view(1, 1, nb, nb))
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=SPARSE_BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(tq, tk))


def _alibi_score_mod(pos_dtype: Optional[torch.dtype], bias_dtype: Optional[torch.dtype]):
    """``score + slopes[h] * (j - i)``, rounded as the user's code rounds it: positions in
    ``pos_dtype`` (``rel.to(bf16)``) and the product in ``bias_dtype``; the sum is fp32.

    Rounded positions stay in ``pos_dtype`` into the product, as in the user's code (the fp32
    slope times them promotes): no cast back to fp32 follows the rounding cast, since Inductor's
    joint pattern ``pointless_convert`` folds an int -> bf16 -> fp32 chain into int -> fp32 on
    torch < 2.13, and the rounding with it."""

    def score_mod(score, b, h, q_idx, kv_idx, slopes):
        rel = kv_idx - q_idx
        rel = rel.to(pos_dtype) if pos_dtype is not None else rel.to(torch.float32)
        if bias_dtype is not None:
            return score + (slopes[h].to(bias_dtype) * rel.to(bias_dtype)).to(torch.float32)
        return score + slopes[h] * rel

    return score_mod


def _no_score_mod(score, b, h, q_idx, kv_idx):
    return score


def _fragment(q, k, v, slopes, block_mask_parts: tuple, scale: float, training: bool,
              pos_dtype: Optional[torch.dtype] = None, bias_dtype: Optional[torch.dtype] = None) -> fx.GraphModule:
    """Trace flex attention (forward, or forward + backward) on the given (fake) tensors.

    ``block_mask_parts`` is a ``BlockMask.as_tuple()``; its tensors become the fragment's inputs
    after ``q, k, v`` (then ``slopes``), so the caller decides where they come from.
    """
    flex_hop = compat.flex_attention_hop()
    options = compat.flex_kernel_options(q, k, v, training)
    options["OUTPUT_LOGSUMEXP"] = training  # the backward reads the forward's logsumexp
    slots = [i for i, x in enumerate(block_mask_parts) if isinstance(x, torch.Tensor)]

    def fn(q, k, v, *rest):
        parts = list(block_mask_parts)
        for i, t in zip(slots, rest):
            parts[i] = t
        rest = rest[len(slots):]
        if rest:
            out = flex_hop(q, k, v, _alibi_score_mod(pos_dtype, bias_dtype), tuple(parts), scale, options, (rest[0],), ())
        else:
            out = flex_hop(q, k, v, _no_score_mod, tuple(parts), scale, options, (), ())
        return out[0]

    args = [q, k, v] + [block_mask_parts[i] for i in slots] + ([slopes] if slopes is not None else [])
    if training:
        return compat.joint_fwd_bwd(fn, args)
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():  # decomposed like the graph it joins (Inductor's table)
        return make_fx(fn, decomposition_table=compat.select_decomp_table())(*args)


def _shared_operands(plan: "Plan") -> list[bool]:
    """For q, k, v as flex reads them: whether each must be copied to a buffer of its own first.

    Only on CPU under a torch whose flex lowering takes no two operands from one buffer
    (``compat.cpu_flex_needs_distinct_buffers``): an operand is copied when another one views the
    same storage (Inductor then names them one buffer). An operand cast to the matmul dtype
    (rewrite._operands) is a new buffer already.
    """
    if plan.problem.device != "cpu" or not compat.cpu_flex_needs_distinct_buffers():
        return [False] * 3
    m = plan.match
    refs = [StorageWeakRef(val(n).untyped_storage()) if tensor_dtype(n) == m.dtype else object()
            for n in (m.q, plan.k, plan.v)]
    return [refs.count(r) > 1 for r in refs]


def _fresh_attr(gm: torch.nn.Module, base: str) -> str:
    i = 0
    while hasattr(gm, f"{base}_{i}"):
        i += 1
    return f"{base}_{i}"


def fake_like(n: fx.Node, grad: bool) -> torch.Tensor:
    """A fresh tensor shaped and strided as ``n``'s value (made in the ambient fake mode)."""
    x = val(n)
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).requires_grad_(grad)


def splice_fragment(em: Emitter, frag: fx.GraphModule, inputs: list, grad_out: Optional[fx.Node] = None,
                    first_bwd: Optional[fx.Node] = None) -> list:
    """Copy a traced flex fragment into ``em``'s graph; its output nodes (None where it returns none).

    ``inputs`` feed the fragment's primal placeholders in order, ``grad_out`` its one tangent
    (training). Forward nodes go before ``em.before``, nodes that read the tangent before
    ``first_bwd``, and the fragment's subgraphs (score_mod / mask_mod and their backward graphs)
    are registered on the graph's module.
    """
    graph = em.graph
    gm = graph.owning_module
    if gm is None:
        raise RuntimeError("flex attention needs the graph's owning module (for its subgraphs)")
    places = [n for n in frag.graph.nodes if n.op == "placeholder"]
    tangents = [n for n in places if n.name.startswith("tangents")]
    primals = [n for n in places if n not in tangents]
    training = grad_out is not None
    if len(primals) != len(inputs) or len(tangents) != (1 if training else 0):
        raise RuntimeError(f"flex fragment has {len(primals)} inputs / {len(tangents)} tangents, "
                           f"expected {len(inputs)} / {int(training)}")
    env: dict = dict(zip(primals, inputs))
    if training:
        env[tangents[0]] = grad_out
    reads_grad = set(tangents)
    for n in frag.graph.nodes:
        if any(a in reads_grad for a in n.all_input_nodes):
            reads_grad.add(n)
    first_real = next(n for n in graph.nodes if n.op != "placeholder")
    for n in frag.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.op == "get_attr":  # score_mod / mask_mod and their backward graphs
            sub = getattr(frag, n.target)
            name = _fresh_attr(gm, f"enn_flex_{n.target}")
            if isinstance(sub, torch.nn.Module):
                gm.add_submodule(name, sub)
            else:  # pragma: no cover - tensors come in as inputs; no other constants
                gm.register_buffer(name, sub)
            with graph.inserting_before(first_real):
                env[n] = graph.get_attr(name)
            env[n].meta = dict(n.meta)
            em.tag(env[n])
            continue
        with graph.inserting_before(first_bwd if n in reads_grad else em.before):
            env[n] = em.tag(graph.node_copy(n, lambda x: env[x]))
    outs = next(n for n in frag.graph.nodes if n.op == "output").args[0]
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    return [env[o] if isinstance(o, fx.Node) else None for o in outs]


class FlexKernel:
    """Splices a traced flex fragment (forward, and backward in training) into the graph."""

    def __init__(self, em: Emitter, plan: "Plan", ops: Operands, grad_in: Optional[fx.Node]) -> None:
        self.em, self.plan, self.ops, self.grad_in = em, plan, ops, grad_in
        self.grads: Optional[list] = None

    @staticmethod
    def reason(plan: "Plan") -> str:
        why = "; emitted as FlexAttention ops in the graph (compiled by Inductor)"
        copied = [name for name, c in zip("qkv", _shared_operands(plan)) if c]
        if copied:
            why += (f"; {', '.join(copied)} copied to buffers of their own first (views of one buffer; "
                    "this torch's CPU flex lowering refuses them)")
        return why

    def forward(self) -> fx.Node:
        em, ops, st = self.em, self.ops, self.plan.structure
        slopes = em.cast(ops.alibi, torch.float32) if ops.alibi is not None else None
        # The bias as the user's code rounds it: positions (and the product) in the term's dtype.
        alibi = st.alibi
        bias_dtype = tensor_dtype(alibi.term) if alibi is not None else None
        rounded = alibi is not None and alibi.positions != "exact"
        out, self.grads = self._splice(slopes, pos_dtype=alibi.positions if rounded else None,
                                       bias_dtype=bias_dtype if bias_dtype in _LOW else None)
        return out

    def backward(self, g: fx.Node, before: fx.Node) -> list:
        return self.grads + [None]

    def _splice(self, slopes: Optional[fx.Node], pos_dtype: Optional[torch.dtype],
                bias_dtype: Optional[torch.dtype]) -> tuple[fx.Node, Optional[list]]:
        """Copy the traced fragment into the graph: (output node, [dq, dk, dv] or None)."""
        em, graph, mode = self.em, self.em.graph, self.em.mode
        q, k, v = (em.call(torch.ops.aten.clone.default, (n,)) if copy else n
                   for n, copy in zip((self.ops.q, self.ops.k, self.ops.v), _shared_operands(self.plan)))
        causal, window, scale = self.plan.structure.causal, int(self.plan.structure.window), float(self.plan.match.scale)
        grad_out, first_bwd = self.grad_in, self.plan.regions.first_backward
        training = grad_out is not None
        gm = graph.owning_module
        if gm is None:
            raise RuntimeError("flex attention needs the graph's owning module (for its subgraphs)")
        # The block mask depends on the (fixed) lengths only: built once here, it enters the graph
        # as constants. Built inside the graph it ran as ~5 kernels (sorts included) on every call.
        qv, kv = val(q), val(k)
        with compat.real_tensor_mode():
            parts = block_mask(causal, window, int(qv.shape[-2]), int(kv.shape[-2]), qv.device).as_tuple()
        first_real = next(n for n in graph.nodes if n.op != "placeholder")
        mask_inputs = []
        for t in (x for x in parts if isinstance(x, torch.Tensor)):
            name = _fresh_attr(gm, BLOCK_MASK_ATTR)
            gm.register_buffer(name, t)
            with graph.inserting_before(first_real):
                node = em.tag(graph.get_attr(name))
            node.meta["val"] = mode.from_tensor(t)
            # Inductor's fake-tensor propagation takes a real constant only through a lift
            # (as it does for the constants traced code makes); FlexConstantsPass drops it.
            mask_inputs.append(em.call(torch.ops.aten.lift_fresh_copy.default, (node,), before=first_real))
        with mode:
            fq, fk, fv = (fake_like(n, training) for n in (q, k, v))
            fs = fake_like(slopes, False) if slopes is not None else None
            fake_parts = tuple(mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in parts)
            frag = _fragment(fq, fk, fv, fs, fake_parts, scale, training, pos_dtype, bias_dtype)

        outs = splice_fragment(em, frag, [q, k, v] + mask_inputs + ([slopes] if slopes is not None else []),
                               grad_out, first_bwd)
        return outs[0], (outs[1:4] if training else None)


class FlexConstantsPass(EnnPass):
    """Post-grad: the flex block mask's constants are read directly, not through a copy.

    :class:`FlexKernel` puts each block-mask constant into the joint graph as
    ``lift_fresh_copy(get_attr)``, the only form Inductor's fake-tensor propagation (which runs
    between the joint and the post-grad stages) accepts for a real tensor. After it, the lift
    is a copy kernel on every call for nothing: this pass reads the constant instead.
    """

    name = "flex_constants"
    option = "attention"
    stage = "post_grad"

    def __call__(self, graph: fx.Graph, ctx: PassContext) -> int:
        count = 0
        for n in list(graph.nodes):
            src = n.args[0] if n.target is torch.ops.aten.lift_fresh_copy.default else None
            if isinstance(src, fx.Node) and src.op == "get_attr" and str(src.target).startswith(BLOCK_MASK_ATTR):
                n.replace_all_uses_with(src)
                graph.erase_node(n)
                count += 1
        return count
