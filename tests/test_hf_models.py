"""Hugging Face's own GPT-2, BERT, LLaMA and BLOOM code (``transformers``, eager attention), built from
small configs with random weights -- no download. Every attention layer must be fused and the
loss and every parameter's gradient must equal eager's.

``attn_implementation="eager"`` is the hand-written path these models ship
(``softmax(QKᵀ·s + mask)`` in fp32, then ``@ V``), with the masks that ``transformers`` builds
itself: GPT-2's and LLaMA's causal mask, BERT's padding mask, LLaMA's grouped-query K/V
(``repeat_kv``), BLOOM's ALiBi added by ``baddbmm`` beside its mask. CPU runs ATen's CPU flash
kernel (forced: the CPU policy leaves attention to Inductor by default); the GPU test runs the
default CUDA policy under bf16 autocast and in fp32.

The pinned ``transformers`` version is the one on the lent GPU machine (``pyproject.toml``'s
``test`` extra installs it here and in CI); without it the tests skip.
"""

from __future__ import annotations

import copy

import pytest
import torch

import enn_backend

transformers = pytest.importorskip("transformers")

from _hf import no_dropout, step  # noqa: E402

LAYERS = 2  # two layers: "every layer fused" is a count, not a yes/no
ATTENTION_KERNELS = ("cpu_flash", "explicit", "cudnn", "flash", "efficient", "math", "flex")
EMITTED = "ATen kernel itself"  # SDPA's kernel in the graph, no enn::attention around it


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=LAYERS, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg), {}


def _gpt2_left_padded():
    """Batched generation's layout: the shorter prompt padded on the left. Its padded query rows
    have every key masked; HF masks with finfo.min, so eager gives them uniform weights, not NaN."""
    model, _ = _gpt2()
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, :12] = 0
    return model, {"attention_mask": mask}


def _bert():
    cfg = transformers.BertConfig(num_hidden_layers=LAYERS, hidden_size=64, num_attention_heads=4,
                                  intermediate_size=128, vocab_size=128, max_position_embeddings=64,
                                  attn_implementation="eager")
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, 20:] = 0  # the second sequence is padded
    return transformers.BertForMaskedLM(cfg), {"attention_mask": mask}


def _llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=LAYERS, hidden_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128, vocab_size=128,
                                   max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                                   attn_implementation="eager")
    return transformers.LlamaForCausalLM(cfg), {}


def _bloom():
    """ALiBi through ``baddbmm(alibi, Q, Kᵀ, beta=1, alpha=1/sqrt(D))`` on [B·H, T, D] heads, the
    slopes times key positions counted from the attention mask, left padding as generation pads."""
    cfg = transformers.BloomConfig(n_layer=LAYERS, hidden_size=64, n_head=4, vocab_size=128,
                                   bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, :12] = 0
    return transformers.BloomForCausalLM(cfg), {"attention_mask": mask}


MODELS = {"gpt2": _gpt2, "gpt2_left_padded": _gpt2_left_padded, "bert": _bert, "llama": _llama, "bloom": _bloom}
# Without an attention mask transformers' mask is constant (causal): it becomes the causal flag.
# With one it is where(band & padding, 0, finfo.min): the band's flag and a [B, 1, 1, Tk] key-padding
# bias (tests/test_hf_masks.py).
CAUSAL_FLAG = {"gpt2", "llama"}


def _build(name: str, device: str):
    torch.manual_seed(0)
    model, extra = MODELS[name]()
    model.config.use_cache = False
    no_dropout(model)
    model.to(device).train()
    ids = torch.randint(0, 128, (2, 32), device=device)
    kwargs = {"input_ids": ids, "labels": ids, **{k: v.to(device) for k, v in extra.items()}}
    return model, kwargs


