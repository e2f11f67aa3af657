"""Mask structure from provenance: the masks ``transformers`` 5 builds (``masking_utils``: causal
``arange`` compares, ``and_masks``, ``padding_mask_function`` on the ``[B, T]`` attention mask,
sliding windows, ``finfo.min`` fills on the eager path, boolean masks on the SDPA path), read
back to a structure by the attention pass. CPU, tiny models (2 layers, T=16), pass harness:
the structure each site gets, and values and gradients equal to eager's, left padding and its
fully masked query rows included. Near misses keep their mask tensor, with the reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attention_cases import B, CPU_FLASH, CPU_FLASH_BWD, H, T, enn, qkv
from pass_harness import find_ops, run_passes

transformers = pytest.importorskip("transformers")

from _hf import Logits as _Logits, no_dropout  # noqa: E402
from enn_backend.passes.attention.sdpa_calls import SDPA_OPS  # noqa: E402

LAYERS, SEQ, PADDED = 2, 16, 5


@pytest.fixture(autouse=True)
def _fuse_tiny(monkeypatch):
    """Tiny CPU attention is left to Inductor by default; this order makes enn fuse eager sites."""
    monkeypatch.setenv("ENN_ATTENTION_ORDER", "flash,explicit")


def _model(family: str, impl: str, window: int = 0) -> torch.nn.Module:
    cfg = dict(num_hidden_layers=LAYERS, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, vocab_size=128, max_position_embeddings=64, pad_token_id=0,
               attn_implementation=impl)
    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    elif family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**cfg, sliding_window=window or None))
    else:
        extra = dict(use_sliding_window=True, sliding_window=window, max_window_layers=0) if window else {}
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg, **extra))
    model.config.use_cache = False
    no_dropout(model)
    return model.train()


def _left_padded(seq: int = SEQ) -> torch.Tensor:
    """Batched generation's layout: the second prompt padded on the left."""
    mask = torch.ones(B, seq, dtype=torch.long)
    mask[1, :PADDED] = 0
    return mask


def _run(family: str, impl: str, padded: bool, window: int = 0, mask: torch.Tensor | None = None):
    """The pass on the model's training graph; values and gradients checked against eager.
    ``mask``: the attention mask (default: left padding when ``padded``)."""
    model = _model(family, impl, window)
    mask = _left_padded() if padded and mask is None else mask
    ids = torch.randint(3, 128, (B, SEQ if mask is None else mask.shape[1]))
    args = [ids]
    if mask is not None:
        args = [ids.masked_fill(mask == 0, 0), mask]
    run = run_passes(_Logits(model), args, ["attention"], training=True)
    run.check_eager()  # the logits of every position (padded rows too) and every parameter's gradient
    return run


def _sdpa_choices(run) -> list[dict]:
    return [c for c in run.choices if c.get("sdpa_call")]


# ----------------------------------------------------------------------------- the model's own SDPA calls
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hf_sdpa_causal_mask_becomes_the_causal_flag(family):
    run = _run(family, "sdpa", padded=False)
    got = _sdpa_choices(run)
    assert len(got) == LAYERS and all(c["causal"] and not c["key_padding"] for c in got), got
    for n in find_ops(run.after, CPU_FLASH) + find_ops(run.after, CPU_FLASH_BWD):
        assert n.kwargs["attn_mask"] is None and True in (n.args[4:] + tuple(n.kwargs.values())), n.format_node()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_hf_sdpa_left_padding_becomes_causal_flag_and_a_key_padding_vector(family):
    """No T x T mask reaches the kernel: a [B, 1, 1, Tk] mask from the attention mask, broadcast as
    a view and shared by both layers; the padded query rows (every key masked) equal eager's."""
    run = _run(family, "sdpa", padded=True)
    got = _sdpa_choices(run)
    assert len(got) == LAYERS and all(c["causal"] and c["key_padding"] for c in got), got
    masks = {n.kwargs["attn_mask"] for n in find_ops(run.after, CPU_FLASH) + find_ops(run.after, CPU_FLASH_BWD)}
    (mask,) = masks  # one mask for every layer, forward and backward
    assert mask.target is torch.ops.aten.expand.default
    assert tuple(mask.args[0].meta["val"].shape) == (B, 1, 1, SEQ)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_hf_sdpa_sliding_window_keeps_its_mask_with_the_reason(family):
    run = _run(family, "sdpa", padded=False, window=4)
    got = _sdpa_choices(run)
    assert len(got) == LAYERS and all("window 4: the kernel has no sliding-window flag" in c["reason"]
                                      for c in got), got


# ----------------------------------------------------------------------------- eager attention (finfo.min masks)
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_hf_eager_causal_mask_becomes_the_causal_flag(family):
    """The mask is ``where(causal, tensor(0.0), finfo.min)``: a constant, folded to the flag."""
    run = _run(family, "eager", padded=False)
    got = [c for c in run.choices if c["choice"] == "cpu_flash"]
    assert len(got) == LAYERS and all(c["causal"] and not c["bias"] for c in got), got
    assert all(n.kwargs["attn_mask"] is None for n in find_ops(run.after, CPU_FLASH))


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_hf_eager_sliding_window_becomes_a_window_flag(family):
    run = _run(family, "eager", padded=False, window=4)
    got = [c for c in run.choices if c.get("fused", True) and not c.get("sdpa_call")]
    assert len(got) == LAYERS and all(c["causal"] and c["window"] == 4 and not c["bias"] for c in got), got
    assert len(find_ops(run.after, enn.attention)) == LAYERS


