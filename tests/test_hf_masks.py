"""Mask structure from provenance: the masks ``transformers`` 5 builds (``masking_utils``: causal
``arange`` compares, ``and_masks``, ``padding_mask_function`` on the ``[B, T]`` attention mask,
sliding windows, ``finfo.min`` fills on the eager path, boolean masks on the SDPA path), read
back to a structure by the attention pass. CPU, tiny models (2 layers, T=16), pass harness:
the structure each site gets, and values and gradients equal to eager's, left padding and its
fully masked query rows included. Near misses keep their mask tensor, with the reason."""

from __future__ import annotations

import pytest
import torch

from attention_cases import B, CPU_FLASH, enn
from pass_harness import find_ops, run_passes

transformers = pytest.importorskip("transformers")

from _hf import no_dropout  # noqa: E402

LAYERS, SEQ, PADDED = 2, 16, 5


@pytest.fixture(autouse=True)
def _fuse_tiny(monkeypatch):
    """Tiny CPU attention is left to Inductor by default; this order makes enn fuse eager sites."""
    monkeypatch.setenv("ENN_ATTENTION_ORDER", "flash,explicit")


class _Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids, mask=None):
        return self.model(input_ids=ids, attention_mask=mask).logits


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


def _run(family: str, impl: str, padded: bool, window: int = 0):
    """The pass on the model's training graph; values and gradients checked against eager."""
    model = _model(family, impl, window)
    ids = torch.randint(3, 128, (B, SEQ))
    args = [ids]
    if padded:  # batched generation's layout: the second prompt padded on the left
        mask = torch.ones(B, SEQ, dtype=torch.long)
        mask[1, :PADDED] = 0
        args = [ids.masked_fill(mask == 0, 0), mask]
    run = run_passes(_Logits(model), args, ["attention"], training=True)
    run.check_eager()  # the logits of every position (padded rows too) and every parameter's gradient
    return run


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
    got = [c for c in run.choices if c.get("fused", True)]
    assert len(got) == LAYERS and all(c["causal"] and c["window"] == 4 and not c["bias"] for c in got), got
    assert len(find_ops(run.after, enn.attention)) == LAYERS
