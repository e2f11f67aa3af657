"""The kernel registry (enn_backend/registry): checkers and rules as tables, measurement, the
choice cache (its key, its file, the CLI, torch.compiler's cache artifacts)."""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import math
import os
import shlex
import time

import pytest
import torch

from enn_backend import registry as R
from enn_backend.cli import main as cli
from enn_backend.custom_ops import gemm_policy as P
from enn_backend.custom_ops.attention import Backend
from enn_backend.options import Options, OptionsError
from enn_backend.passes.attention import policy as AP
from enn_backend.passes.attention.problem import AttentionProblem
from enn_backend.registry import cache as C
from enn_backend.registry import measure as M

GK = P.GemmKernel
CUDA = P.HwCaps("cuda", cublaslt=True)
CPU = P.HwCaps("cpu", onednn=True, onednn_bf16=True, onednn_fp16=False)
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32


def gp(device="cuda", dtype=bf16, act="gelu_tanh", bias=True, residual=False, unfused=False, k=64, caps=None):
    return P.GemmProblem(device, dtype, act, bias, m=32, n=16, k=k, residual=residual, unfused=unfused,
                         caps=caps or (CUDA if device == "cuda" else CPU))


# ----------------------------------------------------------------------------- GEMM: checkers and rules
# problem -> (eligible kernels, in the rules' order; the rules' choice)
GEMM_TABLE = [
    (gp(act="relu"), [GK.CUBLASLT, GK.INDUCTOR], GK.CUBLASLT),
    (gp(act="gelu_tanh", dtype=fp16), [GK.CUBLASLT, GK.INDUCTOR], GK.CUBLASLT),
    (gp(act="gelu"), [GK.INDUCTOR], GK.INDUCTOR),  # cuBLASLt's GELU is tanh's
    (gp(act="silu"), [GK.INDUCTOR], GK.INDUCTOR),
    (gp(act="relu", bias=False), [GK.INDUCTOR], GK.INDUCTOR),  # _addmm_activation needs a bias
    (gp(act="relu", unfused=True), [GK.INDUCTOR], GK.INDUCTOR),  # epilogue_off
    (gp(act="none"), [GK.INDUCTOR], GK.INDUCTOR),  # bias: Inductor's addmm is cuBLAS's bias epilogue
    (gp(act="none", residual=True, bias=False), [GK.ADDMM, GK.INDUCTOR], GK.ADDMM),
    (gp(act="none", residual=True), [GK.INDUCTOR, GK.ADDMM], GK.INDUCTOR),  # the bias add costs what addmm saves
    (gp(act="none", residual=True, unfused=True), [GK.INDUCTOR], GK.INDUCTOR),
    (gp("cpu", act="gelu"), [GK.ONEDNN, GK.INDUCTOR], GK.ONEDNN),
    (gp("cpu", act="silu", bias=False), [GK.ONEDNN, GK.INDUCTOR], GK.ONEDNN),
    (gp("cpu", act="none"), [GK.INDUCTOR, GK.ONEDNN], GK.INDUCTOR),  # only measurement picks oneDNN
    (gp("cpu", dtype=fp32, act="relu"), [GK.INDUCTOR, GK.ONEDNN], GK.INDUCTOR),  # measured: not faster
    (gp("cpu", dtype=fp16), [GK.INDUCTOR], GK.INDUCTOR),  # no native fp16 GEMM here
    (gp("cpu", k=0), [GK.INDUCTOR], GK.INDUCTOR),  # oneDNN refuses K = 0
    (gp("cpu", caps=P.HwCaps("cpu", onednn=True)), [GK.INDUCTOR], GK.INDUCTOR),  # no native bf16
    (gp("cpu", act="none", residual=True, bias=False), [GK.ADDMM, GK.INDUCTOR], GK.ADDMM),
    (dataclasses.replace(gp(), autotune=True), [GK.INDUCTOR], GK.INDUCTOR),  # Inductor autotunes
    (dataclasses.replace(gp(), bias_dtype_matches=False), [GK.INDUCTOR], GK.INDUCTOR),
    (gp(dtype=torch.float64), [GK.INDUCTOR], GK.INDUCTOR),
    (gp("mps", caps=P.HwCaps("mps")), [GK.INDUCTOR], GK.INDUCTOR),
]