def _square(graph, t: int) -> list[str]:
    """The nodes holding a ``[.., t, t]`` tensor in memory: a materialized mask (or scores), not a
    broadcast of a smaller one (stride 0 along the query axis)."""
    return [n.format_node() for n in graph.nodes if isinstance(v := n.meta.get("val"), torch.Tensor)
            and v.dim() >= 2 and tuple(v.shape[-2:]) == (t, t) and v.stride(-2) != 0]


def _padding_bias(node) -> torch.fx.Node:
    """The [B, 1, 1, Tk] tensor a kernel's bias argument is a broadcast of."""
    while node.target in (torch.ops.aten.expand.default, torch.ops.aten.slice.Tensor,
                          torch.ops.aten.constant_pad_nd.default):
        node = node.args[0]
    return node


# 13 keys: not a multiple of 8 (the bias is laid out aligned), and no head dim (16) equals it
PADDED_SEQ = 13


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_hf_eager_padding_becomes_causal_flag_and_a_key_padding_bias(family, side):
    """Eager's ``where(causal & padding, 0, finfo.min)`` reaches the kernel as is_causal plus a
    [B, 1, 1, Tk] bias shared by both layers, forward and backward: no T x T tensor is left in the
    graph. Left padding makes the first query rows of the padded sequence keep no key: eager's
    softmax is uniform over all keys there, and its gradient flows through the absorbed scores;
    _run checks every logit (those rows' too) and every gradient against eager's."""
    mask = torch.ones(B, PADDED_SEQ, dtype=torch.long)
    mask[1, slice(0, PADDED) if side == "left" else slice(PADDED_SEQ - PADDED, PADDED_SEQ)] = 0
    run = _run(family, "eager", padded=True, mask=mask)
    got = [c for c in run.choices if c["choice"] == "cpu_flash"]
    assert len(got) == LAYERS and all(c["causal"] and c["key_padding"] and "mask_tensor" not in c for c in got), got
    assert all("key-padding bias" in c["reason"] for c in got), got
    kernels = find_ops(run.after, CPU_FLASH) + find_ops(run.after, CPU_FLASH_BWD)
    assert len(kernels) == 2 * LAYERS and all(n.args[4 if n.target is CPU_FLASH else 7] for n in kernels)
    (bias,) = {_padding_bias(n.kwargs["attn_mask"]) for n in kernels}
    assert tuple(bias.meta["val"].shape) == (B, 1, 1, PADDED_SEQ), bias.format_node()
    assert not _square(run.after, PADDED_SEQ)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_hf_eager_sliding_window_with_padding_becomes_a_window_flag_and_a_key_padding_bias(family):
    """A window of 4 and a padding vector with a hole: query 9 of batch 0 keeps no key in its window
    (keys 6..9 are padding, though keys 0..5 are not) -- a dead row a causal count would miss --
    and the left-padded batch 1 starts with dead rows."""
    mask = torch.ones(B, PADDED_SEQ, dtype=torch.long)
    mask[0, 6:10] = 0
    mask[1, :PADDED] = 0
    run = _run(family, "eager", padded=True, window=4, mask=mask)
    got = [c for c in run.choices if c.get("fused", True) and not c.get("sdpa_call")]
    assert len(got) == LAYERS and all(c["causal"] and c["window"] == 4 and c["key_padding"] for c in got), got
    ops = find_ops(run.after, enn.attention) + find_ops(run.after, enn.attention_backward)
    assert len(ops) == 2 * LAYERS
    (bias,) = {_padding_bias(n.args[3 if n.target is enn.attention.default else 4]) for n in ops}
    assert tuple(bias.meta["val"].shape) == (B, 1, 1, PADDED_SEQ), bias.format_node()
    assert not _square(run.after, PADDED_SEQ)


class _AutocastLogits(_Logits):
    def forward(self, ids, mask=None):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return super().forward(ids, mask)


