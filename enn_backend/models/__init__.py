"""The model zoo: models written in plain PyTorch, the way people really write them.

One home for the models the benchmark (:mod:`enn_backend.bench`), the demo and the tests run.
Nothing here knows about enn: the attention is spelled out as users spell it
(nanoGPT's ``tril`` buffer + ``masked_fill(-inf)``, HF BERT's additive padding
mask, Meta LLaMA's ``softmax(scores.float()).type_as(q)``, T5's bucketed relative
position bias, ...), so the benchmark measures what enn does to real code.

Every model has two sizes:

- ``cpu-small``: tiny, so a compile + a few steps take seconds on 2 CPU cores;
- ``gpu-real``:  real widths and sequence lengths (GPT-2 small / BERT base / a
  LLaMA-1B-like layer ...) with few layers, so a GPU preset compiles in minutes.

:func:`build` returns a :class:`ZooEntry` ``(model, make_inputs, loss_fn)``:

    model, make_inputs, loss_fn = build("gpt2_naive", "cpu-small")
    batch = make_inputs()                  # Batch(args=(...), target=...)
    loss = loss_fn(model(*batch.args), batch.target)

Dropout is 0 everywhere, so a model is a deterministic function of its inputs.

Next to the zoo, :data:`REAL` holds third-party models as their users run them (Hugging Face
``transformers``, ``timm``, ``torchvision``; :mod:`.real`), built the same way: ``build("hf_llama_eager")``.
A model whose package is missing is :func:`unavailable` (with the reason) instead of failing.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

from .classifiers import build_convnet, build_mlp, build_vit
from .common import Batch, ModelSpec, ZooEntry
from .decoders import build_alibi, build_llama
from .encoders import build_bert, build_t5
from .gpt import build_gpt
from .real import real_specs

__all__ = ["Batch", "MODELS", "ModelSpec", "REAL", "SIZES", "ZooEntry", "build", "config", "gpt_small", "names", "spec",
           "unavailable"]

SIZES = ("cpu-small", "gpu-real")


def _gpt(impl: str) -> Callable[..., ZooEntry]:
    def build(device: torch.device, **cfg: Any) -> ZooEntry:
        return build_gpt(device, impl=impl, **cfg)

    return build


_GPT_SMALL = dict(batch=2, seq=64, vocab=512, d_model=64, n_head=4, n_layer=2)
_GPT_REAL = dict(batch=8, seq=1024, vocab=50304, d_model=768, n_head=12, n_layer=2)

MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec("mlp", "MLP: Linear+bias+GELU layers (GEMM epilogues)", build_mlp, {
            "cpu-small": dict(batch=64, d_in=128, d_hidden=256, n_layers=3, n_classes=16),
            "gpu-real": dict(batch=8192, d_in=1024, d_hidden=4096, n_layers=3, n_classes=1000),
        }),
        ModelSpec("gpt2_naive", "GPT-2 (nanoGPT), causal attention as tril buffer + masked_fill(-inf) + softmax", _gpt("naive"), {
            "cpu-small": dict(_GPT_SMALL),
            "gpu-real": dict(_GPT_REAL),
        }),
        ModelSpec("gpt2_sdpa", "GPT-2 (nanoGPT), F.scaled_dot_product_attention(is_causal=True); gpu-real = the ANCHORS 6-block stack",
                  _gpt("sdpa"), {
            "cpu-small": dict(_GPT_SMALL),
            "gpu-real": dict(_GPT_REAL, n_layer=6),
        }),
        ModelSpec("bert", "BERT encoder (HF style): post-LN, additive padding mask (dtype min), classifier", build_bert, {
            "cpu-small": dict(batch=4, seq=64, vocab=512, d_model=64, n_head=4, n_layer=2, n_classes=4),
            "gpu-real": dict(batch=16, seq=512, vocab=30522, d_model=768, n_head=12, n_layer=2, n_classes=4),
        }),
        ModelSpec("llama", "LLaMA (Meta style): RMSNorm, RoPE, SwiGLU, GQA, additive triu(-inf) mask, fp32 softmax", build_llama, {
            "cpu-small": dict(batch=2, seq=64, vocab=512, d_model=64, n_head=4, n_kv_head=2, ffn=172, n_layer=2),
            "gpu-real": dict(batch=4, seq=1024, vocab=32000, d_model=1024, n_head=16, n_kv_head=4, ffn=2816, n_layer=2),
        }),
        ModelSpec("alibi", "ALiBi decoder (BLOOM/MPT style): additive slope*distance bias + causal masked_fill", build_alibi, {
            "cpu-small": dict(batch=2, seq=64, vocab=512, d_model=64, n_head=4, n_layer=2),
            "gpu-real": dict(batch=4, seq=1024, vocab=32000, d_model=1024, n_head=16, n_layer=2),
        }),
        ModelSpec("t5", "T5 v1.0 encoder: bucketed relative position bias, unscaled scores, fp32 softmax, ReLU FFN", build_t5, {
            "cpu-small": dict(batch=2, seq=64, vocab=512, d_model=64, n_head=4, d_ff=256, n_layer=2),
            "gpu-real": dict(batch=8, seq=512, vocab=32128, d_model=768, n_head=12, d_ff=3072, n_layer=2),
        }),
        ModelSpec("sliding", "Mistral-style sliding-window attention (LLaMA block, window mask via masked_fill)",
                  lambda device, **cfg: build_llama(device, **cfg), {
            "cpu-small": dict(batch=2, seq=64, vocab=512, d_model=64, n_head=4, n_kv_head=2, ffn=172, n_layer=2, window=16),
            "gpu-real": dict(batch=4, seq=2048, vocab=32000, d_model=1024, n_head=16, n_kv_head=4, ffn=2816, n_layer=2,
                             window=512),
        }),
        ModelSpec("vit", "ViT (timm style): conv patch embed, cls token, q*scale @ k^T softmax attention", build_vit, {
            "cpu-small": dict(batch=4, img=32, patch=8, dim=64, depth=2, heads=4, n_classes=10),
            "gpu-real": dict(batch=64, img=224, patch=16, dim=768, depth=2, heads=12, n_classes=1000),
        }),
        ModelSpec("convnet", "ResNet-like conv net: conv + BatchNorm + ReLU basic blocks", build_convnet, {
            "cpu-small": dict(batch=8, img=32, widths=(16, 32), n_classes=10),
            "gpu-real": dict(batch=64, img=128, widths=(64, 128, 256), n_classes=1000),
        }),
    ]
}


REAL: dict[str, ModelSpec] = {s.name: s for s in real_specs()}


def names(suite: str = "zoo") -> list[str]:
    """The models of ``suite``: "zoo" (plain PyTorch), "real" (third-party) or "all"."""
    suites = {"zoo": list(MODELS), "real": list(REAL), "all": list(MODELS) + list(REAL)}
    if suite not in suites:
        raise KeyError(f"unknown suite {suite!r}; known: {', '.join(suites)}")
    return suites[suite]


def spec(name: str) -> ModelSpec:
    """The spec of zoo or third-party model ``name``."""
    found = MODELS.get(name) or REAL.get(name)
    if found is None:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(names('all'))}")
    return found


def unavailable(name: str) -> str:
    """Why model ``name`` cannot be built here (a package it needs does not import); "" if it can."""
    for package in spec(name).requires:
        try:
            importlib.import_module(package)
        except Exception as exc:  # noqa: BLE001 - an installed package can fail to import (e.g. built for another torch)
            return f"{package} does not import: {type(exc).__name__}: {str(exc).strip()[:200]}"
    return ""


def config(name: str, size: str = "cpu-small", **overrides: Any) -> dict[str, Any]:
    """The constructor arguments of model ``name`` at ``size`` (plus overrides)."""
    if size not in SIZES:
        raise KeyError(f"unknown size {size!r}; known: {', '.join(SIZES)}")
    cfg = dict(spec(name).sizes[size])
    cfg.update(overrides)
    return cfg


def build(name: str, size: str = "cpu-small", *, device: str | torch.device = "cpu", seed: int = 0,
          **overrides: Any) -> ZooEntry:
    """Build zoo model ``name`` at ``size`` on ``device`` with weights drawn from ``seed``."""
    cfg = config(name, size, **overrides)
    device = torch.device(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        entry = spec(name).builder(device, **cfg)
    return entry


def gpt_small(size: str = "cpu-small", *, attention: str = "naive", device: str | torch.device = "cpu", seed: int = 0,
              **overrides: Any) -> ZooEntry:
    """A small GPT-2 (nanoGPT) for demos: ``attention='naive'`` (tril + masked_fill) or ``'sdpa'``.

    ``cpu-small`` is 2 layers, d=64, T=64, vocab 512: compiles in seconds on a CPU.
    """
    if attention not in ("naive", "sdpa"):
        raise ValueError(f"attention must be 'naive' or 'sdpa', got {attention!r}")
    return build(f"gpt2_{attention}", size, device=device, seed=seed, **overrides)
