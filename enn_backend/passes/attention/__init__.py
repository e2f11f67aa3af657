"""Attention pass: hand-written ``softmax(Q Kᵀ · s + bias, masked) V`` -> one fused attention.

Per ``bmm`` of the joint graph (training: forward + backward; inference: forward only):
:func:`~.match.match_at` recognizes the attention, :func:`~.plan.plan_site` decides everything
(masks, regions, kernel) before the first edit, and :func:`~.rewrite.rewrite` emits the plan's
kernel (``kernels/``). Layout and how to add a pattern family or a kernel: ../README.md.

Attention dropout (``F.dropout`` / ``nn.Dropout`` on the probabilities) is fused with the kernel's
own dropout. RNG semantics: the kernel draws its own random stream (SDPA's philox on CUDA; in
``enn::attention`` a mask drawn from a seed the graph draws, drawn again by the backward), so with
dropout on the results equal eager's in distribution, not bitwise -- Inductor's own dropout does
not reproduce eager's stream either. With dropout off (``p = 0``, eval mode) the graph holds no
dropout and the results are exactly as before. Every site that looks like attention and is not
fused gets a report line with the reason (a ``kernel_choice`` or a ``pass_skipped`` fallback).
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from ... import compat
from ... import custom_ops  # noqa: F401  (registers the enn ops the pass emits)
from ...custom_ops.attention import Backend
from ...report import FallbackKind
from ...fx_utils import fake_mode, is_call
from ..manager import EnnPass, PassContext, current_module_state
from .match import Skip, Unread, match_at
from .plan import Plan, plan_site
from .regions import is_backward
from .rewrite import rewrite
from .sdpa_calls import replan_sdpa_calls

aten = torch.ops.aten


class AttentionPass(EnnPass):
    """Fuse hand-written attention: SDPA's ATen kernels, FlexAttention ops, or ``enn::attention``."""

    name = "attention"
    option = "attention"
    # joint_pre: before Inductor's own fuse_attention takes the patterns it knows (with other
    # masked-row semantics); joint: again after Inductor's clean-up, for what only matches
    # once constants are folded. A fused site has no bmm left: no double match.
    stage = ("joint_pre", "joint")

    def __call__(self, graph: fx.Graph, ctx: PassContext) -> int:
        if any(is_call(n, aten.alias.default) for n in graph.nodes):
            compat.remove_noop_ops(graph)  # as a joint *pre* pass: Inductor runs this right after anyway
        mode = fake_mode(graph)
        count = 0
        self._draws: list[fx.Node] = []
        for n in list(graph.nodes):
            if n.graph is not graph or not is_call(n, aten.bmm.default) or is_backward(n):
                continue
            try:
                try:
                    m = match_at(n)
                except Unread:
                    if ctx.stage != self.stages()[-1]:
                        continue  # the last stage may read it once Inductor's clean-up ran, or says why not
                    raise
                if m is None:
                    continue
                if mode is None:
                    raise Skip("graph has no fake tensors to compute metadata from")
                count += self._fuse(graph, plan_site(graph, m, self.opts), mode, ctx)
            except Skip as why:
                reason = f"attention at {n.name} not fused: {why}"
                if ctx.once(reason):  # the pass runs at two stages, and a site it leaves is there at both
                    ctx.fallback(FallbackKind.PASS_SKIPPED, [n], reason=reason, action="left as written",
                                 level=logging.INFO)
        replanned = replan_sdpa_calls(graph, mode, ctx) if mode is not None else 0
        if count or replanned:
            graph.eliminate_dead_code()
            live = set(graph.nodes)
            for draw in self._draws:  # a random op may count as impure: dead-code elimination may keep it
                if draw in live and not draw.users:
                    graph.erase_node(draw)
            graph.eliminate_dead_code()
            compat.stable_topological_sort(graph)
            graph.lint()
        return count + replanned

    def _fuse(self, graph: fx.Graph, plan: Plan, mode: object, ctx: PassContext) -> int:
        out, choice = plan.match.out, plan.choice
        if choice.forced_failed:
            ctx.fallback(FallbackKind.KERNEL_CHOICE, [out], reason=choice.forced_failed,
                         action=f"using {choice.backend} ({choice.reason})", level=logging.WARNING)
        tensors = {"mask_tensor": plan.provenance} if plan.provenance else {}
        tensors.update(choice.measured())
        if choice.backend is Backend.INDUCTOR:
            ctx.kernel_choice(out, choice.backend.value, choice.reason, fused=False, **tensors)
            return 0
        if plan.refusal:
            raise Skip(plan.refusal)
        rewrite(graph, plan, mode)
        if plan.match.dropout is not None:
            self._draws.append(plan.match.dropout.draw)
        reason = choice.reason + plan.kernel.reason(plan)
        state, st = current_module_state(), plan.structure
        for index, value in st.relied:
            state.assume(index, value)
            reason += (f"; mask buffer (input {index}) checked {'causal' if st.causal else 'structural'} at compile "
                       "time, its content guarded per call")
        p = plan.problem
        if plan.provenance:
            reason += f"; mask tensor kept materialized, read from its provenance as: {plan.provenance}"
            if plan.padding_refused or "finfo.min fill" in plan.provenance:
                reason += (" (not taken as flags + key padding: "
                           f"{plan.padding_refused or 'the site has other mask or bias terms besides it'})")
        ctx.kernel_choice(out, choice.backend.value, reason, causal=st.causal, window=st.window,
                          gqa=p.heads_q != p.heads_kv, mask=p.has_mask, bias=p.has_bias, alibi=p.alibi,
                          key_padding=p.key_padding, training=bool(plan.regions.grads), dropout=p.dropout, **tensors)
        ctx.fusion("attention")
        return 1