CUDNN = torch.ops.aten._scaled_dot_product_cudnn_attention.default
EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention.default
CUDNN_BWD = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
EFFICIENT_BWD = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("order", ["cudnn,efficient", "efficient,explicit"], ids=["cudnn", "efficient"])
@pytest.mark.parametrize("seq", [24, PADDED_SEQ])
def test_hf_eager_left_padding_on_cuda_runs_a_causal_kernel_with_a_key_padding_bias(seq, order, monkeypatch):
    """HF LLaMA eager, left padding, bf16 autocast, the CUDA kernels in the default order (named:
    at this size the default policy leaves padded attention to Inductor, policy.CUDA_MIN_PADDING_SCORES)
    and with the memory-efficient kernel first:
    cuDNN (Hopper) or memory-efficient attention with is_causal and the [B, 1, 1, Tk] bias (13
    keys: its rows laid out at multiples of 8 elements), no T x T tensor in the graph; the mask's
    constants read as on the CPU; logits -- the padded query rows, which keep no key, included --
    and every gradient equal eager's, and as close to an fp32 run as eager's (an H100's numbers per
    kernel, padded and not: bench/results/gpu-h100/key_padding_accuracy.log)."""
    monkeypatch.setenv("ENN_ATTENTION_ORDER", order)
    model = _AutocastLogits(_model("llama", "eager").cuda())
    mask = torch.ones(B, seq, dtype=torch.long, device="cuda")
    mask[1, :PADDED] = 0
    ids = torch.randint(3, 128, (B, seq), device="cuda").masked_fill(mask == 0, 0)
    run = run_passes(model, [ids, mask], ["attention"], training=True)
    got = [c for c in run.choices if not c.get("sdpa_call")]
    assert len(got) == LAYERS and all(c["choice"] in ("cudnn", "efficient") and c["causal"] and c["key_padding"]
                                      and "mask_tensor" not in c for c in got), got
    if order.startswith("efficient"):
        assert {c["choice"] for c in got} == {"efficient"}, got
    kernels = find_ops(run.after, CUDNN) + find_ops(run.after, EFFICIENT)
    assert len(kernels) == LAYERS and all(n.args[6] is True for n in kernels), [n.format_node() for n in kernels]
    assert tuple(_padding_bias(kernels[0].args[3]).meta["val"].shape) == (B, 1, 1, seq)
    assert not _square(run.after, seq)
    with torch.no_grad():
        want = model(ids, mask)
    torch.testing.assert_close(run.output[1, :PADDED].float(), want[1, :PADDED].float(), atol=3e-2, rtol=3e-2)
    _assert_as_close_to_fp32_as_eager(model, run, ids, mask)


def _assert_as_close_to_fp32_as_eager(model, run, ids, mask, fp32=None) -> None:
    """Gradients under bf16 autocast differ from eager's by bf16 rounding (on the order of 0.4 here,
    with or without padding, whichever kernel): judged against the same model run in fp32
    (``fp32``, default: the model without its autocast wrapper), enn must be about as close as
    eager is (bench/results/gpu-h100/key_padding_accuracy.log: both, per kernel)."""
    wrt = [p for p in model.parameters() if p.requires_grad]
    g = torch.randn(run.output.shape, generator=torch.Generator().manual_seed(0)).to(run.output.device)
    ref_out = (fp32 or _Logits(model.model))(ids, mask)
    eager_out = model(ids, mask)
    results = {name: (out, torch.autograd.grad(out, wrt, g.to(out.dtype)))
               for name, out in (("enn", run.output), ("eager", eager_out), ("fp32", ref_out))}
    ref = results.pop("fp32")
    err = {name: max([(out.float() - ref[0]).abs().max().item()]
                     + [(a.float() - r).abs().max().item() for a, r in zip(grads, ref[1])])
           for name, (out, grads) in results.items()}
    assert err["enn"] <= 2 * err["eager"] + 1e-3, err