def _check(name: str, device: str, options: dict, autocast: bool, fused: bool = True) -> list[dict]:
    """Loss and gradients equal eager's, no fallback, and a kernel choice per layer: a fused
    kernel, or (``fused=False``) Inductor's own code with the policy's reason."""
    model, kwargs = _build(name, device)
    reference = copy.deepcopy(model)
    got = step(torch.compile(model, backend="enn", options=options), model, kwargs, autocast)
    want = step(reference, reference, kwargs, autocast)
    loss, grads, want_loss, want_grads = got.loss, got.grads, want.loss, want.grads
    rep = enn_backend.report()
    assert rep.fusions().get("attention") == (LAYERS if fused else None), (name, str(rep))
    choices = [c for g in rep.to_dict()["graphs"] for c in g.get("kernel_choices", [])
               if c["choice"] in (ATTENTION_KERNELS if fused else ("inductor",))]
    assert len(choices) == LAYERS, (name, str(rep))
    assert not rep.to_dict()["fallbacks"], str(rep)
    tol = 2e-2 if autocast else 1e-5
    torch.testing.assert_close(loss, want_loss, rtol=tol, atol=tol)
    overall = max(g.abs().max().item() for g in want_grads.values())
    for n, g in want_grads.items():
        # (a key bias has an exactly-zero true gradient: compare noise against the model's scale)
        scale = max(g.abs().max().item(), 1e-2 * overall)
        err = (grads[n] - g).abs().max().item()
        assert err <= (0.05 if autocast else 1e-4) * scale, f"{name}: grad {n} differs by {err:.3g} (max |g| {scale:.3g})"
    return choices


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_attention_fused_cpu(name):
    choices = _check(name, "cpu", {"attention_backend": "flash"}, autocast=False)
    assert {c["choice"] for c in choices} == {"cpu_flash"}
    assert all(EMITTED in c["reason"] for c in choices), choices  # the kernel itself in the graph
    if name in CAUSAL_FLAG:
        assert all(c["causal"] and not c["bias"] for c in choices), choices
    elif name == "bloom":  # the mask as flag + key padding; the ALiBi term (bounded) stays a bias beside it
        assert all(c["causal"] and c["key_padding"] and c["bias"] for c in choices), choices
    else:  # HF's padding masks: where(band & padding, 0, finfo.min)
        assert all(c["key_padding"] and c["causal"] == (name == "gpt2_left_padded") for c in choices), choices


def test_hf_left_padded_explicit_math_cpu():
    """enn's own fp32 math (``enn::attention``, backend ``explicit``) on the padded query rows:
    softmax as eager computes it (``exp(s - max) / sum``), not ``exp(s - lse)``, which rounds
    to 1 for every key of a row that the ``finfo.min`` mask saturates."""
    choices = _check("gpt2_left_padded", "cpu", {"attention_backend": "explicit"}, autocast=False)
    assert {c["choice"] for c in choices} == {"explicit"}


def test_hf_left_padded_inference_cpu():
    """Inference (no_grad) graph of the same model: transformers' mask holds a tensor constant,
    which enn must copy as a real tensor under Inductor's fake mode (it once crashed there and
    fell back to plain Inductor)."""
    model, kwargs = _build("gpt2_left_padded", "cpu")
    kwargs.pop("labels")
    compiled = torch.compile(model, backend="enn", options={"attention_backend": "flash"})
    with torch.no_grad():
        got, want = compiled(**kwargs).logits, model(**kwargs).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    rep = enn_backend.report()
    assert rep.fusions().get("attention") == LAYERS and not rep.to_dict()["fallbacks"], str(rep)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("autocast", [True, False], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_attention_gpu(name, autocast):
    """The CUDA kernels in the default order (named: at these sizes the default policy leaves padded
    attention to Inductor, policy.CUDA_MIN_PADDING_SCORES). A mask built from an attention mask input is where(band & padding, 0,
    finfo.min), which can mask whole rows of a left-padded batch: it becomes the band's flag and a
    [B, 1, 1, Tk] padding bias on cuDNN in bf16 (memory-efficient in fp32), the rows that keep no
    key fixed up in closed form; BLOOM's ALiBi term, counted from the same attention mask, is added
    to that bias. Without one the mask is constant and causal: the causal flag, on
    flash / cuDNN in bf16 (efficient in fp32). Loss and gradients equal eager, the padded rows
    included."""
    choices = _check(name, "cuda", {"attention_order": "cudnn,flash,efficient"}, autocast=autocast)
    if name in CAUSAL_FLAG:
        assert all(c["causal"] and not c["bias"] for c in choices), choices
        assert {c["choice"] for c in choices} <= ({"cudnn", "flash"} if autocast else {"efficient"}), choices
    else:
        assert all(c["key_padding"] for c in choices), choices
        assert {c["choice"] for c in choices} <= ({"cudnn", "efficient"} if autocast else {"efficient"}), choices
    assert all(EMITTED in c["reason"] for c in choices), choices
