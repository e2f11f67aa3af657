"""Which kernel runs an attention: the kernels' pure checkers and the policy's order
(enn_backend/passes/attention/policy.py). Metadata only: no graph, no device."""

from __future__ import annotations

import pytest

from enn_backend.custom_ops.attention import Backend
from enn_backend.custom_ops.pinned import SAFE_PATHS
from enn_backend.passes.attention.kernels.sdpa import NATIVE, check_efficient
from enn_backend.passes.attention.policy import CHECKERS, AttentionProblem, choose


def problem(**kw):
    base = dict(device="cuda", capability=(9, 0), dtype="bfloat16", head_dim=64, head_dim_v=64, tq=1024, tk=1024,
                heads_q=16, heads_kv=16, causal=True, window=0, has_mask=False, has_bias=False, bias_grad=False,
                alibi=False, training=True, batch=4)
    base.update(kw)
    return AttentionProblem(**base)


def test_policy_choices():
    assert choose(problem()).backend == "cudnn"
    assert choose(problem(capability=(8, 0))).backend == "flash"
    # Grouped-query K/V (HF's repeat_kv): cuDNN, like flash, reads the K/V heads themselves (tests/test_attention_gqa.py).
    assert choose(problem(heads_kv=4)).backend == "cudnn"
    assert choose(problem(dtype="float32")).backend == "efficient"
    assert choose(problem(has_mask=True, causal=False)).backend == "inductor"  # measured faster than SDPA with a mask
    assert choose(problem(has_mask=True, causal=False), backend="efficient").backend == "efficient"
    assert choose(problem(alibi=True)).backend == "flex"  # FlexAttention ops in the graph
    assert choose(problem(window=64)).backend == "flex"
    assert choose(problem(alibi=True, static_shapes=False)).backend == "inductor"  # flex needs fixed lengths
    assert choose(problem(), order="flash,cudnn").backend == "flash"
    cpu = dict(device="cpu", capability=(0, 0))
    assert choose(problem(**cpu)).backend == "inductor"  # training: Inductor measured faster
    assert choose(problem(**cpu, training=False)).backend == "cpu_flash"  # causal inference: flash faster
    assert choose(problem(**cpu, training=False, causal=False)).backend == "cpu_flash"
    for masked in (dict(has_mask=True), dict(has_bias=True), dict(alibi=True), dict(window=16)):
        assert choose(problem(**cpu, training=False, **masked)).backend == "inductor", masked
    assert choose(problem(device="cpu", capability=(0, 0)), order="flash").backend == "cpu_flash"
    assert choose(problem(device="cpu", capability=(0, 0), tq=8, tk=8)).backend == "inductor"
    assert choose(problem(device="cpu", capability=(0, 0), bias_grad=True, has_bias=True)).backend == "explicit"
    forced = choose(problem(device="cpu", capability=(0, 0)), backend="cudnn")
    assert forced.backend == "cpu_flash" and "cudnn impossible" in forced.forced_failed  # a forced kernel stays fused


def test_small_cuda_key_padding_stays_with_inductor():
    """Below CUDA_MIN_PADDING_SCORES a key-padding site's fused path costs more host time than it
    saves on the device (bench/gpu_attention_size.py): T5's cross-attention (6.3M scores) stays
    with Inductor, with the reason; BERT's (50M) is fused; a forced order still fuses."""
    t5_cross = problem(causal=False, has_bias=True, bias_finite=True, key_padding=True, training=False,
                       batch=8, heads_q=12, heads_kv=12, tq=128, tk=512)
    got = choose(t5_cross)
    assert got.backend == "inductor" and "6.3M scores" in got.reason and "host time" in got.reason, got
    bert = problem(causal=False, has_bias=True, bias_finite=True, key_padding=True, training=False,
                   batch=16, heads_q=12, heads_kv=12, tq=512, tk=512)
    assert choose(bert).backend == "cudnn"
    assert choose(t5_cross, order="cudnn,efficient").backend == "cudnn"
    assert choose(problem(batch=1, tq=128, tk=128)).backend == "cudnn"  # no padding: no threshold


def test_policy_sends_saturating_biases_to_the_memory_efficient_kernel_except_in_fp16():
    """A finfo.min bias can mask a whole row. In bf16 / fp32 the kernel gets SATURATED_FLOOR
    there and gives eager's uniform row; fp16 cannot hold a bias that absorbs the scores, so
    there the policy leaves such attention to Inductor (a -10000 mask cannot saturate)."""
    base = dict(device="cuda", capability=(9, 0), head_dim=64, head_dim_v=64, tq=512, tk=512,
                heads_q=12, heads_kv=12, causal=False, window=0, has_mask=False, has_bias=True, bias_grad=False,
                alibi=False, training=True, bias_finite=True)
    for dtype in ("bfloat16", "float32"):
        assert choose(AttentionProblem(**base, dtype=dtype)).backend == "efficient"
        assert choose(AttentionProblem(**base, dtype=dtype, bias_may_saturate=True)).backend == "efficient"
    assert choose(AttentionProblem(**base, dtype="float16")).backend == "efficient"
    saturating = AttentionProblem(**base, dtype="float16", bias_may_saturate=True)
    assert choose(saturating).backend == "inductor"
    ok, why = check_efficient(saturating)
    assert not ok and "fp16" in why