def _cuda_sdpa_kernels(graph) -> list:
    return find_ops(graph, CUDNN) + find_ops(graph, EFFICIENT) + find_ops(graph, CUDNN_BWD) + find_ops(graph, EFFICIENT_BWD)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hf_sdpa_causal_mask_on_cuda_becomes_the_causal_flag(family, monkeypatch):
    """HF's SDPA path on CUDA hands cuDNN (or memory-efficient) attention its materialized
    ``where(mask, 0, fill)`` bias; read back as a causal band, the kernel gets is_causal and no
    bias tensor, forward and backward, and no T x T tensor is left."""
    monkeypatch.delenv("ENN_ATTENTION_ORDER")
    model = _AutocastLogits(_model(family, "sdpa").cuda())
    ids = torch.randint(3, 128, (B, 24), device="cuda")
    run = run_passes(model, [ids], ["attention"], training=True)
    got = _sdpa_choices(run)
    assert len(got) == LAYERS and all(c["causal"] and not c["key_padding"] for c in got), got
    kernels = _cuda_sdpa_kernels(run.after)
    assert len(kernels) == 2 * LAYERS, [n.format_node() for n in kernels]
    for n in kernels:
        fwd = SDPA_OPS.get(n.target)
        op = fwd or next(o for o in SDPA_OPS.values() if o.backward is n.target)
        mask, causal = (op.mask, op.causal) if fwd else (op.backward_mask, op.backward_causal)
        assert mask.get(n) is None and causal.get(n) is True, n.format_node()
    assert not _square(run.after, 24)
    _assert_as_close_to_fp32_as_eager(model, run, ids, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hf_sdpa_left_padding_on_cuda_keeps_its_mask_with_the_reason(monkeypatch):
    """With left padding the first query rows keep no key; the CUDA kernels weigh such a row by its
    raw scores over every key when the mask holds a finite fill, which a causal flag would change:
    the mask stays, with the reason, and the result is eager's."""
    monkeypatch.delenv("ENN_ATTENTION_ORDER")
    model = _AutocastLogits(_model("qwen2", "sdpa").cuda())
    mask = torch.ones(B, 24, dtype=torch.long, device="cuda")
    mask[1, :PADDED] = 0
    ids = torch.randint(3, 128, (B, 24), device="cuda").masked_fill(mask == 0, 0)
    run = run_passes(model, [ids, mask], ["attention"], training=True)
    got = _sdpa_choices(run)
    assert len(got) == LAYERS and all("keeps no key" in c["reason"] for c in got), got
    with torch.no_grad():
        torch.testing.assert_close(run.output.float(), model(ids, mask).float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hf_sdpa_left_padding_inference_on_cuda_runs_flex_with_eager_values(monkeypatch):
    """Batched generation's prefill: HF's SDPA call with left padding, compiled by enn through
    Inductor, runs FlexAttention with the padding block mask; every position's logits (the padded
    rows, which cuDNN weighs over every key, included) equal eager's."""
    import enn_backend

    monkeypatch.delenv("ENN_ATTENTION_ORDER")
    model = _AutocastLogits(_model("qwen2", "sdpa").cuda().eval())
    seq = 256  # whole flex blocks
    mask = torch.ones(B, seq, dtype=torch.long, device="cuda")
    mask[1, :PADDED * 20] = 0
    ids = torch.randint(3, 128, (B, seq), device="cuda").masked_fill(mask == 0, 0)
    enn_backend.reset()
    with torch.no_grad():
        want = model(ids, mask)
        got = torch.compile(model, backend="enn")(ids, mask)
    choices = [c for g in enn_backend.report().to_dict()["graphs"] for c in g["kernel_choices"]]
    assert [c["choice"] for c in choices if c.get("sdpa_call")] == ["flex"] * LAYERS, choices
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got[1, :PADDED * 20].float(), want[1, :PADDED * 20].float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hf_sdpa_left_padding_on_the_efficient_kernel_takes_the_causal_flag(monkeypatch):
    """Where SDPA dispatches to the memory-efficient kernel (GPUs without cuDNN attention, or as
    asked here), a row that keeps no key is zeros under the mask and under the causal flag alike:
    training gets is_causal and the [B, 1, 1, Tk] padding mask, forward and backward, and stays as
    close to an fp32 run as eager."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    monkeypatch.delenv("ENN_ATTENTION_ORDER")
    model = _AutocastLogits(_model("qwen2", "sdpa").cuda())
    mask = torch.ones(B, 24, dtype=torch.long, device="cuda")
    mask[1, :PADDED] = 0
    ids = torch.randint(3, 128, (B, 24), device="cuda").masked_fill(mask == 0, 0)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        run = run_passes(model, [ids, mask], ["attention"], training=True)
        got = _sdpa_choices(run)
        assert len(got) == LAYERS and all(c["causal"] and c["key_padding"] and c["choice"] == "efficient"
                                          for c in got), got
        kernels = find_ops(run.after, EFFICIENT) + find_ops(run.after, EFFICIENT_BWD)
        assert len(kernels) == 2 * LAYERS and not _square(run.after, 24)
        with torch.no_grad():
            torch.testing.assert_close(run.output.float(), model(ids, mask).float(), atol=3e-2, rtol=3e-2)
        _assert_as_close_to_fp32_as_eager(model, run, ids, mask)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hf_bert_sdpa_padding_on_cuda_becomes_a_broadcast_padding_mask(monkeypatch):
    """An encoder's padding mask (no band) reaches the kernel as a [B, 1, 1, Tk] mask broadcast as
    a view, with the same fill at the same keys: every row equals what the model computes."""
    from _hf import build

    monkeypatch.delenv("ENN_ATTENTION_ORDER")
    model, kwargs = build("bert", "sdpa", device="cuda")

    encoder = _AutocastLogits(model)
    ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
    run = run_passes(encoder, [ids, mask], ["attention"], training=True)
    got = _sdpa_choices(run)
    assert got and all(c.get("key_padding") and not c["causal"] for c in got), got
    kernels = _cuda_sdpa_kernels(run.after)
    masks = set()
    for n in kernels:
        fwd = SDPA_OPS.get(n.target)
        op = fwd or next(o for o in SDPA_OPS.values() if o.backward is n.target)
        masks.add(_padding_bias((op.mask if fwd else op.backward_mask).get(n)))
    (mask,) = masks  # one [B, 1, 1, Tk] mask for every layer, forward and backward
    assert tuple(mask.meta["val"].shape) == (ids.shape[0], 1, 1, ids.shape[1]), mask.format_node()
    with torch.no_grad():
        torch.testing.assert_close(run.output.float(), encoder(ids, kwargs["attention_mask"]).float(), atol=3e-2, rtol=3e-2)
    _assert_as_close_to_fp32_as_eager(encoder, run, ids, kwargs["attention_mask"], fp32=_Logits(model))


# ----------------------------------------------------------------------------- near misses
def _indices():
    b = torch.arange(B)[:, None, None, None]
    i = torch.arange(T)[None, None, :, None]
    j = torch.arange(T)[None, None, None, :]
    return b, i, j


def _left_padding() -> torch.Tensor:
    pad = torch.ones(B, T, dtype=torch.long)
    pad[1, :3] = 0
    return pad


def hf_causal_padding(q, k, v, pad):
    """masking_utils' non-vmap expansion: and_masks(causal, padding_mask_function(pad))."""
    b, i, j = _indices()
    keep = torch.ones((), dtype=torch.bool) & (j <= i) & pad.bool()[b, j]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep.expand(B, -1, T, T))


def padding_by_query(q, k, v, pad):
    b, i, j = _indices()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=((j <= i) & pad.bool()[b, i]).expand(B, -1, T, T))


