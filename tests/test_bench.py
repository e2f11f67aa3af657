"""The benchmark suite: the accuracy rule, the runner, the presets and one real end-to-end run."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

from enn_backend import models
from enn_backend.bench import accuracy, backends, cli, markdown, plots, runner, steps, summary, timing


# ------------------------------------------------------------------ accuracy
def _noisy(ref: torch.Tensor, scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (ref + scale * torch.randn(ref.shape, generator=g, dtype=torch.float64)).float()


@pytest.fixture(scope="module")
def ref64():
    return torch.randn(4096, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def test_accuracy_allclose_passes(ref64):
    eager = ref64.float()
    v = accuracy.compare([eager.clone()], [eager], [ref64], tol=1e-3)
    assert v.passed and v.checks[0].method == "allclose"


def test_accuracy_rmse_rule_fp32_and_bf16(ref64):
    eager = _noisy(ref64, 0.05, 1)  # eager itself is 0.05 RMSE off fp64; tolerance far below that
    ok = _noisy(ref64, 0.09, 2)  # ~1.8x eager's error (noise adds in quadrature with fp32 rounding: ~0.09 vs 0.05)
    bad = _noisy(ref64, 0.5, 3)
    mid = _noisy(ref64, 0.125, 4)  # ~2.5x: fails at m=2 (fp32), passes at m=3 (bf16)
    v = accuracy.compare([ok], [eager], [ref64], tol=1e-3)
    assert v.passed and v.checks[0].method == "rmse", v.reason
    v = accuracy.compare([bad], [eager], [ref64], tol=1e-3)
    assert not v.passed and "RMSE" in v.reason
    assert not accuracy.compare([mid], [eager], [ref64], tol=1e-3, dtype="fp32").passed
    assert accuracy.compare([mid], [eager], [ref64], tol=1e-3, dtype="bf16").passed
    assert v.rel_error_compiled > v.rel_error_eager > 0


def test_accuracy_nan_and_inf_fail(ref64):
    eager = ref64.float()
    for bad_value in (float("nan"), float("inf"), float("-inf")):
        c = eager.clone()
        c[17] = bad_value
        v = accuracy.compare([c], [eager], [ref64], tol=1e-3)
        assert not v.passed and v.checks[0].method == "nonfinite", bad_value
        # also without an fp64 reference (cosine mode)
        assert not accuracy.compare([c], [eager], None, tol=1e-3).passed
    # a NaN the fp64 reference has too is the model's own: not the compiler's fault
    r = ref64.clone()
    r[3] = float("nan")
    c, e = eager.clone(), eager.clone()
    c[3] = e[3] = float("nan")
    c[5] += 1e-6
    assert accuracy.compare([c], [e], [r], tol=1e-3).passed
    # NaN where the reference has +inf: kinds differ -> fail
    r[3] = float("inf")
    assert not accuracy.compare([c], [e], [r], tol=1e-3).passed


def test_accuracy_cosine_fallback_and_structure(ref64):
    eager = ref64.float()
    assert accuracy.compare([eager * 1.01], [eager], None, tol=1e-4).checks[0].method == "cosine"
    assert accuracy.compare([eager * 1.01], [eager], None, tol=1e-4).passed
    assert not accuracy.compare([-eager], [eager], None, tol=1e-4).passed
    assert not accuracy.compare([eager, eager], [eager], None, tol=1e-3).passed
    assert not accuracy.compare([eager[:10]], [eager[:11]], None, tol=1e-3).passed
    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    assert [t.numel() for t in accuracy.flatten({"y": (b, [c]), "x": a, "z": None})] == [1, 2, 3]
    ints = torch.arange(5)
    assert accuracy.compare([ints], [ints.clone()], [ints], tol=1e-3).passed
    assert not accuracy.compare([ints + 1], [ints], [ints], tol=1e-3).passed


def test_eager_self_check_and_no_worse(ref64):
    e = ref64.float()
    assert accuracy.eager_self_check([e], [e.clone()], tol=1e-3)[0]
    ok, why = accuracy.eager_self_check([e], [e + 1.0], tol=1e-3)
    assert not ok and "differ" in why
    eager = _noisy(ref64, 0.05, 1)
    good = accuracy.compare([_noisy(ref64, 0.06, 2)], [eager], [ref64], tol=1e-3)
    worse = accuracy.compare([_noisy(ref64, 0.09, 3)], [eager], [ref64], tol=1e-3)
    assert good.passed and worse.passed
    assert accuracy.no_worse(good, worse)[0]
    assert not accuracy.no_worse(worse, good)[0]
    failing = accuracy.compare([_noisy(ref64, 1.0, 4)], [eager], [ref64], tol=1e-3)
    assert not accuracy.no_worse(failing, good)[0]


# ------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    # one workload (training: forward, backward and optimizer, the longest path) keeps this test
    # well under 90 s on a busy 2-core machine; inference steps are covered below without compiling
    cfg = runner.BenchConfig(models=["mlp"], modes=["train"], dtypes=["fp32"],
                             backends=["eager", "inductor", "enn"], rounds=3, warmup=1, sample_s=0.005,
                             warm_compile=True, profile_slow=True, slow_threshold=100.0,  # always profile
                             preset="test", command="pytest tests/test_bench.py", threads=1,
                             warm_up=False)  # the compiler's start-up (~10-30 s here) lands in a cold compile
    result = runner.run_suite(cfg)
    out = tmp_path_factory.mktemp("bench")
    files = plots.write_outputs(result, str(out), "tiny")
    return result, files, out


def test_runner_produces_valid_json(tiny_result):
    result, files, out = tiny_result

    def no_nan(x):
        raise ValueError(f"non-strict JSON constant {x}")

    with open(files["raw results (JSON)"]) as f:
        data = json.loads(f.read(), parse_constant=no_nan)
    assert data["format"] == "enn-bench" and data["command"] == "pytest tests/test_bench.py"
    assert [(w["model"], w["mode"]) for w in data["workloads"]] == [("mlp", "train")]
    for w in data["workloads"]:
        assert w["eager_self_check"]["passed"]
        assert "compiled_during_timing" not in w  # the timed steps ran compiled code only
        be = w["backends"]
        assert set(be) == {"eager", "inductor", "enn"}
        for name in be:
            assert be[name]["ok"], be[name]["error"]
            assert be[name]["time_ms"] > 0 and len(be[name]["samples_ms"]) == 3
        for name in ("inductor", "enn"):
            assert be[name]["compile_cold_s"] > 0 and be[name]["compile_warm_s"] > 0
            assert be[name]["graphs"] >= 1
            assert be[name]["accuracy"]["passed"], be[name]["accuracy"]
        assert be["eager"]["compile_cold_s"] is None
        assert be["enn"]["enn"]["graph_paths"], "enn's report names the graphs it compiled"
        assert be["inductor"]["enn"] is None
        assert w["speedup_enn_vs_inductor"] > 0
        assert w["accuracy_enn_no_worse"]["passed"]
        assert set(w["profile"]) == {"inductor", "enn"} and w["profile"]["enn"]["top"]
        assert w["profile"]["inductor"]["calls"]  # operators per step: the evidence of what differs
    s = data["summary"]
    assert s["geomean_enn_vs_inductor"]["train"] == pytest.approx(data["workloads"][0]["speedup_enn_vs_inductor"])
    assert s["goals"] and s["goals"][0]["goal"].startswith("CPU")
    assert s["accuracy"]["enn"] == {"pass": 1, "fail": 0, "failed": []}


def test_runner_markdown_and_plots(tiny_result):
    result, files, out = tiny_result
    md = open(files["markdown"]).read()
    assert "pytest tests/test_bench.py" in md
    assert "| mlp | train | fp32 |" in md
    assert "## Goals" in md and "profile evidence" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in md
    else:
        assert os.path.getsize(files["speedup of enn over inductor per workload"]) > 1000
    # a saved JSON re-renders through the CLI
    assert cli.main(["--render", files["raw results (JSON)"], "--out", str(out / "again")]) == 0
    assert (out / "again" / "tiny.md").read_text().count("| mlp |") == 1


def test_the_warm_up_times_each_compiled_backend_and_the_results_say_so(tiny_result, tmp_path):
    # once-per-process costs (compile workers, the C++ wrapper's precompiled header) go to a warm-up
    # of their own, reported apart, so that no workload's cold compile carries them
    seconds = backends.warm_up_compiler("cpu", str(tmp_path), ["eager", "inductor"])
    assert list(seconds) == ["inductor"] and seconds["inductor"] > 0
    md = markdown.render_markdown({**tiny_result[0], "warm_up_s": {"inductor": 1.25, "enn": 40.5}})
    assert "One-time warm-up before the first workload" in md and "inductor 1.2 s, enn 40.5 s" in md
    assert "One-time warm-up" not in markdown.render_markdown(tiny_result[0])


def test_summary_says_by_how_much_a_goal_is_missed():
    wl = lambda m, sp, dt="bf16": {"model": m, "mode": "train", "dtype": dt, "speedup_enn_vs_inductor": sp,  # noqa: E731
                                   "backends": {"inductor": {"compile_cold_s": 10.0}, "enn": {"compile_cold_s": 15.0}}}
    result = {"device": {"device": "cuda"}, "workloads": [wl("a", 1.2), wl("b", 0.9), wl("c", 2.0, "fp32")]}
    s = summary.summarize(result)
    goals = {g["goal"].split(": ", 1)[1]: g for g in s["goals"]}
    g = goals["geomean speedup enn vs inductor (train + infer)"]
    assert g["measured"] == pytest.approx(math.sqrt(1.2 * 0.9), abs=1e-4) and not g["met"]
    assert "missed by" in g["miss"] and "below 1.1" in g["miss"]
    assert not goals["slowest workload vs inductor"]["met"] and goals["slowest workload vs inductor"]["where"] == "b train bf16"
    worst = goals["worst enn / inductor cold compile time (one workload)"]
    assert not worst["met"] and "above 1.3" in worst["miss"]
    total = goals["enn / inductor cold compile time, all workloads"]
    assert total["measured"] == pytest.approx(1.5) and not total["met"]
    assert "enn / inductor warm compile time (geomean)" not in goals  # no warm compile measured
    assert summary.geomean([]) is None and summary.geomean([2.0, 8.0]) == pytest.approx(4.0)
    prof = {"enn": {"calls": {"aten::abs": 2.0, "aten::addmm": 4.0, "## Call CompiledFxGraph x ##": 1.0}},
            "inductor": {"calls": {"aten::addmm": 4.0, "aten::mm": 1.0}}}
    assert markdown.call_differences(prof) == [("aten::abs", 2.0), ("aten::mm", -1.0)]


def test_without_matplotlib_and_tqdm(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "tqdm", None)
    files, note = plots.write_plots({"workloads": []}, str(tmp_path), "x")
    assert files == {} and "matplotlib is not installed" in note
    p = runner.Progress(2)
    assert p.bar is None
    p.start("mlp train fp32")
    p.done("1.00x")
    p.close()
    assert "[1/2] mlp train fp32" in capsys.readouterr().err


def test_cli_rejects_unknown_names():
    with pytest.raises(SystemExit):
        cli.build_config(cli.parser().parse_args(["--models", "resnet9000"]), [])
    cfg = cli.build_config(cli.parser().parse_args(["--quick", "--models", "mlp,bert", "--autotune"]), ["--quick"])
    assert cfg.models == ["mlp", "bert"] and "inductor-max-autotune" in cfg.backends and cfg.device == "cpu"
    gpu = cli.build_config(cli.parser().parse_args(["--preset", "gpu"]), [])
    assert gpu.dtypes == ["bf16"] and gpu.size == "gpu-real" and set(gpu.models) == set(models.names())


def test_inference_and_training_steps_and_paired_ratio():
    model, make_inputs, loss_fn = models.build("bert", "cpu-small")
    batch = make_inputs()
    model.eval()
    outs = steps.result_step(model, model, batch, loss_fn, "infer", steps.autocast("cpu", "fp32"))
    assert len(outs) == 1 and outs[0].shape == (4, 4) and not outs[0].requires_grad
    step = steps.timed_step(model, None, batch, loss_fn, "infer", steps.autocast("cpu", "bf16"))
    assert step().dtype == torch.bfloat16  # autocast applies inside the step
    model.train()
    grads = steps.result_step(model, model, batch, loss_fn, "train", steps.autocast("cpu", "fp32"))
    assert len(grads) == 1 + len(list(model.parameters())) and all(p.grad is None for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    steps.timed_step(model, opt, batch, loss_fn, "train", steps.autocast("cpu", "fp32"))()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    # per-round ratios: a noisy round that hits both backends does not move the result
    assert timing.paired_ratio([2.0, 20.0, 2.2], [1.0, 10.0, 1.0]) == pytest.approx(2.0)


def test_enn_summary_counts_unit_level_fallbacks():
    import enn_backend
    from enn_backend.report import FallbackKind

    before = backends.enn_units()
    enn_backend.report().add_fallback(FallbackKind.COMPILE_ERROR, node="<graph>", phase="compile", graph="g97",
                                      reason="test", action="compiling g97 with plain Inductor")
    units = backends.enn_units() - before
    assert units == {"g97"}
    s = backends.enn_summary(units)
    assert s["fallbacks"] == {"compile_error": 1} and "plain Inductor" in s["fallback_details"][0]
    assert backends.enn_summary({"g98"})["fallbacks"] == {}


def test_first_compile_alternates_within_each_mode(monkeypatch):
    """The backend compiled first alternates from workload to workload within each (mode,
    dtype) group, so no group's ratios all carry the first-compile effect for one backend (the
    suite used to compile enn first in every inference workload)."""
    shifts = []

    def fake_workload(model, mode, dtype, cfg, cache_root, order_shift=0):
        shifts.append((mode, dtype, order_shift))
        return {"model": model, "mode": mode, "dtype": dtype, "backends": {}}

    monkeypatch.setattr(runner, "run_workload", fake_workload)
    cfg = runner.BenchConfig(models=["mlp", "gpt2_naive", "bert", "llama"], modes=["train", "infer"],
                             dtypes=["fp32"], backends=["eager", "inductor", "enn"], preset="test",
                             command="pytest", warm_up=False)
    runner.run_suite(cfg)
    for mode in ("train", "infer"):
        assert [s for m, _, s in shifts if m == mode] == [0, 1, 2, 3], shifts


def test_timer_rotates_the_order_and_can_fix_the_steps_per_sample():
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    timer = timing.Timer("cpu", rounds=3, warmup=1, steps_per_sample=2)
    samples = timer.measure(fns)
    assert timer.method == "wall clock" and {k: len(v) for k, v in samples.items()} == {"a": 3, "b": 3, "c": 3}
    warm = timing.steady_state_warmup()  # every callable first runs past enn's guard warm-up
    assert calls[: 3 * warm] == ["a"] * warm + ["b"] * warm + ["c"] * warm
    timed = calls[3 * warm:]
    assert timed == ["a", "a", "b", "b", "c", "c", "b", "b", "c", "c", "a", "a", "c", "c", "a", "a", "b", "b"]


def test_results_go_to_the_cache_folder_unless_a_folder_is_named(tmp_path, monkeypatch):
    """bench never writes into the working directory by default: --out, else ENN_BENCH_OUT, else
    bench/<device> in enn's cache folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ENN_BENCH_OUT", raising=False)
    monkeypatch.setenv("ENN_CACHE_DIR", str(tmp_path / "cache"))
    assert cli.output_folder(None, "cpu") == str(tmp_path / "cache" / "bench" / "cpu")
    monkeypatch.setenv("ENN_BENCH_OUT", str(tmp_path / "env"))
    assert cli.output_folder(None, "cpu") == str(tmp_path / "env")
    assert cli.output_folder("named", "cpu") == "named"


