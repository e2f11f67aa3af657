"""Causal / sliding-window attention with key padding, read from a ``finfo.min`` mask: :func:`take`
finds it, :class:`DeadRows` gives the rows that keep no key eager's values and gradients.

transformers' eager attention adds ``where(keep, 0, finfo.min)`` to the scores, ``keep`` the
conjunction of a causal (or sliding-window, or no) band and the ``[B, Tk]`` attention mask
(:func:`~.provenance.keep_structure` reads it back). A kernel takes that as its causal flag plus a
``[B, 1, 1, Tk]`` padding bias (:func:`padding_bias`: no T x T tensor, built once per call and
shared by every layer reading the same vector) and computes each query row that keeps a key
exactly as eager: a padded key gets weight ``exp(-huge) = 0`` in both.

A *dead* row keeps no key (the first rows of a left-padded sequence: keys up to the query are
padding, the later ones causal-masked). In eager ``finfo.min`` absorbs each of its scores
(fp32 / bf16: ``s + finfo.min == finfo.min``), so its softmax is uniform over *all* ``N = Tk``
keys, and its gradient flows through the absorbed add. The kernel drops the keys after the query
instead. With ``d_i`` the output gradient on dead rows (0 elsewhere), ``mV = mean_j V_j`` and
``c_i = d_i . mV``, eager's dead rows give (``S = scale * Q K^T + bias``)::

    out_i = mV
    dS_ij = (d_i . V_j - c_i) / N
    dQ_i  = scale / N * (d_i (V^T K) - c_i sum_j K_j)
    dK_j  = scale / N * (V_j (sum_i d_i^T Q_i) - sum_i c_i Q_i)
    dV_j  = 1 / N * sum_i d_i

all linear in T; the kernel's backward gets the output gradient with dead rows zeroed, so its
own terms for them vanish. Under grouped-query attention the query heads of a group are stacked
along the rows (``[B * Hkv, rep * Tq, D]``), so the K/V terms come out summed per K/V head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from ...custom_ops.attention import SATURATED, SATURATED_FLOOR, floors_saturated
from ...fx_utils import shape, tensor_dtype, val
from ..manager import ModuleState
from .emitter import Emitter
from .constants import Dims
from .masks import Structure
from .provenance import additive_mask_fill, keep_structure, magnitude_bound
from .match import Match

aten = torch.ops.aten
_ALIGN = 8  # the padding bias's rows start at multiples of this many elements (SDPA's bias alignment)
_SHARED = "enn_key_padding"  # node meta: what a node shared by every site reading one padding vector is
# The largest bias term kept beside a finfo.min mask: far below the spacing of finfo.min's
# neighbours (2**104 in fp32, 2**120 in bf16), which absorb it in eager, and below the kernel's
# SATURATED_FLOOR (-2**100), which still weighs a padded key 0 with it added.
ABSORBED = 2.0 ** 64


@dataclass(frozen=True)
class KeyPadding:
    """A site's ``finfo.min`` mask as structure: the band (now the Structure's flags) and the
    boolean ``[B, Tk]`` key-padding vector (key ``j`` of batch ``b`` kept where true)."""

    vector: fx.Node
    band: tuple[str, int]  # ('none'|'causal'|'window', w)

    def describe(self) -> str:
        kind, w = self.band
        flag = {"none": "no causal flag", "causal": "is_causal", "window": f"window {w}"}[kind]
        return (f"{flag} and a [B, 1, 1, Tk] key-padding bias read from the finfo.min mask's provenance "
                "(no T x T tensor); query rows that keep no key get eager's uniform row and its gradients "
                "in closed form")


def take(st: Structure, m: Match, dims: Dims, state: Optional[ModuleState]) -> tuple[Optional[KeyPadding], str]:
    """The key padding of a site whose only mask is an additive ``finfo.min`` mask of a band and
    a key-padding vector: the mask term leaves ``st`` and its band becomes ``st``'s flags.
    (None, why not) when the site has such a mask that cannot be taken; (None, "") when it has none.

    Other bias terms may stay beside it (BLOOM's ALiBi, ``slopes * positions`` counted from the
    attention mask) when each is bounded by :data:`ABSORBED`: eager's ``finfo.min`` then absorbs
    them on every masked key, so a dead row is still uniform over all keys, and a bounded term
    holds no gradient (:func:`~.provenance.magnitude_bound`), so DeadRows' closed form is whole."""
    if st.floors or st.keep or st.alibi is not None or st.causal or m.three_d:
        return None, ""
    masks = [(t, f) for t in st.bias if t.factor == 1.0 and (f := additive_mask_fill(t.node, state)) is not None]
    if len(masks) != 1:
        return None, ""
    term, fill = masks[0]
    for other in st.bias:
        if other is not term:
            bound = magnitude_bound(other.node)
            if bound is None or bound * abs(other.factor) > ABSORBED:
                return None, (f"a bias term beside the finfo.min mask ({other.node.name}) is not provably below "
                              "2**64 in magnitude: a row that keeps no key may not be uniform over all keys in eager")
    dtype = tensor_dtype(term.node)
    if fill == float("-inf") or fill > SATURATED or not floors_saturated(dtype):
        return None, (f"a fill of {fill:g} in {dtype} does not absorb the scores: a row that keeps no key is "
                      "not uniform over all keys in eager")
    batch = shape(m.q)[0]
    ks, why = keep_structure(term.node.args[0], dims, batch, state)
    if ks is None:
        return None, why
    if ks.key_padding is None:
        return None, "no key-padding vector"
    kind, w = ks.band
    if kind != "none" and dims.tq != dims.tk:
        return None, "causal mask with Tq != Tk (SDPA's causal is top-left aligned)"
    st.bias.remove(term)
    st.causal, st.window = kind != "none", (w if kind == "window" else 0)
    return KeyPadding(ks.key_padding, ks.band), ""