def segment_ids(q, k, v, pad):
    """A packed-sequence mask: depends on data other than a key-padding vector."""
    b, i, j = _indices()
    seg = pad.cumsum(-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=((j <= i) & (seg[b, i] == seg[b, j])).expand(B, -1, T, T))


def future_window(q, k, v, pad):
    """A band on the wrong side of the diagonal: keys i <= j < i + 3."""
    b, i, j = _indices()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=((j >= i) & (j < i + 3) & pad.bool()[b, j]).expand(B, -1, T, T))


def causal_or_padding(q, k, v, pad):
    b, i, j = _indices()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=((j <= i) | pad.bool()[b, j]).expand(B, -1, T, T))


def test_hand_built_hf_mask_is_recognized():
    run = run_passes(hf_causal_padding, [*qkv(), _left_padding()], ["attention"], training=True)
    (c,) = run.choices
    assert c["causal"] and c["key_padding"], c
    run.check_eager()


@pytest.mark.parametrize("fn, why", [
    (padding_by_query, "indexed by query position"),
    (segment_ids, "depends on tensors other than a key-padding vector"),
    (future_window, "neither causal nor a sliding window"),
    (causal_or_padding, "depends on tensors other than a key-padding vector"),
])
def test_near_misses_keep_their_mask_with_a_reason(fn, why):
    run = run_passes(fn, [*qkv(), _left_padding()], ["attention"], training=True)
    (c,) = run.choices
    assert "keeps its materialized mask" in c["reason"] and why in c["reason"], c
    assert all(n.kwargs["attn_mask"] is not None for n in find_ops(run.after, CPU_FLASH))
    run.check_eager()


def test_hf_sdpa_left_padding_inference_graph():
    model = _model("llama", "sdpa").eval()
    mask = torch.ones(B, SEQ, dtype=torch.long)
    mask[1, :PADDED] = 0
    ids = torch.randint(3, 128, (B, SEQ)).masked_fill(mask == 0, 0)
    run = run_passes(_Logits(model), [ids, mask], ["attention"], training=False)
    got = _sdpa_choices(run)
    assert len(got) == LAYERS and all(c["causal"] and c["key_padding"] and not c["training"] for c in got), got
    run.check_eager()


def _eager_attention(keep, q, k, v):
    """transformers' eager path: scores + where(keep, 0, finfo.min), softmax, @ V."""
    bias = torch.where(keep, torch.tensor(0.0), torch.finfo(torch.float32).min)
    return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + bias, dim=-1) @ v


def hf_eager_causal_padding(q, k, v, pad):
    b, i, j = _indices()
    return _eager_attention((j <= i) & pad.bool()[b, j], q, k, v)


def eager_segment_ids(q, k, v, pad):
    b, i, j = _indices()
    seg = pad.cumsum(-1)
    return _eager_attention((j <= i) & (seg[b, i] == seg[b, j]), q, k, v)


def hf_eager_causal_padding_neg_inf(q, k, v, pad):
    """The same mask with a -inf fill: rows that keep no key are NaN in eager, not uniform."""
    b, i, j = _indices()
    bias = torch.where((j <= i) & pad.bool()[b, j], torch.tensor(0.0), float("-inf"))
    return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + bias, dim=-1) @ v


def test_hand_built_eager_causal_padding_becomes_flag_and_bias():
    run = run_passes(hf_eager_causal_padding, [*qkv(), _left_padding()], ["attention"], training=True)
    (c,) = run.choices
    assert c["causal"] and c["key_padding"] and "mask_tensor" not in c, c
    run.check_eager()


def _alibi_from_padding(pad):
    """BLOOM's ALiBi: per-head slopes (``pow`` of a constant) times key positions counted from the
    attention mask, ``[B, H, 1, T]``."""
    slopes = torch.pow(torch.tensor(0.5), torch.arange(1, H + 1, dtype=torch.int32))
    positions = ((pad.cumsum(-1) - 1) * pad)[:, None, None, :]
    return slopes[None, :, None, None] * positions


def eager_causal_padding_alibi(q, k, v, pad):
    b, i, j = _indices()
    keep = (j <= i) & pad.bool()[b, j]
    bias = torch.where(keep, torch.tensor(0.0), torch.finfo(torch.float32).min)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + _alibi_from_padding(pad) + bias
    return torch.softmax(scores, dim=-1) @ v


def eager_causal_padding_learned_bias(q, k, v, pad, learned):
    b, i, j = _indices()
    keep = (j <= i) & pad.bool()[b, j]
    bias = torch.where(keep, torch.tensor(0.0), torch.finfo(torch.float32).min)
    return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + learned + bias, dim=-1) @ v


