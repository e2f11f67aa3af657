"""Hugging Face GPT-2 with transformers' default attention dropout (0.1): every layer's attention
fused with the kernel's dropout, eager and SDPA attention (the model's SDPA call with dropout
decomposes to SDPA's math on CPU, which the pass reads as hand-written attention); in eval mode
(dropout off) values and gradients equal eager's. CPU, tiny model, pass harness."""

from __future__ import annotations

import pytest
import torch

from attention_cases import UNFUSED, enn
from pass_harness import assert_ops, find_ops, run_passes
from test_attention_dropout import DROPOUT, P, no_square_tensor

transformers = pytest.importorskip("transformers")

from _hf import Logits as _Logits  # noqa: E402


@pytest.fixture(autouse=True)
def _fuse_tiny(monkeypatch):
    """Tiny CPU attention is left to Inductor by default; this order makes enn fuse it."""
    monkeypatch.setenv("ENN_ATTENTION_ORDER", "flash,explicit")


def _gpt2(training: bool, impl: str = "eager") -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=1,
                                  eos_token_id=2, attn_implementation=impl)
    assert cfg.attn_pdrop == P  # transformers' default
    model = transformers.GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    return _Logits(model).train(training)


GPT2_T = 12  # != the head dim (16)


def _ids_and_left_padding():
    ids = torch.randint(3, 64, (2, GPT2_T), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, GPT2_T, dtype=torch.long)
    mask[1, :4] = 0
    return ids, mask


def test_hf_gpt2_attention_dropout_is_fused():
    """GPT-2 in training, attention dropout 0.1: both layers' attention is one kernel with
    dropout_p = 0.1 and the causal flag; no T x T tensor is left."""
    ids, _ = _ids_and_left_padding()
    run = run_passes(_gpt2(True), [ids], ["attention"])
    assert run.matches == {"attention": 2}
    assert [c["dropout"] for c in run.choices] == [P, P], run.choices
    assert [(n.args[DROPOUT], n.args[7]) for n in find_ops(run.after, enn.attention)] == [(P, True), (P, True)]
    assert_ops(run.after, absent=UNFUSED)
    no_square_tensor(run.after, GPT2_T)


def test_hf_gpt2_left_padded_dropout_keeps_its_mask_tensor_and_says_why():
    """With left padding, rows that keep no key are eager's uniform rows, dropped too: the mask
    stays a tensor (the key-padding closed form has no dropout), recorded in the kernel choice."""
    run = run_passes(_gpt2(True), list(_ids_and_left_padding()), ["attention"])
    assert run.matches == {"attention": 2}
    for c in run.choices:
        assert c["dropout"] == P and "closed form of those rows does not" in c["reason"], c


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "left-padded"])
def test_hf_gpt2_eval_is_exact(padded):
    """Eval mode (dropout off): fused as without dropout, values and gradients equal eager's."""
    ids, mask = _ids_and_left_padding()
    run = run_passes(_gpt2(False), [ids, mask] if padded else [ids], ["attention"])
    assert run.matches == {"attention": 2}
    assert [c["dropout"] for c in run.choices] == [0.0, 0.0]
    run.check_eager()


def test_hf_gpt2_sdpa_call_with_dropout_is_fused():
    """attn_implementation="sdpa": on CPU the model's SDPA call with dropout_p = 0.1 becomes SDPA's
    math (safe softmax, dropout) in the graph; the pass fuses it with dropout_p = 0.1, rows whose
    keys are all masked giving 0 as SDPA's math does."""
    ids, mask = _ids_and_left_padding()
    run = run_passes(_gpt2(True, "sdpa"), [ids, mask], ["attention"])
    assert run.matches == {"attention": 2}
    assert [c["dropout"] for c in run.choices] == [P, P], run.choices
    assert [(n.args[DROPOUT], n.args[10]) for n in find_ops(run.after, enn.attention)] == [(P, "zero")] * 2
    assert_ops(run.after, absent=UNFUSED)