@pytest.mark.parametrize("problem, eligible, rule", GEMM_TABLE)
def test_gemm_checkers_and_rules(problem, eligible, rule):
    s = R.select(P.POLICY, problem)
    assert [GK(v.kernel) for v in s.verdicts if v.eligible] == eligible
    assert s.kernel is rule and s.how == "rule"
    assert all(v.reason for v in s.verdicts)
    assert P.check_inductor(problem)[0], "the un-fused path is behind every choice"


def test_every_gemm_kernel_has_a_checker_and_the_families_are_the_options():
    assert set(P.CHECKERS) == set(GK)
    assert P.FAMILIES == ("bias", "relu", "gelu", "gelu_tanh", "silu", "residual")


# ----------------------------------------------------------------------------- attention through the registry
def ap(**kw):
    base = dict(device="cuda", capability=(9, 0), dtype="bfloat16", head_dim=64, head_dim_v=64, tq=1024, tk=1024,
                heads_q=8, heads_kv=8, causal=True, window=0, has_mask=False, has_bias=False, bias_grad=False,
                alibi=False, training=False, batch=2)
    return AttentionProblem(**{**base, **kw})


@pytest.mark.parametrize("problem", [ap(), ap(capability=(8, 0)), ap(device="cpu", capability=(0, 0)),
                                     ap(has_mask=True), ap(alibi=True, causal=False), ap(device="mps")])
def test_attention_fallback_accepts_every_problem(problem):
    assert AP.POLICY.fallback is Backend.EXPLICIT
    assert AP.CHECKERS[AP.POLICY.fallback](problem)[0]


# ----------------------------------------------------------------------------- measurement
class Toy(str, enum.Enum):
    A = "a"
    B = "b"
    C = "c"
    OFF = "off"  # the fallback


def _toy_policy(times: dict[str, float], eligible=("a", "b", "c"), calls=None, key_dims=(1,)):
    calls = [] if calls is None else calls

    def runner(k, p):
        if k is Toy.OFF:
            return None

        def run():
            calls.append(k.value)
            return times[k.value]
        return run

    checkers = {k: (lambda p, k=k: (k.value in eligible or k is Toy.OFF, f"{k.value} rule")) for k in Toy}
    return R.Policy(op="toy", kernels=Toy, checkers=checkers, order=lambda p: (Toy.A, Toy.B, Toy.C),
                    fallback=Toy.OFF, runner=runner,
                    key=lambda p: R.choice_key("toy", key_dims, "", "", "float32", "cpu"))


@pytest.fixture
def fake_clock(monkeypatch):
    """Timing returns what the candidate returns (its 'time' in ms), so tests need no real clock."""
    monkeypatch.setattr(M, "time_ms", lambda fn, device, budget: fn())


@pytest.mark.parametrize("times, eligible, chosen, how", [
    ({"a": 1.0, "b": 0.5, "c": 0.9}, ("a", "b", "c"), Toy.B, "measured"),  # the fastest wins
    ({"a": 1.0, "b": 0.98, "c": 2.0}, ("a", "b", "c"), Toy.A, "measured"),  # within the margin: the rule's
    ({"a": 1.0, "b": 0.5, "c": 0.1}, ("a", "b"), Toy.B, "measured"),  # an ineligible kernel is never timed
    ({"a": 1.0, "b": 0.5, "c": 0.1}, ("a",), Toy.A, "rule"),  # one candidate: nothing to measure
    ({"a": 1.0, "b": 0.5, "c": 0.1}, (), Toy.OFF, "fallback"),  # none eligible: the fallback
])
def test_measurement_table(fake_clock, times, eligible, chosen, how):
    s = R.select(_toy_policy(times, eligible), None, measurement=R.Measurement(10))
    assert (s.kernel, s.how) == (chosen, how)
    assert set(s.timings_ms) <= set(eligible)


def test_a_sample_times_the_candidate_back_to_back(monkeypatch):
    """A sample is as many calls as fill SAMPLE_MS, timed together and counted per call: a
    0.2 ms call is timed in samples of 5, and its time is one call's."""
    calls: list[int] = []

    def candidate() -> None:
        calls.append(1)
        time.sleep(0.0002)

    timed = M.time_ms(candidate, "cpu", budget_ms=30)
    assert timed is not None and 0.15 <= timed < 1.0, timed
    per_sample = math.ceil(M.SAMPLE_MS / 0.2)
    assert len(calls) >= 2 + M.MIN_RUNS * (per_sample - 1), len(calls)  # warm-up, one sizing call, the samples


def test_measurement_off_is_the_rule(fake_clock):
    calls: list[str] = []
    s = R.select(_toy_policy({"a": 1.0, "b": 0.1, "c": 0.1}, calls=calls), None)
    assert (s.kernel, s.how, calls) == (Toy.A, "rule", [])