def test_eager_causal_padding_with_alibi_from_the_padding_vector_becomes_flag_and_bias():
    """BLOOM's form: an ALiBi term counted from the attention mask beside the finfo.min mask. The
    term is provably small (its bound: slopes <= 1 times int64 positions), so eager's finfo.min
    absorbs it on masked keys: the mask becomes the causal flag + key padding, the term stays a
    bias, and the rows that keep no key get eager's uniform row and gradients."""
    run = run_passes(eager_causal_padding_alibi, [*qkv(), _left_padding()], ["attention"], training=True)
    (c,) = run.choices
    assert c["causal"] and c["key_padding"] and c["bias"], c
    run.check_eager()


@pytest.mark.parametrize("fn, extra, why", [
    (eager_causal_padding_learned_bias, lambda: [torch.randn(1, H, 1, T, requires_grad=True)],
     "not provably below 2**64 in magnitude"),
    (eager_causal_padding_learned_bias, lambda: [torch.randn(1, H, 1, T)], "not provably below 2**64 in magnitude"),
])
def test_a_bias_term_beside_the_mask_that_is_not_bounded_keeps_the_mask(fn, extra, why):
    """A learned bias (it may hold anything, and has a gradient) or a float tensor the caller passes
    beside the mask: nothing bounds them, so the mask stays a tensor, with the reason."""
    run = run_passes(fn, [*qkv(), _left_padding(), *extra()], ["attention"], training=True)
    (c,) = run.choices
    assert not c["key_padding"] and not c["causal"], c
    assert why in c["reason"], c
    run.check_eager()


@pytest.mark.parametrize("fn, want, why", [
    (eager_segment_ids, "arbitrary (a factor computed by eq.Tensor depends on tensors other than a key-padding vector)",
     "a factor computed by eq.Tensor depends on tensors other than a key-padding vector"),
    (hf_eager_causal_padding_neg_inf, "causal + key padding [B, Tk], -inf fill",
     "a fill of -inf in torch.float32 does not absorb the scores"),
])
def test_eager_masks_that_are_not_band_and_key_padding_stay_tensors_with_the_reason(fn, want, why):
    """A mask that depends on other data than a key-padding vector, or whose fill does not absorb
    the scores, keeps its tensor: the report says what it is made of and why it was not taken."""
    run = run_passes(fn, [*qkv(), _left_padding()], ["attention"], training=True)
    (c,) = run.choices
    assert c["mask_tensor"] == want and c["bias"] and not c["key_padding"] and not c["causal"], c
    assert f"not taken as flags + key padding: {why}" in c["reason"], c
    if fn is eager_segment_ids:  # (-inf: eager's rows that keep no key are NaN, enn::attention's business)
        run.check_eager()


def test_a_mask_that_drops_every_key_is_not_a_band():
    """transformers' sliding window of 0 (``kv_idx > q_idx - 0`` and causal) keeps no key at all:
    eager's finfo.min makes every row uniform over all keys. Not a causal flag: the mask stays."""
    model = _model("mistral", "eager")
    model.config.sliding_window = 0  # read at every forward
    run = run_passes(_Logits(model), [torch.randint(3, 128, (B, SEQ))], ["attention"], training=True)
    got = [c for c in run.choices if c["choice"] == "cpu_flash"]
    assert len(got) == LAYERS and all(not c["causal"] and c["bias"] for c in got), got
    run.check_eager()


# ----------------------------------------------------------------------------- SDPA's CUDA kernels, left padding, flex
# The CUDA kernels' calls traced on the CPU (their fake kernels have no device check) and run
# after the pass: once flex replaced them, the graph runs here.
FLEX_T = 256  # whole flex blocks
CUDNN_FILL = -65504.0


def _hf_keep(pad: torch.Tensor) -> torch.Tensor:
    b = torch.arange(pad.shape[0])[:, None, None, None]
    i = torch.arange(FLEX_T)[None, None, :, None]
    j = torch.arange(FLEX_T)[None, None, None, :]
    return (j <= i) & pad.bool()[b, j]


def cudnn_left_padded(q, k, v, pad):
    bias = torch.where(_hf_keep(pad).expand(B, 1, FLEX_T, FLEX_T), 0.0, CUDNN_FILL)
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, bias, False, 0.0, False)[0]


def _flex_pad() -> torch.Tensor:
    pad = torch.ones(B, FLEX_T, dtype=torch.long)
    pad[1, :40] = 0  # 40 rows that keep no key, a partial first block
    return pad


def test_cudnn_left_padding_inference_becomes_flex_with_cudnns_dead_rows(monkeypatch):
    """A row that keeps no key comes out as cuDNN computes it: every key weighed by its score plus
    the fill (rounded in fp32) (what cuDNN does on CUDA: test_cuda_sdpa_kernels_on_rows_that_keep_no_key).
    No T x T tensor is left, and one flex call replaces the kernel."""
    from enn_backend.passes.attention.kernels.flex_padding import PaddedCausalFlex

    monkeypatch.setattr(PaddedCausalFlex, "DEVICES", ("cuda", "cpu"))
    q, k, v = (torch.randn(B, 2, FLEX_T, 16) for _ in range(3))
    pad = _flex_pad()
    run = run_passes(cudnn_left_padded, [q, k, v, pad], ["attention"], training=False)
    (c,) = run.choices
    assert c["choice"] == "flex" and c["causal"] and c["key_padding"], c
    assert not _square(run.after, FLEX_T)
    assert len(find_ops(run.after, torch.ops.higher_order.flex_attention)) == 1
    keep = _hf_keep(pad)
    dead = ~keep.any(-1, keepdim=True)
    scores = q @ k.transpose(-1, -2) * 16 ** -0.5
    want = torch.softmax(scores + torch.where(keep, 0.0, torch.where(dead, CUDNN_FILL, float("-inf"))), -1) @ v
    torch.testing.assert_close(run.output, want, atol=2e-6, rtol=2e-5)
    assert run.output[1, :, :40].abs().max() > 0.1  # the dead rows are not zeros


