"""Hugging Face ``transformers`` models from tiny random configs (no download), one training step
compiled against eager, shared by tests/test_hf_models.py and tests/test_hf_sweep.py.

Run as a script it prints the sweep's table (one row per model, attention implementation and
variant): ``python tests/_hf.py [--backend enn|inductor] [--impl sdpa,eager] [--variant ...]
[--options JSON] [model ...]``.

Variants (:data:`VARIANTS`) -- the test chooses sizes, the batch and dropout (off: compiled and
eager must compute the same function), nothing else:

- ``no_cache``: ``use_cache=False``, as the sweep has always run;
- ``defaults``: the config's own defaults (``use_cache=True`` for decoders: the model returns its
  K/V cache beside the loss);
- ``checkpointing``: the defaults plus ``gradient_checkpointing_enable()`` (non-reentrant), in
  train mode.

Every variant computes the loss inside the model from ``labels=`` where the model takes them (HF's
loss functions: ``ForCausalLMLoss`` shifts the labels, upcasts the logits to fp32 and ignores
``-100``, which marks the padding).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import time
from typing import Any

import torch

import enn_backend

VOCAB = 128
BATCH, SEQ, PADDED = 2, 16, 5  # the second sequence of the batch has PADDED pad tokens
LAYERS = 2
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # the ids inside VOCAB
IMPLEMENTATIONS = ("sdpa", "eager")
VARIANTS = ("no_cache", "defaults", "checkpointing")
RTOL = 1e-3  # |compiled - eager| / |eager| of each tensor (L2 norms), and allclose's rtol
ATOL = 1e-4  # allclose's atol, as a fraction of the largest gradient (or output) magnitude


@dataclasses.dataclass(frozen=True)
class Spec:
    config: str  # transformers' config class
    model: str  # transformers' model class
    padding: str  # "left" or "right" (where the attention mask is 0), "": the model takes no mask
    cfg: dict

    def make(self, transformers, impl: str) -> torch.nn.Module:
        config = getattr(transformers, self.config)(**self.cfg, attn_implementation=impl)
        return getattr(transformers, self.model)(config)


def _lm(config: str, model: str, padding: str, **cfg) -> Spec:
    return Spec(config, model, padding, dict(num_hidden_layers=LAYERS, vocab_size=VOCAB, hidden_size=64,
                                             num_attention_heads=4, intermediate_size=128,
                                             max_position_embeddings=64, **SPECIAL) | cfg)


# encoder-decoders: one layer each side, LAYERS in all
_SEQ2SEQ = dict(vocab_size=VOCAB, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, decoder_start_token_id=1,
                **SPECIAL)

# Decoders (causal LMs) are padded on the left as batched generation pads them, so the first query
# rows of the padded sequence see no key at all; models whose tokenizers pad on the right (BERT,
# RoBERTa, DistilBERT, the encoders of BART and T5, CLIP's text tower) are padded on the right.
# Whisper and ViT take no attention mask.
MODELS: dict[str, Spec] = {
    "llama": _lm("LlamaConfig", "LlamaForCausalLM", "left", num_key_value_heads=2),
    "mistral": _lm("MistralConfig", "MistralForCausalLM", "left", num_key_value_heads=2, head_dim=16),
    "qwen2": _lm("Qwen2Config", "Qwen2ForCausalLM", "left", num_key_value_heads=2),
    "gemma": _lm("GemmaConfig", "GemmaForCausalLM", "left", num_key_value_heads=2, head_dim=16),
    "phi": _lm("PhiConfig", "PhiForCausalLM", "left"),
    "phi3": _lm("Phi3Config", "Phi3ForCausalLM", "left"),
    "gpt2": Spec("GPT2Config", "GPT2LMHeadModel", "left",
                 dict(n_layer=LAYERS, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, **SPECIAL)),
    "gpt_neox": _lm("GPTNeoXConfig", "GPTNeoXForCausalLM", "left"),
    "opt": Spec("OPTConfig", "OPTForCausalLM", "left",
                dict(num_hidden_layers=LAYERS, vocab_size=VOCAB, hidden_size=64, word_embed_proj_dim=64,
                     num_attention_heads=4, ffn_dim=128, max_position_embeddings=64, **SPECIAL)),
    "bert": _lm("BertConfig", "BertForMaskedLM", "right"),
    "roberta": _lm("RobertaConfig", "RobertaForMaskedLM", "right"),
    "distilbert": Spec("DistilBertConfig", "DistilBertForMaskedLM", "right",
                       dict(n_layers=LAYERS, dim=64, n_heads=4, hidden_dim=128, vocab_size=VOCAB,
                            max_position_embeddings=64, pad_token_id=0)),
    "bart": Spec("BartConfig", "BartForConditionalGeneration", "right", dict(_SEQ2SEQ, max_position_embeddings=64)),
    "t5": Spec("T5Config", "T5ForConditionalGeneration", "right",
               dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_decoder_layers=1,
                    num_heads=4, relative_attention_num_buckets=8, decoder_start_token_id=1, **SPECIAL)),
    "whisper": Spec("WhisperConfig", "WhisperForConditionalGeneration", "",
                    dict(_SEQ2SEQ, num_mel_bins=16, max_source_positions=SEQ // 2, max_target_positions=64)),
    "vit": Spec("ViTConfig", "ViTForImageClassification", "",
                dict(image_size=16, patch_size=4, num_hidden_layers=LAYERS, hidden_size=64,
                     num_attention_heads=4, intermediate_size=128, num_labels=4)),
    "clip_text": _lm("CLIPTextConfig", "CLIPTextModel", "right"),
}


class Logits(torch.nn.Module):
    """A causal LM / masked LM as the pass harness calls it: ``(ids, mask) -> logits``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids, mask=None):
        return self.model(input_ids=ids, attention_mask=mask).logits