def _shared(em: Emitter, key: tuple, build: Any) -> fx.Node:
    """The node ``build()`` makes, made once per graph for ``key`` (the first site builds it)."""
    for n in em.graph.nodes:
        if n.meta.get(_SHARED) == key:
            return n
    node = build()
    node.meta[_SHARED] = key
    return node


def padding_bias(em: Emitter, kp: KeyPadding, dtype: torch.dtype) -> fx.Node:
    """``[B, 1, 1, Tk]`` in ``dtype``: 0 at kept keys, ``SATURATED_FLOOR`` at padded ones (fp16's
    lowest finite value in fp16, which cannot hold it: dead rows are fixed up either way). Its
    rows start at multiples of 8 elements (padded storage, sliced), as SDPA's kernels want."""
    vec = kp.vector
    b, tk = shape(vec)

    def build() -> fx.Node:
        like = {"dtype": dtype, "device": val(vec).device}
        low = SATURATED_FLOOR if floors_saturated(dtype) else torch.finfo(dtype).min
        v4 = em.call(aten.unsqueeze.default, (em.call(aten.unsqueeze.default, (vec, 1)), 1))
        return aligned(em, em.call(aten.where.self, (v4, em.call(aten.full.default, ([], 0.0), like),
                                                       em.call(aten.full.default, ([], low), like))))

    return _shared(em, ("bias", vec.name, str(dtype)), build)


def aligned(em: Emitter, bias: fx.Node) -> fx.Node:
    """``bias`` with its rows starting at multiples of 8 elements (padded storage, sliced back to
    ``Tk``), as SDPA's kernels want their bias."""
    tk = shape(bias)[-1]
    if tk % _ALIGN == 0:
        return bias
    padded = em.call(aten.constant_pad_nd.default, (bias, [0, -tk % _ALIGN], 0.0))
    return em.call(aten.slice.Tensor, (padded, len(shape(bias)) - 1, 0, tk))


def _dead(em: Emitter, kp: KeyPadding, tq: int) -> fx.Node:
    """Bool ``[B, 1, Tq, 1]`` (``[B, 1, 1, 1]`` without a band): the query rows that keep no key."""
    vec = kp.vector
    b, tk = shape(vec)
    kind, w = kp.band

    def build() -> fx.Node:
        if kind == "none":
            kept = em.call(aten.any.dim, (vec, 1, True))
            return em.call(aten.view.default, (em.call(aten.logical_not.default, (kept,)), [b, 1, 1, 1]))
        seen = em.call(aten.cumsum.default, (vec, 1), {"dtype": torch.int32})  # kept keys up to the query
        if kind == "window":  # minus those up to query - w: the kept keys in (i - w, i]
            shifted = em.call(aten.constant_pad_nd.default, (seen, [w, 0], 0))
            seen = em.call(aten.sub.Tensor, (seen, em.call(aten.slice.Tensor, (shifted, 1, 0, tk))))
        dead = em.call(aten.eq.Scalar, (seen, 0))
        return em.call(aten.unsqueeze.default, (em.call(aten.unsqueeze.default, (dead, 1)), 3))

    return _shared(em, ("dead", vec.name, kind, w, tq), build)


