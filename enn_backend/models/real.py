"""Third-party models as their users run them: Hugging Face ``transformers``, ``timm`` and
``torchvision``, unmodified, built from small random configs (no weights are ever downloaded).

Each model is wrapped only so that it fits the zoo's calling convention (``model(*batch.args)``,
then ``loss_fn(output, batch.target)``). Most transformers specs set three things a user would
leave alone, so that one step is a deterministic whole-sequence forward with the zoo's loss:

- :class:`Logits` calls a transformers model with keyword inputs and returns its ``logits``; the
  loss is the zoo's token / class cross entropy outside the model, with ``-100`` where the
  attention mask hides a position (as ``DataCollatorForLanguageModeling`` labels padding);
- ``use_cache`` is off: one step is training or a prefill-style forward, with no KV cache built;
- dropout is off (set to 0 in the config, visibly), except where a spec says ``stochastic``:
  GPT-2 trains with transformers' default dropouts (0.1 on attention, residual and embeddings).

The specs ending in ``_defaults`` and ``_ckpt`` run a model as users leave it, next to
the spec they are named after (its *twin*, same sizes), to measure what those three settings hide:
the config keeps its defaults (only sizes and the special token ids are chosen; ``use_cache`` and
dropout are the config's, so a model whose config drops out is ``stochastic``), and the model
computes its own loss from ``labels=`` (:class:`OwnLoss`: HF's loss function, which shifts a
causal LM's labels itself; the zoo's loss is :func:`own_loss`, the model's output). The inference
step is then an evaluation forward with labels (the loss, as ``Trainer.evaluate`` gets it),
building the KV cache where ``use_cache`` is on; the wrapper returns only the loss, so the logits
and the cache are not outputs of the compiled graph. ``_ckpt`` is the same with
``model.gradient_checkpointing_enable()`` (transformers' default, non-reentrant), training only.
:data:`AS_LEFT` lists the twins that have them.

Padding: ``padding="left"`` (decoders, as batched generation pads) or ``"right"`` (encoders, as
their tokenizers pad) pads every second row of the batch by a quarter of the sequence.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .common import Batch, ModelSpec, ZooEntry, class_loss, image_batch, seeded, token_loss

PAD, FIRST_ID = 0, 3  # token ids below FIRST_ID are the special tokens (pad, bos, eos)
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

# family -> (config class, model class, what the model reads: causal / masked / seq2seq)
HF_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "causal"),
    "mistral": ("MistralConfig", "MistralForCausalLM", "causal"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "causal"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", "causal"),
    "bloom": ("BloomConfig", "BloomForCausalLM", "causal"),
    "bert": ("BertConfig", "BertForMaskedLM", "masked"),
    "t5": ("T5Config", "T5ForConditionalGeneration", "seq2seq"),
}


class Logits(nn.Module):
    """``Logits(model, keys)(*args)`` is ``model(**dict(zip(keys, args))).logits``."""

    def __init__(self, model: nn.Module, keys: tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.keys = model, keys

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.keys, args))).logits


class OwnLoss(nn.Module):
    """``OwnLoss(model, keys)(*args)`` is ``model(**dict(zip(keys, args))).loss``: the model's own
    loss, from the ``labels`` among its inputs (a causal LM shifts them itself)."""

    def __init__(self, model: nn.Module, keys: tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.keys = model, keys

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.keys, args))).loss


def own_loss(loss: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The step's loss of a model that computes its own (:class:`OwnLoss`): the model's output;
    the target is already among the model's inputs."""
    return loss