def no_dropout(model: torch.nn.Module) -> None:
    """Both runs must compute the same function: every dropout probability is zero -- the dropout
    modules', and the floats that models copy from their config at construction (``self.dropout``,
    ``layerdrop``) or read from it at run time (SDPA's ``dropout_p``)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        cfg = getattr(m, "config", None)
        holders = [(m, vars(m))] + ([(cfg, cfg.to_dict())] if cfg is not None else [])
        for holder, attrs in holders:
            for key, value in attrs.items():
                if "drop" in key and isinstance(value, float):
                    setattr(holder, key, 0.0)


def _mask(padding: str) -> torch.Tensor:
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, slice(0, PADDED) if padding == "left" else slice(SEQ - PADDED, SEQ)] = 0
    return mask


def _inputs(model: torch.nn.Module, padding: str) -> dict[str, torch.Tensor]:
    """A batch in the layout the model's own preprocessing gives: pad tokens (and labels -100)
    where the attention mask is 0."""
    cfg = model.config
    ids = torch.randint(3, VOCAB, (BATCH, SEQ))  # 0..2 are the special tokens
    if type(model).__name__.startswith("ViT"):
        return {"pixel_values": torch.randn(BATCH, 3, cfg.image_size, cfg.image_size),
                "labels": torch.randint(0, cfg.num_labels, (BATCH,))}
    if type(model).__name__.startswith("Whisper"):
        labels = ids[:, : SEQ // 2].clone()
        labels[1, -2:] = -100
        return {"input_features": torch.randn(BATCH, cfg.num_mel_bins, 2 * cfg.max_source_positions),
                "labels": labels}
    mask = _mask(padding)
    ids = ids.masked_fill(mask == 0, cfg.pad_token_id)
    kwargs = {"input_ids": ids, "attention_mask": mask}
    if cfg.is_encoder_decoder:
        labels = torch.randint(3, VOCAB, (BATCH, SEQ // 2))
        labels[1, -2:] = -100  # a shorter target, padded the way DataCollatorForSeq2Seq pads it
        return kwargs | {"labels": labels}
    if not type(model).__name__.startswith("CLIP"):  # CLIP's text tower has no loss: see loss_of
        kwargs["labels"] = ids.masked_fill(mask == 0, -100)
    return kwargs


def build(name: str, impl: str = "sdpa", device: str = "cpu", variant: str = "no_cache"):
    """``(model, kwargs)`` on ``device``: the model in training mode with dropout off, ``use_cache``
    and gradient checkpointing as ``variant`` says (:data:`VARIANTS`)."""
    import transformers

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; valid: {', '.join(VARIANTS)}")
    torch.manual_seed(0)
    spec = MODELS[name]
    model = spec.make(transformers, impl)
    assert model.config._attn_implementation == impl, (name, impl, model.config._attn_implementation)
    if variant == "no_cache":
        model.config.use_cache = False
    if variant == "checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    no_dropout(model)
    kwargs = {k: v.to(device) for k, v in _inputs(model, spec.padding).items()}
    return model.to(device).train(), kwargs


def loss_of(out) -> torch.Tensor:
    """The model's own loss; for a model without one (CLIP's text tower) the mean squared distance of
    its hidden states and pooled output from fixed random targets. (Not their mean square: after the
    final LayerNorm that is nearly constant, and its gradient is rounding noise.)"""
    if getattr(out, "loss", None) is not None:
        return out.loss
    tensors = (out.last_hidden_state.float(), out.pooler_output.float())
    targets = torch.Generator().manual_seed(0)
    return sum((t - torch.randn(t.shape, generator=targets).to(t.device)).square().mean() for t in tensors)


@dataclasses.dataclass
class Step:
    loss: torch.Tensor
    outputs: dict[str, torch.Tensor]  # every tensor the model returned (a cache's keys and values too)
    grads: dict[str, torch.Tensor | None]  # parameter name -> gradient (None: not reached)


def _tensors(name: str, value: Any):
    """``(name, tensor)`` for every tensor of one model output: a tensor, a tuple of them (hidden
    states), and the keys and values of a cache (``DynamicCache`` layers; an encoder-decoder's
    self- and cross-attention caches)."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from _tensors(f"{name}.{i}", v)
    elif hasattr(value, "self_attention_cache"):
        yield from _tensors(f"{name}.self", value.self_attention_cache)
        yield from _tensors(f"{name}.cross", value.cross_attention_cache)
    elif hasattr(value, "layers"):
        for i, layer in enumerate(value.layers):
            for part in ("keys", "values"):
                yield from _tensors(f"{name}.{i}.{part}", getattr(layer, part, None))