def test_a_cached_choice_is_taken_without_measuring(fake_clock, tmp_path):
    cache = C.ChoiceCache(str(tmp_path / C.FILE_NAME))
    calls: list[str] = []
    first = R.select(_toy_policy({"a": 1.0, "b": 0.5, "c": 0.9}, calls=calls), None, measurement=R.Measurement(10, cache))
    assert first.kernel is Toy.B and calls
    calls.clear()
    again = R.select(_toy_policy({"a": 1.0, "b": 0.5, "c": 0.9}, calls=calls), None,
                     measurement=R.Measurement(10, C.ChoiceCache(cache.path)))  # a new process reads the file
    assert (again.kernel, again.how, calls) == (Toy.B, "cached", [])


def test_a_cached_choice_that_is_no_longer_eligible_is_measured_again(fake_clock, tmp_path, caplog):
    cache = C.ChoiceCache(str(tmp_path / C.FILE_NAME))
    R.select(_toy_policy({"a": 1.0, "b": 0.5, "c": 0.9}), None, measurement=R.Measurement(10, cache))
    with caplog.at_level(logging.WARNING):
        s = R.select(_toy_policy({"a": 1.0, "b": 0.5, "c": 0.9}, eligible=("a", "c")), None,
                     measurement=R.Measurement(10, cache))
    assert (s.kernel, s.how) == (Toy.C, "measured") and "not eligible" in caplog.text


def test_real_timing_of_gemm_candidates_on_cpu(tmp_path):
    """Measured for real on this CPU: every eligible kernel timed, the choice among them."""
    p = P.GemmProblem("cpu", fp32, "none", False, m=16, n=24, k=40, residual=True)
    s = R.select(P.POLICY, p, measurement=R.Measurement(20, C.ChoiceCache(str(tmp_path / C.FILE_NAME))))
    assert set(s.timings_ms) == {"addmm", "inductor"} and s.how == "measured"
    assert s.kernel in (GK.ADDMM, GK.INDUCTOR)


def test_attention_measures_sdpa_kernels_on_cpu(tmp_path, monkeypatch):
    """CPU causal inference: the rules' cpu_flash and explicit are eligible; explicit cannot be
    timed alone, so the rule stands with a reason that says so."""
    p = ap(device="cpu", capability=(0, 0), dtype="float32", tq=128, tk=128, heads_q=2, heads_kv=2, head_dim=16,
           head_dim_v=16)
    choice = AP.choose(p, measurement=R.Measurement(20, C.ChoiceCache(str(tmp_path / C.FILE_NAME))))
    assert choice.backend is Backend.CPU_FLASH and choice.how == "rule" and "not measured" in choice.reason
    run = AP.runner(Backend.CPU_FLASH, p)
    assert run is not None and run().shape == (2, 2, 128, 16)
    assert AP.runner(Backend.CPU_FLASH, ap(device="cpu", has_mask=True)) is None


# ----------------------------------------------------------------------------- the cache key
def _key(**changes):
    base = dict(op="gemm_epilogue", dims=(64, 128, 256), layout="x:c w:c", epilogue="gelu+bias", dtype="bfloat16",
                device=R.DeviceInfo("NVIDIA H100 80GB HBM3", "9.0", 81559), workspace=":4096:8",
                versions=(("torch", "2.11.0"), ("triton", "3.6.0"), ("cublas", "12.9.1"), ("cudnn", "91002")))
    return R.ChoiceKey(**{**base, **changes})


@pytest.mark.parametrize("change", [
    dict(op="attention"), dict(dims=(64, 128, 255)), dict(dims=(1, 128, 256)), dict(layout="x:s w:c"),
    dict(epilogue="gelu"), dict(epilogue="gelu_tanh+bias"), dict(dtype="float16"),
    dict(device=R.DeviceInfo("NVIDIA H200", "9.0", 81559)), dict(device=R.DeviceInfo("NVIDIA H100 80GB HBM3", "8.0", 81559)),
    dict(device=R.DeviceInfo("NVIDIA H100 80GB HBM3", "9.0", 143771)), dict(workspace=""),
    dict(versions=(("torch", "2.12.0"), ("triton", "3.6.0"), ("cublas", "12.9.1"), ("cudnn", "91002"))),
    dict(versions=(("torch", "2.11.0"), ("triton", "3.7.0"), ("cublas", "12.9.1"), ("cudnn", "91002"))),
    dict(versions=(("torch", "2.11.0"), ("triton", "3.6.0"), ("cublas", "13.0.0"), ("cudnn", "91002"))),
    dict(versions=(("torch", "2.11.0"), ("triton", "3.6.0"), ("cublas", "12.9.1"), ("cudnn", "91100"))),
    dict(key_version=R.key.KEY_VERSION + 1),
])
def test_the_cache_key_changes_when_any_part_does(change):
    assert _key(**change).digest() != _key().digest()
    assert _key().digest() == _key().digest()
    assert R.ChoiceKey.from_json(json.loads(json.dumps(_key(**change).to_json()))) == _key(**change)