def test_speed_verdict_says_when_the_machine_is_too_noisy():
    """The demo's verdict: a ratio only when the per-round ratios' interquartile range excludes 1."""
    steady = timing.speed_verdict([2.0, 2.1, 1.9, 2.0, 2.05], [1.0, 1.02, 0.98, 1.0, 1.01], "inductor", "enn")
    assert steady.startswith("enn ran 2.0") and "too noisy" not in steady
    noisy = timing.speed_verdict([1.0, 2.0, 0.6, 1.5, 0.8], [1.0, 1.0, 1.0, 1.0, 1.0], "inductor", "enn")
    assert noisy.startswith("too noisy to tell enn from inductor"), noisy
    # identical code, one slow round out of seven: no verdict (the interquartile range would give one)
    same = timing.speed_verdict([1.0, 1.08, 1.09, 1.08, 1.07, 1.08, 0.97], [1.0] * 7, "inductor", "enn")
    assert same.startswith("too noisy"), same
    assert timing.speed_verdict([2.0] * 3, [1.0] * 3, "inductor", "enn").startswith("too noisy")  # too few rounds
    assert timing.spread_pct([1.0, 1.0, 1.0, 1.0]) == 0.0 and round(timing.spread_pct([1.0, 3.0]), 1) == 100.0
