"""Code enn did not write: Hugging Face ``transformers`` models (tests/_hf.py: tiny random configs,
no download, fp32, a padded batch) take one training step under ``torch.compile(backend="enn")``
with default options. The loss, every output and every parameter gradient equal eager's within
1e-3 (relative L2 error, and allclose at rtol 1e-3 and atol 1e-4 of the largest magnitude), nothing
is NaN, and enn's report holds no fallback line: these models are healthy, so enn has nothing to
fall back from.

By default the sweep runs a subset: the models of issue 20's reproducer (LLaMA, Mistral, Qwen2 with
SDPA and left padding), LLaMA on eager attention, an encoder and an encoder-decoder. The other 28
cases are marked ``slow`` and skipped unless ``HF_SWEEP=full``, which runs every model with both
attention implementations (``python tests/_hf.py`` prints the same sweep as a table).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

import _hf  # noqa: E402

import enn_backend  # noqa: E402

from enn_backend.custom_ops.attention.safe_paths import _cpu_flash_safe  # noqa: E402

FULL = os.environ.get("HF_SWEEP", "") == "full"
SUBSET = {
    ("llama", "sdpa"), ("mistral", "sdpa"), ("qwen2", "sdpa"),  # issue 20: GQA, SDPA, left padding
    ("llama", "eager"),  # the same model on transformers' hand-written attention
    ("bert", "sdpa"),  # an encoder, right padding: no query row without keys
    ("whisper", "sdpa"),  # encoder-decoder, no attention mask input: only the decoder's causal mask
}
CASES = [pytest.param(name, impl, marks=() if (name, impl) in SUBSET else
                      (pytest.mark.slow, pytest.mark.skipif(not FULL, reason="HF_SWEEP=full runs the whole sweep")))
         for name in _hf.MODELS for impl in _hf.IMPLEMENTATIONS]


@pytest.mark.parametrize("name,impl", CASES)
def test_hf_training_step_default_options(name, impl, tmp_path, monkeypatch):
    monkeypatch.setenv("ENN_CACHE_DIR", str(tmp_path / "cache"))  # no other case's kernel state
    monkeypatch.setenv("ENN_REPRO_DIR", str(tmp_path / "repros"))
    got, want = _hf.compiled_and_eager(name, impl)
    problems = _hf.problems(_hf.differences(got, want), enn_backend.report().to_dict())
    assert not problems, f"{name} ({impl}):\n  " + "\n  ".join(problems)


# The guard on a GPU (an H100's table of the same check over more cases: bench/results/gpu-h100/hf_guard.log).
# Five cases of the sweep on CUDA, in fp32 and under bf16 autocast, across SDPA and hand-written
# attention, left and right padding, decoders and an encoder. Under bf16 compiled and
# eager round differently: the H100 measured relative gradient errors up to 9.2e-3 and loss errors
# up to 2.5e-4, so the bar there is 3e-2 and 2e-3; fp32 keeps the CPU sweep's bar (1e-3, H100: < 6e-7).
GPU_CASES = [("llama", "sdpa", False), ("llama", "sdpa", True), ("qwen2", "eager", True),
             ("gpt2", "eager", False), ("bert", "sdpa", True)]
BF16_GRAD_RTOL, BF16_LOSS_RTOL = 3e-2, 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name,impl,autocast", GPU_CASES,
                         ids=[f"{n}-{i}-{'bf16' if a else 'fp32'}" for n, i, a in GPU_CASES])
def test_hf_training_step_default_options_gpu(name, impl, autocast):
    """One training step under the guard with default options on CUDA: no fallback line, nothing
    non-finite, a compiled forward and backward, and the loss and every gradient at eager's."""
    got, want = _hf.compiled_and_eager(name, impl, device="cuda", autocast=autocast)
    d = _hf.differences(got, want)
    report = enn_backend.report().to_dict()
    if not autocast:
        problems = _hf.problems(d, report)
    else:  # bf16: the same checks, with the bf16 bar on the relative errors and no allclose count
        problems = _hf.enn_findings(report)
        problems += [f"{what}: {n} non-finite values" for what, n in d["nonfinite"].items() if n]
        problems += [f"eager: {d['eager_nonfinite']} non-finite values"] * bool(d["eager_nonfinite"])
        problems += [f"gradient {n} is None on one side only" for n in d["missing_grads"]]
        problems += [f"loss: relative error {d['loss'][0]:.3g}"] * (not d["loss"][0] <= BF16_LOSS_RTOL)
        problems += [f"grad {n}: relative error {rel:.3g}" for n, (rel, _) in sorted(d["grads"].items())
                     if not rel <= BF16_GRAD_RTOL]
    assert not problems, f"{name} ({impl}, {'bf16' if autocast else 'fp32'}):\n  " + "\n  ".join(problems)


def _fully_masked_rows():
    """Issue 20, item 1 at the op level: q, k, v [1, 1, 4, 8] and a float mask whose rows 0-1 are
    all ``-inf``; ATen's CPU flash kernel and enn's safe path for it, both run forward."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 4, 8) for _ in range(3))
    mask = torch.zeros(1, 1, 4, 4)
    mask[..., :2, :] = float("-inf")
    aten = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask)
    return (q, k, v, mask), aten, _cpu_flash_safe(q, k, v, attn_mask=mask)


def test_cpu_flash_safe_path_saves_atens_lse_on_fully_masked_rows():
    """The safe path stands in for the ATen kernel, whose backward may read what it saved: the
    output and the log-sum-exp must be ATen's (ATen gives 0 for a row with no key)."""
    _, (out, lse), (safe_out, safe_lse) = _fully_masked_rows()
    torch.testing.assert_close(safe_out, out)
    torch.testing.assert_close(safe_lse, lse, msg=lambda m: f"log-sum-exp differs from ATen's: {m}")


def test_cpu_flash_backward_finite_from_safe_path_lse():
    """ATen's backward fed the safe path's output and log-sum-exp returns ATen's own finite dq, dk, dv."""
    (q, k, v, mask), (out, lse), (safe_out, safe_lse) = _fully_masked_rows()
    g = torch.randn_like(out)
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    want = backward(g, q, k, v, out, lse, 0.0, False, attn_mask=mask)
    got = backward(g, q, k, v, safe_out, safe_lse, 0.0, False, attn_mask=mask)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), f"{name}: {int((~torch.isfinite(a)).sum())} non-finite of {a.numel()}"
        torch.testing.assert_close(a, b, msg=lambda m, n=name: f"{n}: {m}")