def step(run, model: torch.nn.Module, kwargs: dict, autocast: bool = False) -> Step:
    """One forward and backward of ``run`` (the model or its compiled form)."""
    with torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16, enabled=autocast):
        out = run(**kwargs)
    loss = loss_of(out)
    loss.backward()
    outputs = {k: v.detach().float() for name, value in out.items() if name != "loss"
               for k, v in _tensors(name, value)}
    grads = {n: None if p.grad is None else p.grad.detach().float() for n, p in model.named_parameters()}
    return Step(loss.detach().float(), outputs, grads)


def compiled_and_eager(name: str, impl: str, backend: str = "enn", options: dict | None = None,
                       device: str = "cpu", autocast: bool = False, variant: str = "no_cache") -> tuple[Step, Step]:
    """The same weights and batch on ``device``, one step compiled with ``backend`` and one in eager
    (both under bf16 autocast with ``autocast``)."""
    model, kwargs = build(name, impl, device, variant)
    reference = copy.deepcopy(model)
    kw = {} if options is None else {"options": options}
    return (step(torch.compile(model, backend=backend, **kw), model, kwargs, autocast),
            step(reference, reference, kwargs, autocast))


def _nonfinite(t: torch.Tensor | None) -> int:
    return 0 if t is None else int((~torch.isfinite(t)).sum())


def _error(a: torch.Tensor, b: torch.Tensor, norm: float, atol: float) -> tuple[float, int]:
    """``(|a - b| / norm, elements outside allclose(rtol=RTOL, atol))``; NaN counts as infinitely far."""
    if a.shape != b.shape:
        return math.inf, b.numel()
    d = (a - b).abs().nan_to_num(nan=math.inf)
    far = int((d > atol + RTOL * b.abs()).sum())
    total = d.norm().item()
    return (total / norm if norm > 0 else (0.0 if total == 0 else math.inf)), far


def differences(got: Step, want: Step) -> dict[str, Any]:
    """What differs between a compiled step and eager's, per tensor: the relative L2 error and the
    number of elements outside ``allclose(rtol=RTOL, atol=ATOL * scale)``, where the scale is the
    largest magnitude of that kind of tensor (all gradients, or one output); plus non-finite counts
    and the gradients one side has and the other lacks."""
    norms = {n: g.norm().item() for n, g in want.grads.items() if g is not None}
    gmax = max((g.abs().max().item() for g in want.grads.values() if g is not None), default=0.0)
    # a gradient that is exactly zero in eager (a key bias: softmax ignores a constant shift) is
    # measured against the model's gradient scale, not against its own zero norm
    floor = 1e-3 * max(norms.values(), default=0.0)
    return {
        "loss": _error(got.loss, want.loss, abs(want.loss.item()), ATOL * abs(want.loss.item())),
        "outputs": {k: _error(v, want.outputs[k], want.outputs[k].norm().item(),
                              ATOL * want.outputs[k].abs().max().item())
                    for k, v in got.outputs.items() if k in want.outputs},
        "grads": {n: _error(got.grads[n], want.grads[n], max(norms[n], floor), ATOL * gmax)
                  for n in norms if got.grads.get(n) is not None},
        "missing_grads": sorted(n for n, g in want.grads.items() if (g is None) != (got.grads.get(n) is None)),
        "nonfinite": {"loss": _nonfinite(got.loss),
                      "outputs": sum(_nonfinite(v) for v in got.outputs.values()),
                      "grads": sum(_nonfinite(g) for g in got.grads.values())},
        "eager_nonfinite": _nonfinite(want.loss) + sum(_nonfinite(v) for v in want.outputs.values())
        + sum(_nonfinite(g) for g in want.grads.values()),
    }