def padding_mask(batch: int, seq: int, padding: str) -> torch.Tensor:
    """[batch, seq] int64, 0 where a position is padding: every second row loses ``seq // 4``
    positions on the ``padding`` side ("left" / "right"); "" pads nothing."""
    mask = torch.ones(batch, seq, dtype=torch.long)
    if padding not in ("", "left", "right"):
        raise ValueError(f"padding must be '', 'left' or 'right', got {padding!r}")
    if padding:
        cut = slice(0, seq // 4) if padding == "left" else slice(seq - seq // 4, seq)
        mask[1::2, cut] = 0
    return mask


def _lm_batch(device: torch.device, kind: str, batch: int, seq: int, vocab: int, padding: str,
              target_seq: int, with_labels: bool = False) -> Any:
    """Batches for a transformers LM; ``with_labels``: HF's labels (the inputs, ``-100`` at padding)
    are the last argument and the target, for a model that computes its own loss."""

    def make(seed: int = 0) -> Batch:
        g = seeded(1000 + seed)
        mask = padding_mask(batch, seq, padding)
        ids = torch.randint(FIRST_ID, vocab, (batch, seq + 1), generator=g)
        inputs = ids[:, :-1].masked_fill(mask == 0, PAD)
        if with_labels and kind != "seq2seq":  # HF's convention: the model shifts a causal LM's labels
            hf_labels = ids[:, :-1].masked_fill(mask == 0, -100)
            args = (inputs, mask, hf_labels) if padding else (inputs, hf_labels)
            return Batch(tuple(a.to(device) for a in args), hf_labels.to(device))
        if kind == "causal":  # next-token targets; none at or onto padding
            nxt = torch.cat([mask[:, 1:], torch.ones(batch, 1, dtype=torch.long)], dim=1)
            target = ids[:, 1:].masked_fill((mask == 0) | (nxt == 0), -100)
        elif kind == "masked":
            target = ids[:, :-1].masked_fill(mask == 0, -100)
        else:  # seq2seq: a target sequence of target_seq tokens, fed shifted right to the decoder
            labels = torch.randint(FIRST_ID, vocab, (batch, target_seq), generator=g)
            labels[1::2, -(target_seq // 4):] = -100
            dec_in = torch.cat([torch.full((batch, 1), PAD), labels[:, :-1].clamp(min=PAD)], dim=1)
            args = (inputs, mask, dec_in)
            return Batch(tuple(a.to(device) for a in args), labels.to(device))
        args = (inputs, mask) if padding else (inputs,)
        return Batch(tuple(a.to(device) for a in args), target.contiguous().to(device))

    return make


def build_hf(device: torch.device, *, family: str, impl: str, batch: int, seq: int, padding: str = "",
             target_seq: int = 0, as_left: bool = False, checkpointing: bool = False, **config: Any) -> ZooEntry:
    """A transformers model of ``family`` with attention implementation ``impl`` from ``config``.

    By default ``use_cache`` is off and the loss is the zoo's, on the model's logits. ``as_left``:
    ``use_cache`` stays the config's and the model computes its own loss from ``labels=``
    (:class:`OwnLoss`); ``checkpointing``: ``model.gradient_checkpointing_enable()`` as well."""
    import transformers

    config_cls, model_cls, kind = HF_FAMILIES[family]
    if kind == "seq2seq" and not padding:
        raise ValueError("the encoder-decoder batch always carries an attention mask: give padding='left' or 'right'")
    if as_left and kind == "seq2seq":
        raise ValueError("an encoder-decoder model is built with use_cache off and the loss outside it only")
    cfg = getattr(transformers, config_cls)(**SPECIAL, **config, attn_implementation=impl)
    if not as_left:
        cfg.use_cache = False
    model = getattr(transformers, model_cls)(cfg)
    if model.config._attn_implementation != impl:
        raise RuntimeError(f"{model_cls} runs attention {model.config._attn_implementation!r}, not {impl!r}")
    if checkpointing:
        model.gradient_checkpointing_enable()
    make = _lm_batch(device, kind, batch, seq, cfg.vocab_size, padding, target_seq, with_labels=as_left)
    if as_left:
        keys = ("input_ids", "attention_mask", "labels") if padding else ("input_ids", "labels")
        return ZooEntry(OwnLoss(model, keys).to(device), make, own_loss)
    keys = ("input_ids", "attention_mask", "decoder_input_ids") if kind == "seq2seq" else ("input_ids", "attention_mask")
    return ZooEntry(Logits(model, keys).to(device), make, token_loss)


def build_timm(device: torch.device, *, arch: str, batch: int, img: int, n_classes: int, **kwargs: Any) -> ZooEntry:
    """``timm.create_model(arch, pretrained=False, ...)``; ``kwargs`` go to it (a ViT's ``img_size`` must be ``img``)."""
    import timm

    model = timm.create_model(arch, pretrained=False, num_classes=n_classes, **kwargs)
    return ZooEntry(model.to(device), image_batch(device, batch, img, n_classes), class_loss)


def build_torchvision(device: torch.device, *, arch: str, batch: int, img: int, n_classes: int) -> ZooEntry:
    """``torchvision.models.<arch>(weights=None)``."""
    import torchvision

    model = getattr(torchvision.models, arch)(weights=None, num_classes=n_classes)
    return ZooEntry(model.to(device), image_batch(device, batch, img, n_classes), class_loss)


def _hf(family: str, impl: str, **cfg: Any):
    def build(device: torch.device, **size: Any) -> ZooEntry:
        return build_hf(device, family=family, impl=impl, **cfg, **size)

    return build


# ---------------------------------------------------------------- sizes
# cpu-small: tiny, compiles in seconds; gpu-real: 2 layers, real widths, T = 1024-4096.
_TINY = dict(num_hidden_layers=2, vocab_size=128, max_position_embeddings=128)
# decoders at T=64: the shortest sequence whose attention enn's CPU policy fuses (inference)
_TINY_LLAMA = dict(_TINY, batch=2, seq=64, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                   intermediate_size=128)  # GQA 4:1, head dim 16
_GPU_LLAMA = dict(num_hidden_layers=2, vocab_size=32000, max_position_embeddings=4096, hidden_size=2048,
                  num_attention_heads=16, num_key_value_heads=4, intermediate_size=5632)  # GQA 4:1, head dim 128
# The sizes of a model that has _defaults / _ckpt variants: sizes only, shared by the twin and its variants.
_LLAMA = {"cpu-small": dict(_TINY_LLAMA), "gpu-real": dict(_GPU_LLAMA, batch=4, seq=1024)}
_GPT2 = {"cpu-small": dict(batch=2, seq=64, n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64),
         "gpu-real": dict(batch=8, seq=1024, n_layer=2, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)}
_BERT = {"cpu-small": dict(_TINY, batch=4, seq=32, hidden_size=64, num_attention_heads=4, intermediate_size=128),
         "gpu-real": dict(num_hidden_layers=2, vocab_size=30522, batch=16, seq=512, hidden_size=768, num_attention_heads=12,
                          intermediate_size=3072)}
_NO_DROPOUT_BERT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
_GPT2_DROPOUT = ("trains with transformers' default dropout 0.1 (attention, residual, embedding): "
                 "every backend draws its own random stream")
_BERT_DROPOUT = ("trains with transformers' default dropout 0.1 (attention probabilities, hidden states): "
                 "every backend draws its own random stream")

# The twins that run as users leave them too, each with its variants (the module docstring), in
# the order of real_specs(): the variants follow their twin there.
AS_LEFT: dict[str, tuple[str, str]] = {twin: (f"{twin}_defaults", f"{twin}_ckpt")
                                       for twin in ("hf_llama_eager", "hf_llama_sdpa", "hf_gpt2_eager", "hf_bert_sdpa")}


def _as_left(twin: str, family: str, impl: str, sizes: dict[str, dict[str, Any]], *, padding: str = "",
             stochastic: str = "") -> list[ModelSpec]:
    """``twin``'s ``_defaults`` and ``_ckpt`` specs at ``sizes`` (the twin's, without its dropout
    settings); ``stochastic``: why the config's default dropout makes training random ("" if it does not)."""
    defaults, ckpt = AS_LEFT[twin]
    what = f"{twin} as users leave it: config defaults (use_cache, dropout), HF's loss from labels="
    return [
        ModelSpec(defaults, what, _hf(family, impl, padding=padding, as_left=True), sizes, requires=("transformers",),
                  stochastic=stochastic),
        ModelSpec(ckpt, f"{what}, gradient checkpointing (training only)",
                  _hf(family, impl, padding=padding, as_left=True, checkpointing=True), sizes, requires=("transformers",),
                  modes=("train",), stochastic=stochastic),
    ]


def real_specs() -> list[ModelSpec]:
    """The third-party models, in the order the real preset runs them (the most telling first), each
    twin of :data:`AS_LEFT` followed by its variants (which the real preset leaves out)."""
    hf = ("transformers",)
    decoders = [
        ModelSpec("hf_llama_eager", "HF LLaMA, eager attention (finfo.min causal bias), GQA 4:1, head dim 128",
                 _hf("llama", "eager"), _LLAMA, requires=hf),
        ModelSpec("hf_llama_eager_4k", "HF LLaMA, eager attention at T=4096, GQA 4:1, head dim 128 (training only)",
                 _hf("llama", "eager"), {"cpu-small": dict(_TINY_LLAMA, seq=128),
                                         "gpu-real": dict(_GPU_LLAMA, batch=1, seq=4096)},
                 requires=hf, modes=("train",)),
        ModelSpec("hf_qwen2_sdpa", "HF Qwen2, sdpa attention, GQA 8:1, left-padded batch",
                 _hf("qwen2", "sdpa", padding="left"),
                 {"cpu-small": dict(_TINY_LLAMA, num_attention_heads=8, num_key_value_heads=1),
                  "gpu-real": dict(_GPU_LLAMA, num_key_value_heads=2, batch=4, seq=1024)}, requires=hf),
        ModelSpec("hf_llama_sdpa", "HF LLaMA, sdpa attention, GQA 4:1, head dim 128",
                 _hf("llama", "sdpa"), _LLAMA, requires=hf),
        ModelSpec("hf_mistral_eager", "HF Mistral, eager attention, sliding window (T/4), GQA 4:1",
                 _hf("mistral", "eager"),
                 {"cpu-small": dict(_TINY_LLAMA, head_dim=16, sliding_window=16),
                  "gpu-real": dict(_GPU_LLAMA, head_dim=128, sliding_window=512, batch=2, seq=2048)}, requires=hf),
        ModelSpec("hf_gpt2_eager", "HF GPT-2, eager attention, transformers' default dropout 0.1 (attention, residual, embedding)",
                 _hf("gpt2", "eager"), _GPT2, requires=hf, stochastic=_GPT2_DROPOUT),
        ModelSpec("hf_bloom", "HF BLOOM (ALiBi: per-head slope x distance bias through baddbmm), left-padded batch",
                 _hf("bloom", "eager", padding="left"),
                 {"cpu-small": dict(batch=2, seq=64, n_layer=2, hidden_size=64, n_head=4, vocab_size=128),
                  "gpu-real": dict(batch=4, seq=1024, n_layer=2, hidden_size=2048, n_head=16, vocab_size=32000)},
                 requires=hf),
    ]
    encoders = [
        ModelSpec(f"hf_bert_{impl}", f"HF BERT (masked LM), {impl} attention, right-padded batch via attention_mask",
                 _hf("bert", impl, padding="right"), {size: dict(c, **_NO_DROPOUT_BERT) for size, c in _BERT.items()},
                 requires=hf)
        for impl in ("eager", "sdpa")
    ]
    seq2seq = [
        ModelSpec("hf_t5", "HF T5 encoder-decoder (relative position bias), eager attention, right-padded source and target",
                 _hf("t5", "eager", padding="right"),
                 {"cpu-small": dict(batch=2, seq=32, target_seq=16, vocab_size=128, d_model=64, d_kv=16, d_ff=128,
                                    num_layers=1, num_decoder_layers=1, num_heads=4, dropout_rate=0.0,
                                    relative_attention_num_buckets=8, decoder_start_token_id=PAD),
                  "gpu-real": dict(batch=8, seq=512, target_seq=128, vocab_size=32128, d_model=768, d_kv=64, d_ff=3072,
                                   num_layers=2, num_decoder_layers=2, num_heads=12, dropout_rate=0.0,
                                   decoder_start_token_id=PAD)},
                 requires=hf),
    ]
    vision = [
        ModelSpec("timm_vit_small", "timm vit_small_patch16_224, 2 blocks, random init",
                 lambda device, **c: build_timm(device, arch="vit_small_patch16_224", **c),
                 {"cpu-small": dict(batch=2, img=32, img_size=32, n_classes=10, depth=2, patch_size=8),
                  "gpu-real": dict(batch=128, img=224, n_classes=1000, depth=2)}, requires=("timm",)),
        ModelSpec("tv_resnet18", "torchvision resnet18, weights=None",
                 lambda device, **c: build_torchvision(device, arch="resnet18", **c),
                 {"cpu-small": dict(batch=2, img=32, n_classes=10), "gpu-real": dict(batch=128, img=224, n_classes=1000)},
                 requires=("torchvision",)),
        ModelSpec("tv_resnet50", "torchvision resnet50, weights=None (BatchNorm statistics updated by every training step)",
                 lambda device, **c: build_torchvision(device, arch="resnet50", **c),
                 {"cpu-small": dict(batch=2, img=32, n_classes=10), "gpu-real": dict(batch=64, img=224, n_classes=1000)},
                 requires=("torchvision",)),
    ]
    variants = {
        "hf_llama_eager": _as_left("hf_llama_eager", "llama", "eager", _LLAMA),
        "hf_llama_sdpa": _as_left("hf_llama_sdpa", "llama", "sdpa", _LLAMA),
        "hf_gpt2_eager": _as_left("hf_gpt2_eager", "gpt2", "eager", _GPT2, stochastic=_GPT2_DROPOUT),
        "hf_bert_sdpa": _as_left("hf_bert_sdpa", "bert", "sdpa", _BERT, padding="right", stochastic=_BERT_DROPOUT),
    }
    return [spec for twin in decoders + encoders + seq2seq + vision for spec in (twin, *variants.get(twin.name, ()))]