class DeadRows:
    """Eager's values and gradients on the dead rows of one site, around any kernel that takes the
    padding bias. ``q [B, Hq, Tq, D]``; ``k``, ``v``: the site's K/V with their own (``Hkv``) heads."""

    def __init__(self, em: Emitter, kp: KeyPadding, q: fx.Node, k: fx.Node, v: fx.Node, scale: float) -> None:
        self.em, self.q, self.k, self.v, self.scale = em, q, k, v, scale
        self.b, self.hq, self.tq, self.d = shape(q)
        _, self.hkv, self.tk, self.dv = shape(v)
        self.rep = self.hq // self.hkv
        self.dead = _dead(em, kp, self.tq)

    def _grouped(self, t: fx.Node, rows: int, before: Optional[fx.Node]) -> fx.Node:
        """``t`` in fp32 as ``[B * Hkv, rows, last]``: the query heads of a group stacked along the rows."""
        em = self.em
        f = em.call(aten.clone.default, (em.cast(t, torch.float32, before),), {"memory_format": torch.contiguous_format},
                    before=before)
        return em.call(aten.view.default, (f, [self.b * self.hkv, rows, shape(t)[-1]]), before=before)

    def _per_query_head(self, t: fx.Node, before: Optional[fx.Node]) -> fx.Node:
        """``[B * Hkv, 1, X]`` -> ``[B, Hq, 1, X]`` (query head ``h`` reads K/V head ``h // rep``)."""
        em, x = self.em, shape(t)[-1]
        t5 = em.call(aten.view.default, (t, [self.b, self.hkv, 1, 1, x]), before=before)
        t5 = em.call(aten.expand.default, (t5, [self.b, self.hkv, self.rep, 1, x]), before=before)
        t5 = em.call(aten.clone.default, (t5,), {"memory_format": torch.contiguous_format}, before=before)
        return em.call(aten.view.default, (t5, [self.b, self.hq, 1, x]), before=before)

    def forward(self, out: fx.Node) -> fx.Node:
        """The kernel's output with dead rows replaced by ``mean_j V_j`` (eager's uniform row)."""
        em = self.em
        mean_v = em.call(aten.mean.dim, (self._grouped(self.v, self.tk, None), [1], True))
        mean_v = em.cast(self._per_query_head(mean_v, None), tensor_dtype(out))
        return em.call(aten.where.self, (self.dead, mean_v, out))

    def kernel_grad(self, g: fx.Node, before: fx.Node) -> fx.Node:
        """The output gradient the kernel's backward gets: dead rows zeroed."""
        zero = self.em.call(aten.full.default, ([], 0.0), {"dtype": tensor_dtype(g), "device": val(g).device},
                            before=before)
        return self.em.call(aten.where.self, (self.dead, zero, g), before=before)

    def grads(self, g: fx.Node, dq: fx.Node, dk: fx.Node, dv: fx.Node, before: fx.Node) -> list[fx.Node]:
        """The kernel's ``dq`` / ``dk`` / ``dv`` (K/V gradients with ``Hkv`` heads) plus the dead rows'."""
        em, b, hkv, n = self.em, self.b, self.hkv, self.tk

        def call(target: Any, *args: Any, **kwargs: Any) -> fx.Node:
            return em.call(target, args, kwargs, before=before)

        zero = call(aten.full.default, [], 0.0, dtype=torch.float32, device=val(g).device)
        d = self._grouped(call(aten.where.self, self.dead, em.cast(g, torch.float32, before), zero),
                          self.rep * self.tq, before)  # [BG, rep * Tq, Dv]
        q3 = self._grouped(self.q, self.rep * self.tq, before)
        k3, v3 = self._grouped(self.k, n, before), self._grouped(self.v, n, before)
        mean_v = call(aten.mean.dim, v3, [1], True)
        c = call(aten.sum.dim_IntList, call(aten.mul.Tensor, d, mean_v), [2], True)  # [BG, rep * Tq, 1]
        s = self.scale / n
        vk = call(aten.bmm.default, call(aten.permute.default, v3, [0, 2, 1]), k3)  # [BG, Dv, D]
        k_sum = call(aten.sum.dim_IntList, k3, [1], True)
        ddq = call(aten.sub.Tensor, call(aten.bmm.default, d, vk), call(aten.mul.Tensor, c, k_sum))
        dq_extra = call(aten.view.default, call(aten.mul.Tensor, ddq, s), [b, self.hq, self.tq, self.d])
        dtq = call(aten.bmm.default, call(aten.permute.default, d, [0, 2, 1]), q3)  # [BG, Dv, D]
        cq = call(aten.sum.dim_IntList, call(aten.mul.Tensor, c, q3), [1], True)
        ddk = call(aten.sub.Tensor, call(aten.bmm.default, v3, dtq), cq)
        dk_extra = call(aten.view.default, call(aten.mul.Tensor, ddk, s), [b, hkv, n, self.d])
        d_sum = call(aten.sum.dim_IntList, d, [1], True)  # [BG, 1, Dv]
        dv_extra = call(aten.expand.default, call(aten.div.Tensor, d_sum, float(n)), [b * hkv, n, self.dv])
        dv_extra = call(aten.view.default, dv_extra, [b, hkv, n, self.dv])
        return [em.cast(call(aten.add.Tensor, em.cast(got, torch.float32, before), extra), tensor_dtype(got), before)
                for got, extra in ((dq, dq_extra), (dk, dk_extra), (dv, dv_extra))]