def test_this_machines_key_names_its_device_and_libraries():
    k = R.choice_key("gemm_epilogue", (1, 2, 3), "x:c w:c", "relu", "float32", "cpu")
    assert dict(k.versions)["torch"] == torch.__version__ and set(dict(k.versions)) == {"torch", "triton", "cublas",
                                                                                         "cudnn"}
    assert k.device.name and k.device.sm == str(torch.backends.cpu.get_cpu_capability())


# ----------------------------------------------------------------------------- the cache file
def _entry(kernel="onednn", **key):
    return C.make_entry(_key(**key), kernel, {"onednn": 1.0, "inductor": 2.0})


def test_the_cache_file_is_json_written_atomically(tmp_path):
    path = str(tmp_path / C.FILE_NAME)
    C.ChoiceCache(path).put(_entry())
    with open(path) as f:
        data = json.load(f)
    assert data["format"] == C.FORMAT and len(data["entries"]) == 1
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]
    assert C.ChoiceCache(path).get(_key()).kernel == "onednn"


@pytest.mark.parametrize("damage", ["garbage", "not an object", "wrong format"])
def test_a_corrupt_cache_file_is_ignored_and_logged(tmp_path, caplog, damage):
    path = tmp_path / C.FILE_NAME
    path.write_text({"garbage": "{not json", "not an object": "[1, 2]",
                     "wrong format": json.dumps({"format": "pickle", "version": 1, "entries": []})}[damage])
    with caplog.at_level(logging.WARNING):
        cache = C.ChoiceCache(str(path))
        assert cache.get(_key()) is None
    assert "ignoring kernel-choice cache" in caplog.text
    cache.put(_entry())  # and replaced at the next write
    assert C.ChoiceCache(str(path)).get(_key()) is not None


def test_a_foreign_or_malformed_entry_is_skipped_and_logged(tmp_path, caplog):
    good, foreign = _entry().to_json(), _entry(dims=(2, 2, 2)).to_json()
    foreign["key"]["dims"] = [9, 9, 9]  # its digest no longer names its key
    malformed = {**_entry(dims=(3, 3, 3)).to_json(), "kernel": 7}
    path = tmp_path / C.FILE_NAME
    path.write_text(json.dumps({"format": C.FORMAT, "version": C.VERSION, "entries": [good, foreign, malformed]}))
    with caplog.at_level(logging.WARNING):
        entries = C.ChoiceCache(str(path)).entries()
    assert [e.key for e in entries] == [_key()]
    assert "foreign entry" in caplog.text and "kernel must be a name" in caplog.text


def test_a_cached_kernel_unknown_to_the_op_is_measured_again(fake_clock, tmp_path, caplog):
    cache = C.ChoiceCache(str(tmp_path / C.FILE_NAME))
    policy = _toy_policy({"a": 1.0, "b": 0.5, "c": 0.9})
    cache.put(C.make_entry(policy.key(None), "zz", {}))
    with caplog.at_level(logging.WARNING):
        s = R.select(policy, None, measurement=R.Measurement(10, cache))
    assert s.how == "measured" and "not a kernel of this op" in caplog.text