# What SDPA's CUDA kernels make of HF's left-padding mask, the premises of the two paths above: bf16,
# a [B, 1, T, T] boolean mask (causal & keep[b, kv]), batch 1 padded by a quarter. An H100's numbers
# at T=1024 and 4096: bench/results/gpu-h100/sdpa_left_padding_semantics.log.
DEAD_ROWS = {"default": "every key", "cudnn": "every key", "efficient": "zeros", "math": "zeros"}


def _left_padded_sdpa_inputs(t: int = 256, heads: int = 8, d: int = 128):
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2, heads, t, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    keep = torch.ones(2, t, dtype=torch.bool, device="cuda")
    keep[1, : t // 4] = False
    i = torch.arange(t, device="cuda")
    return q, k, v, keep, (i[None, :] <= i[:, None])[None, None] & keep[:, None, None, :]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", list(DEAD_ROWS))
def test_cuda_sdpa_kernels_on_rows_that_keep_no_key(kernel):
    """A query row that keeps no key: cuDNN -- and the default dispatch, which picks it on Hopper,
    so eager's result -- weighs it over every key by its raw scores (its finite fill cancels),
    which enn's flex path reproduces (test_cudnn_left_padding_inference_becomes_flex_with_cudnns_dead_rows;
    end to end: test_hf_sdpa_left_padding_inference_on_cuda_runs_flex_with_eager_values); the
    memory-efficient and math kernels give zeros, as under the causal flag, so their calls take
    the flag. No NaN; every other row is fp64's."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from enn_backend.passes.attention.kernels.flex_padding import dead_rows

    q, k, v, keep, mask = _left_padded_sdpa_inputs()
    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "math": SDPBackend.MATH}.get(kernel)
    try:
        with nullcontext() if backend is None else sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).double()
    except RuntimeError as e:
        pytest.skip(f"{kernel} refuses this call on this GPU: {str(e).splitlines()[0][:120]}")
    s = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    every_key = torch.softmax(s, -1) @ v.double()
    live = torch.softmax(s.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0) @ v.double()
    dead = dead_rows(keep)[:, None, :, None].expand_as(out)
    assert int(dead[:, 0, :, 0].sum()) == 64 and not torch.isnan(out).any()
    assert _rel(out[~dead], live[~dead]) < 1e-2  # H100: 0.002
    if DEAD_ROWS[kernel] == "zeros":
        assert out[dead].abs().max().item() == 0.0
    else:
        assert _rel(out[dead], every_key[dead]) < 1e-2, _rel(out[dead], every_key[dead])  # H100: 0.003
        assert out[dead].abs().max().item() > 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_efficient_kernel_under_the_left_padding_mask_equals_the_causal_flag():
    """The memory-efficient kernel under HF's mask, and with is_causal plus the [B, 1, 1, Tk]
    padding bias (-inf) as enn calls it: the same outputs and gradients (dq within bf16
    rounding; H100: out, dk, dv equal, dq 4.9e-4), rows that keep no key zero with zero dq."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from enn_backend.passes.attention.kernels.flex_padding import dead_rows

    q, k, v, keep, mask = _left_padded_sdpa_inputs()
    b, h, t, _ = q.shape
    g = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=torch.Generator(device="cuda").manual_seed(2))
    pad = torch.where(keep[:, None, None, :], 0.0, float("-inf")).to(q.dtype).expand(b, h, t, t)
    runs = {}
    for how in ("mask", "flag"):
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        if how == "mask":
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask)
        else:
            out = torch.ops.aten._scaled_dot_product_efficient_attention(qq, kk, vv, pad, True, 0.0, True)[0]
        out.backward(g)
        runs[how] = [out.detach(), qq.grad, kk.grad, vv.grad]
    for name, a, c in zip(("out", "dq", "dk", "dv"), runs["mask"], runs["flag"]):
        assert torch.isfinite(a).all() and torch.isfinite(c).all(), name
        torch.testing.assert_close(c.float(), a.float(), atol=4e-3, rtol=1e-2, msg=lambda m, n=name: f"{n}: {m}")
    dead = dead_rows(keep)[:, None, :, None].expand_as(q)
    assert runs["flag"][0][dead].eq(0).all() and runs["flag"][1][dead].eq(0).all()