def problems(d: dict[str, Any], report: dict | None) -> list[str]:
    """Every way a compiled step of a healthy model misses eager's, one line each (empty: passed).
    ``report``: enn's report (``to_dict()``), which must show a compiled forward and backward and no
    fallback line; None for another backend."""
    out = [f"eager itself has {d['eager_nonfinite']} non-finite values: not a healthy model"] * bool(d["eager_nonfinite"])
    out += [f"{what}: {n} non-finite values" for what, n in d["nonfinite"].items() if n]
    out += [f"gradient {n} is None on one side only" for n in d["missing_grads"]]
    named = [("loss", d["loss"])] + [(f"output {k}", e) for k, e in d["outputs"].items()] \
        + [(f"grad {n}", e) for n, e in sorted(d["grads"].items(), key=lambda kv: -kv[1][0])]
    out += [f"{what}: relative error {rel:.3g}, {far} elements outside allclose"
            for what, (rel, far) in named if not rel <= RTOL or far]
    return out + ([] if report is None else enn_findings(report))


def enn_findings(report: dict) -> list[str]:
    """What enn's report shows that a healthy model must not: a phase it did not compile, fallback lines."""
    phases = {g["phase"] for g in report["graphs"] if g["path"] == "inductor"}
    out = [f"enn compiled no {phase} graph" for phase in ("forward", "backward") if phase not in phases]
    return out + [f"fallback {f['kind']} [{f['phase']}] {f['node'] or '-'}: {f['reason']}" for f in report["fallbacks"]]


# ---------------------------------------------------------------------------------------------
# the sweep's table


def _row(name: str, impl: str, backend: str, variant: str = "no_cache", options: dict | None = None) -> dict[str, Any]:
    torch._dynamo.reset()
    enn_backend.reset()
    start = time.perf_counter()
    try:
        d = differences(*compiled_and_eager(name, impl, backend, options, variant=variant))
    except Exception as e:  # a row, not a crash: the table must cover every model
        d, error = None, f"raised {type(e).__name__}: {e}"[:500]
    report = enn_backend.report().to_dict() if backend == "enn" else None
    row = {"model": name, "impl": impl, "variant": variant, "seconds": time.perf_counter() - start,
           "fallbacks": report["fallbacks"] if report else [],
           "fused": (report["fusions"].get("attention", 0) if report else 0)}
    if d is None:
        return row | {"problems": [error, *(enn_findings(report) if report else [])]}
    worst = max(d["grads"].items(), key=lambda kv: kv[1][0], default=("-", (0.0, 0)))
    return row | {"loss_err": d["loss"][0], "output_err": max((e[0] for e in d["outputs"].values()), default=0.0),
                  "max_grad_err": worst[1][0], "worst_grad": worst[0],
                  "grads_over": sum(1 for rel, far in d["grads"].values() if not rel <= RTOL or far),
                  "nonfinite": d["nonfinite"], "problems": problems(d, report)}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import collections
    import json
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*", help=f"default: all of {', '.join(MODELS)}")
    p.add_argument("--backend", default="enn")
    p.add_argument("--impl", default=",".join(IMPLEMENTATIONS))
    p.add_argument("--variant", default="no_cache", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--options", default=None, help="enn's options as JSON, e.g. '{\"attention_order\": \"flash,explicit\"}'")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}; valid: {', '.join(MODELS)}")
    root = tempfile.mkdtemp(prefix="enn-hf-sweep-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")
    rows, start = [], time.perf_counter()
    options = json.loads(args.options) if args.options else None
    cases = [(n, i, v) for n in args.models or MODELS for i in args.impl.split(",") for v in args.variant.split(",")]
    for name, impl, variant in cases:
        # each case starts from no kernel state, as each test does: a pin persisted for one
        # model would otherwise be applied to the next ones
        os.environ["ENN_CACHE_DIR"] = os.path.join(root, name, impl, variant, "cache")
        os.environ["ENN_REPRO_DIR"] = os.path.join(root, name, impl, variant, "repros")
        r = _row(name, impl, args.backend, variant, options)
        rows.append(r)
        kinds = collections.Counter(f["kind"] for f in r["fallbacks"])
        verdict = "FAIL" if r["problems"] else "pass"
        numbers = "" if "loss_err" not in r else (
            f"loss {r['loss_err']:.1e} out {r['output_err']:.1e} grad {r['max_grad_err']:.1e} "
            f"({r['grads_over']} over, worst {r['worst_grad']}) nonfinite {r['nonfinite']} ")
        print(f"{name:10} {impl:5} {variant:13} {verdict} fused {r['fused']} {numbers}fallbacks {dict(kinds)} "
              f"{r['seconds']:.1f}s", flush=True)
        for line in r["problems"]:
            print(f"    {line}", flush=True)
    print(f"total {time.perf_counter() - start:.1f}s for {len(rows)} cases")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 1 if any(r["problems"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