def test_cli_lists_and_clears(tmp_path, capsys):
    path = str(tmp_path / C.FILE_NAME)
    C.ChoiceCache(path).put(_entry())
    C.ChoiceCache(path).put(C.make_entry(_key(op="attention"), "cudnn", {"cudnn": 1.0, "flash": 1.2}))
    assert cli(["registry", "list", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "gemm_epilogue" in out and "64x128x256" in out and "onednn" in out and "2 choices" in out
    assert cli(["registry", "list", "--cache-dir", str(tmp_path), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["entries"]) == 2
    assert cli(["registry", "clear", "--cache-dir", str(tmp_path), "--op", "attention"]) == 0
    assert "removed 1 kernel choice " in capsys.readouterr().out
    assert [e.key.op for e in C.ChoiceCache(path).entries()] == ["gemm_epilogue"]
    assert cli(["registry", "clear", "--cache-dir", str(tmp_path)]) == 0
    assert cli(["registry", "list", "--cache-dir", str(tmp_path)]) == 0
    assert "no kernel choices" in capsys.readouterr().out


def test_the_clear_command_registry_list_prints_works_when_pasted(tmp_path, capsys):
    folder = tmp_path / "a folder"  # a space: the printed command must quote it
    path = str(folder / C.FILE_NAME)
    C.ChoiceCache(path).put(_entry())
    assert cli(["registry", "list", "--cache-dir", str(folder)]) == 0
    command = shlex.split(capsys.readouterr().out.split("Clear: ")[1].splitlines()[0])
    assert command[:4] == ["python", "-m", "enn_backend", "registry"]
    assert cli(command[3:]) == 0 and C.ChoiceCache(path).entries() == []


def test_choices_travel_in_torch_compilers_cache_artifacts(tmp_path, monkeypatch):
    monkeypatch.setenv("ENN_CACHE_DIR", str(tmp_path / "a"))
    C.forget_loaded_caches()
    C.cache_for(Options.from_sources()).put(_entry())
    data, info = torch.compiler.save_cache_artifacts()
    assert _key().digest() in info.artifacts[C.ARTIFACT]
    monkeypatch.setenv("ENN_CACHE_DIR", str(tmp_path / "b"))  # a second machine
    C.forget_loaded_caches()
    torch.compiler.load_cache_artifacts(data)
    assert C.ChoiceCache(str(tmp_path / "b" / C.FILE_NAME)).get(_key()).kernel == "onednn"


# ----------------------------------------------------------------------------- options
@pytest.mark.parametrize("options, env, message", [
    ({"epilogue_off": "gelu,tanh"}, {}, "epilogue_off entry 'tanh'"),
    ({}, {"ENN_EPILOGUE_OFF": "relu,bogus"}, "epilogue_off entry 'bogus'"),
    ({"measure_ms": -1}, {}, "measure_ms must be >= 0"),
    ({}, {"ENN_MEASURE_MS": "fast"}, "must be an integer"),
    ({"nvtx": "maybe"}, {}, "must be a boolean"),
])
def test_bad_values_are_refused(options, env, message):
    with pytest.raises(OptionsError, match=message):
        Options.from_sources(options, environ=env)


def test_family_switches_and_budget():
    o = Options.from_sources({}, environ={"ENN_EPILOGUE_OFF": "gelu, residual", "ENN_MEASURE_MS": "25", "ENN_NVTX": "1"})
    assert o.unfused_epilogues() == {"gelu", "residual"} and o.measure_budget_ms() == 25 and o.nvtx
    assert Options.from_sources({"epilogue_off": "all"}).unfused_epilogues() == set(P.FAMILIES)
    assert Options.from_sources({}, mode="max-autotune", environ={}).measure_budget_ms() == 200
    assert Options.from_sources({}, environ={}).measure_budget_ms() == 0


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_measurement_times_every_eligible_kernel_and_caches_it(tmp_path):
    cache = C.ChoiceCache(str(tmp_path / C.FILE_NAME))
    p = P.GemmProblem("cuda", bf16, "gelu_tanh", True, m=4096, n=4096, k=4096, layout="x:c w:c")
    s = R.select(P.POLICY, p, measurement=R.Measurement(200, cache))
    assert set(s.timings_ms) == {"cublaslt", "inductor"} and s.how == "measured", s
    assert s.timings_ms[s.kernel.value] <= min(s.timings_ms.values()) / (1 - M.MARGIN)
    r = P.GemmProblem("cuda", bf16, "none", False, m=4096, n=4096, k=4096, residual=True, layout="x:c w:c")
    assert set(R.select(P.POLICY, r, measurement=R.Measurement(200, cache)).timings_ms) == {"addmm", "inductor"}
    cap = torch.cuda.get_device_capability()
    a = ap(capability=cap, tq=2048, tk=2048, heads_q=16, heads_kv=16, batch=4)
    choice = AP.choose(a, measurement=R.Measurement(300, cache))
    assert choice.how in ("measured", "rule") and choice.backend in (Backend.CUDNN, Backend.FLASH, Backend.EFFICIENT)
    assert {e.key.op for e in C.ChoiceCache(cache.path).entries()} >= {"gemm_epilogue"}