def test_every_backend_has_a_checker_and_a_forced_choice_stays_fused():
    assert set(CHECKERS) == set(Backend)
    cpu = problem(device="cpu", capability=(0, 0))
    for name in ("cudnn", "flash", "efficient", "math", "flex", "explicit"):  # the options' names
        assert choose(cpu, backend=name).backend != "inductor", name


@pytest.mark.parametrize("backend", sorted(NATIVE))
def test_every_emitted_sdpa_op_names_a_registered_safe_path(backend):
    """The guard's eager reference runs the safe path of each op the pass emits (EMITTED)."""
    import enn_backend.custom_ops  # noqa: F401  (registers the safe paths)

    kernel = NATIVE[backend]
    assert kernel.safe_paths and all(name in SAFE_PATHS for name in kernel.safe_paths), kernel.safe_paths
    ops = {f"aten.{op._schema.name.split('::')[1]}.{op._overloadname}" for op in (kernel.forward, kernel.backward)}
    assert set(kernel.safe_paths) <= ops


def test_policy_runs_a_causal_key_padding_site_as_cudnn_then_memory_efficient():
    """A finfo.min mask of a band and key padding (key_padding.py): the causal flag plus a
    [B, 1, 1, Tk] bias whose dead rows the pass fixes up, so fp16 is fine too. cuDNN on Hopper,
    memory-efficient before it (flash takes no bias); a window with padding has no kernel that
    takes both without a T x T tensor: Inductor."""
    padded = dict(has_bias=True, bias_finite=True, key_padding=True, heads_kv=4)
    assert choose(problem(**padded)).backend == "cudnn"
    assert choose(problem(**padded, dtype="float16")).backend == "cudnn"
    assert choose(problem(**padded, capability=(8, 0))).backend == "efficient"
    assert choose(problem(**padded, capability=(8, 0), dtype="float16")).backend == "efficient"
    assert choose(problem(**padded, head_dim=256, head_dim_v=256)).backend == "efficient"  # cuDNN: <= 128
    assert choose(problem(**padded, window=64)).backend == "inductor"
    assert choose(problem(has_bias=True, bias_finite=True)).backend == "efficient"  # any other bias: not cuDNN
    assert NATIVE[Backend.CUDNN].takes_bias


def test_the_attention_pass_hands_its_measurement_to_the_choice(tmp_path, monkeypatch):
    """With ``measure_ms`` the attention pass asks the registry to time the site's eligible kernels
    (on this CPU only ATen's flash kernel runs alone, so the timing itself is the GPU test below);
    without, it asks for the rules' choice."""
    import torch

    from attention_cases import causal_tril
    from enn_backend.passes.attention import plan
    from pass_harness import run_passes

    monkeypatch.setenv("ENN_CACHE_DIR", str(tmp_path))
    asked = []

    def spy(*args, measurement=None, **kwargs):
        asked.append(measurement)
        return choose(*args, measurement=measurement, **kwargs)

    monkeypatch.setattr(plan, "choose", spy)
    q, k, v = (torch.randn(1, 2, 96, 16) for _ in range(3))
    run_passes(causal_tril, (q, k, v), ["attention"], training=False, options={"measure_ms": 10})
    run_passes(causal_tril, (q, k, v), ["attention"], training=False)
    measured, rules = asked
    assert measured.budget_ms == 10 and measured.cache.path.startswith(str(tmp_path))
    assert rules is None


@pytest.mark.gpu
def test_an_attention_site_is_measured_on_cuda(tmp_path, monkeypatch):
    """On CUDA the SDPA kernels of a causal bf16 attention are timed on the site's shapes; the
    times are reported with the choice and cached: the next compile takes it without timing."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import math

    from pass_harness import run_passes

    def causal(q, k, v):  # attention_cases.causal_tril with its mask on the inputs' device
        t = q.size(-2)
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool, device=q.device))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        return torch.softmax(att.masked_fill(~mask, float("-inf")), dim=-1) @ v

    monkeypatch.setenv("ENN_CACHE_DIR", str(tmp_path))
    q, k, v = (torch.randn(2, 8, 512, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    runs = [run_passes(causal, (q, k, v), ["attention"], training=False, options={"measure_ms": 20})
            for _ in range(2)]
    first, again = ([c for c in r.choices if c.get("how")] for r in runs)
    assert [c["how"] for c in first] == ["measured"] and len(first[0]["timings_ms"]) >= 2, first
    assert [c["how"] for c in again] == ["cached"], again