def test_cudnn_left_padding_whose_logsumexp_is_read_keeps_its_mask(monkeypatch):
    """flex computes the attention result only: a call whose other outputs are read keeps its mask,
    with the reason (planned before any edit)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from enn_backend.passes.attention import sdpa_calls
    from enn_backend.passes.attention.kernels.flex_padding import PaddedCausalFlex
    from enn_backend.passes.manager import module_state

    monkeypatch.setattr(PaddedCausalFlex, "DEVICES", ("cuda", "cpu"))
    cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention.default

    def both(q, k, v, pad):
        bias = torch.where(_hf_keep(pad).expand(B, 1, FLEX_T, FLEX_T), 0.0, CUDNN_FILL)
        out, lse = cudnn(q, k, v, bias, True, 0.0, False)[:2]
        return out, lse

    args = [*(torch.randn(B, 2, FLEX_T, 16) for _ in range(3)), _flex_pad()]
    gm = make_fx(both, tracing_mode="fake")(*args)
    (n,) = [n for n in gm.graph.nodes if n.target is cudnn]
    with module_state(args):
        ks, why = sdpa_calls._plan(n, sdpa_calls.SDPA_OPS[cudnn], training=False)
    assert ks is None and "not all that is read" in why, why


def test_the_efficient_kernels_mask_broadcast_over_heads_is_read_as_the_models_mask():
    """SDPA's memory-efficient path expands the model's ``where(keep, 0, fill)`` over the heads
    before its kernel; the structure underneath is read all the same: causal plus key padding, on
    the kernel's flags (its rows that keep no key are zeros either way)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from enn_backend.passes.attention import sdpa_calls
    from enn_backend.passes.manager import module_state

    efficient = torch.ops.aten._scaled_dot_product_efficient_attention.default

    def call(q, k, v, pad):
        bias = torch.where(_hf_keep(pad).expand(B, 1, FLEX_T, FLEX_T), 0.0, float("-inf"))
        return efficient(q, k, v, bias.expand(B, 2, FLEX_T, FLEX_T), False, 0.0, False)[0]

    args = [*(torch.randn(B, 2, FLEX_T, 16) for _ in range(3)), _flex_pad()]
    gm = make_fx(call, tracing_mode="fake")(*args)
    (n,) = [n for n in gm.graph.nodes if n.target is efficient]
    with module_state(args):
        ks, how = sdpa_calls._plan(n, sdpa_calls.SDPA_OPS[efficient], training=True)
    assert ks is not None and ks.band[0] == "causal" and ks.key_padding is not None and how == "", how


def test_flex_for_left_padding_only_in_cuda_inference_with_whole_blocks(monkeypatch):
    """Where flex is not used, and why: training (slower than the kernel with its mask at T=1024),
    the CPU (the kernels' dead rows were measured on CUDA), lengths that are not whole blocks, head
    dims the Triton template does not take."""
    from enn_backend.passes.attention.kernels.flex_padding import PaddedCausalFlex

    def why(shape, training=False):
        q = torch.empty(shape, device="meta")
        return PaddedCausalFlex.check(q, q, training)

    assert "used on cuda only" in why((2, 4, 256, 64))[1]
    monkeypatch.setattr(PaddedCausalFlex, "DEVICES", ("cuda", "meta"))  # a meta tensor stands for a CUDA one
    assert why((2, 4, 256, 64)) == (True, "")
    assert "training" in why((2, 4, 256, 64), training=True)[1]
    assert "not a multiple of flex's 128-row blocks" in why((2, 4, 200, 64))[1]
    assert "power-of-two head dim" in why((2, 4, 256, 80))[1]


@pytest.mark.parametrize("padded, heads", [((1, 40), 1), ((1, 128), 2), ((0, 256), 2), (None, 3)])
def test_padding_block_mask_in_closed_form_equals_create_block_mask(padded, heads):
    """The block-level closed form marks the same blocks (full and partial) as flex's own
    ``create_block_mask`` evaluating the mask at every position: a partial first block, a whole
    padded block, a sequence padded whole, none."""
    from torch.nn.attention.flex_attention import create_block_mask

    from enn_backend.passes.attention.kernels import flex_padding as fp

    keep = torch.ones(2, FLEX_T, dtype=torch.bool)
    if padded is not None:
        keep[padded[0], :padded[1]] = False
    dead = fp.dead_rows(keep)
    parts = fp.block_parts(keep, dead, heads)
    assert parts[0].shape == (2, heads, FLEX_T // 128)
    want = create_block_mask(lambda b, h, q, kv: fp.causal_padding_mask_mod(b, h, q, kv, keep, dead),
                             2, heads, FLEX_T, FLEX_T, device="cpu")
    torch.testing.assert_close(parts[0], want.kv_num_blocks)
    torch.testing.assert_close(parts[2], want.full_kv_num_blocks)
    for num, idx, want_num, want_idx in ((parts[0], parts[1], want.kv_num_blocks, want.kv_indices),
                                         (parts[2], parts[3], want.full_kv_num_blocks, want.full_kv_indices)):
        for b in range(2):
            for h in range(heads):
                for m in range(FLEX_T // 128):
                    n = int(num[b, h, m])
                    assert n == int(want_num[b, h, m])
                    assert sorted(idx[b, h, m, :n].tolist()) == sorted(want_idx[b, h, m, :n].tolist())
