"""The real-model benchmark (issue 17): third-party models from random configs, the real-cpu preset
end to end, skipped models with their reason, host vs kernel time, partial results, --only; the HF
models as users leave them (issue 41: config defaults, HF's own loss, gradient checkpointing) and
the real-defaults preset that runs them next to their twins."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from enn_backend import models
from enn_backend.bench import cli, markdown, plots, runner, steps, summary
from enn_backend.bench.backends import PAIRS
from enn_backend.models.common import ModelSpec
from enn_backend.models.real import AS_LEFT

pytest.importorskip("transformers")

VISION = ("timm_vit_small", "tv_resnet18")


# ------------------------------------------------------------------ the models and their batches
def test_padded_batches_mask_and_label_the_padding():
    _, make, _ = models.build("hf_qwen2_sdpa", "cpu-small")
    ids, mask = make(0).args
    target = make(0).target
    assert ids.shape == mask.shape == target.shape == (2, 64)
    assert mask[0].all() and not mask[1, :16].any() and mask[1, 16:].all()  # left padding, a quarter
    assert (ids[1, :16] == 0).all() and (target[1, :16] == -100).all()
    assert (target[0] != -100).all() and torch.equal(ids[0, 1:], target[0, :-1])  # next-token targets
    _, make, _ = models.build("hf_bert_eager", "cpu-small")
    ids, mask = make(0).args
    assert not mask[1, -8:].any() and mask[1, :-8].all() and (make(0).target[1, -8:] == -100).all()  # right padding
    _, make, _ = models.build("hf_t5", "cpu-small")
    ids, mask, dec = make(0).args
    assert dec.shape == make(0).target.shape == (2, 16) and (dec[:, 0] == 0).all()  # decoder input shifted right
    with pytest.raises(ValueError, match="padding must be"):
        models.real.padding_mask(2, 8, "middle")


def test_every_available_real_model_builds_and_steps():
    for name in models.names("real"):
        if models.unavailable(name):
            continue
        model, make, loss_fn = models.build(name, "cpu-small")
        batch = make(0)
        loss = loss_fn(model(*batch.args), batch.target)
        loss.backward()
        assert torch.isfinite(loss), name
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad), name


def test_the_attention_implementation_asked_for_is_the_one_built():
    model, _, _ = models.build("hf_llama_eager", "cpu-small")
    assert model.model.config._attn_implementation == "eager"
    assert model.model.config.num_attention_heads == 4 * model.model.config.num_key_value_heads  # GQA 4:1
    model, _, _ = models.build("hf_bert_sdpa", "cpu-small")
    assert model.model.config._attn_implementation == "sdpa"


def test_unavailable_model_is_skipped_with_the_reason(monkeypatch):
    spec = ModelSpec("needs_nothing_here", "a model whose package is missing", lambda device, **c: None,
                     {"cpu-small": {}}, requires=("enn_no_such_package",))
    monkeypatch.setitem(models.REAL, spec.name, spec)
    assert "enn_no_such_package does not import: ModuleNotFoundError" in models.unavailable(spec.name)
    cfg = runner.BenchConfig(models=[spec.name], warm_up=False, preset="test")
    result = runner.run_suite(cfg)
    assert result["workloads"] == []
    assert [(s["model"], s["mode"]) for s in result["skipped"]] == [(spec.name, "train"), (spec.name, "infer")]
    assert all("enn_no_such_package does not import" in s["why"] for s in result["skipped"])
    assert "Skipped: needs_nothing_here train fp32 (enn_no_such_package does not import" in markdown.render_markdown(result)


def test_modes_of_a_model_limit_its_workloads(monkeypatch):
    ran = []
    monkeypatch.setattr(runner, "run_workload", lambda m, mode, dt, *a, **k: ran.append((m, mode)) or
                        {"model": m, "mode": mode, "dtype": dt, "backends": {}})
    runner.run_suite(runner.BenchConfig(models=["hf_llama_eager_4k", "hf_llama_eager"], warm_up=False))
    assert ran == [("hf_llama_eager_4k", "train"), ("hf_llama_eager", "train"), ("hf_llama_eager", "infer")]


def test_gpt2_trains_with_transformers_default_dropout():
    model, make, _ = models.build("hf_gpt2_eager", "cpu-small")
    assert model.model.config.attn_pdrop == model.model.config.resid_pdrop == 0.1
    assert models.spec("hf_gpt2_eager").stochastic
    batch = make(0)
    assert not torch.equal(model(*batch.args), model(*batch.args))  # two training forwards differ
    model.eval()
    assert torch.equal(model(*batch.args), model(*batch.args))
    model, _, _ = models.build("hf_bert_eager", "cpu-small")  # every other model: dropout 0, set in its config
    assert model.model.config.attention_probs_dropout_prob == model.model.config.hidden_dropout_prob == 0.0


@pytest.mark.slow
def test_stochastic_training_gets_no_accuracy_verdict(monkeypatch):
    monkeypatch.setitem(models.MODELS, "mlp", dataclasses.replace(models.MODELS["mlp"], stochastic="drops out"))
    cfg = runner.BenchConfig(models=["mlp"], modes=["train"], backends=["eager", "inductor"], rounds=1, warmup=1,
                             sample_s=0.001, warm_compile=False, profile_slow=False, warm_up=False, threads=1)
    wl = runner.run_suite(cfg)["workloads"][0]
    assert wl["eager_self_check"] == {"passed": None, "detail": "not applicable: the model drops out"}
    assert wl["backends"]["inductor"]["accuracy"] == {"passed": None, "reason": "not judged: the model drops out"}
    assert wl["backends"]["inductor"]["time_ms"] > 0


# ------------------------------------------------------------------ models as users leave them (issue 41)
def _no_dropout_keys(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if "dropout" not in k}


def test_as_left_variants_have_their_twins_sizes_and_the_configs_dropout():
    import transformers

    for twin, variants in AS_LEFT.items():
        for size in models.SIZES:
            sizes = _no_dropout_keys(models.config(twin, size))
            assert [models.config(v, size) for v in variants] == [sizes, sizes], (twin, size)
        defaults, ckpt = (models.spec(v) for v in variants)
        assert defaults.modes == ("train", "infer") and ckpt.modes == ("train",)
        assert bool(defaults.stochastic) == bool(ckpt.stochastic) == (twin in ("hf_gpt2_eager", "hf_bert_sdpa")), twin
    gpt2 = models.build("hf_gpt2_eager_defaults").model.model.config
    assert (gpt2.attn_pdrop, gpt2.resid_pdrop, gpt2.embd_pdrop) == (0.1, 0.1, 0.1)
    bert = models.build("hf_bert_sdpa_defaults").model.model.config
    default = transformers.BertConfig()
    assert (bert.hidden_dropout_prob, bert.attention_probs_dropout_prob) == \
        (default.hidden_dropout_prob, default.attention_probs_dropout_prob) == (0.1, 0.1)


def test_as_left_variants_train_one_step_of_the_bench():
    for variants in AS_LEFT.values():
        for name in variants:
            model, make, loss_fn = models.build(name, "cpu-small")
            before = [p.detach().clone() for p in model.parameters()]
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            loss = steps.timed_step(model, opt, make(0), loss_fn, "train", steps.autocast("cpu", "fp32"))()
            assert loss.dim() == 0 and torch.isfinite(loss), name
            assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()) if p.requires_grad), name


def test_defaults_llama_keeps_use_cache_and_its_loss_is_hfs_from_labels():
    import transformers

    model, make, loss_fn = models.build("hf_llama_sdpa_defaults", "cpu-small")
    hf = model.model
    default = transformers.LlamaConfig()
    assert hf.config.use_cache is default.use_cache is True and hf.config.attention_dropout == default.attention_dropout
    twin, _, _ = models.build("hf_llama_sdpa", "cpu-small")
    assert twin.model.config.use_cache is False
    batch = make(0)
    ids, labels = batch.args
    assert torch.equal(labels, batch.target) and torch.equal(labels, ids)  # no padding: HF's labels are the inputs
    assert hf(input_ids=ids).past_key_values is not None  # the forward builds a KV cache
    loss = steps.result_step(model, model, batch, loss_fn, "train", steps.autocast("cpu", "fp32"))[0]
    with torch.no_grad():
        direct = hf(input_ids=ids, labels=labels).loss
        logits = hf(input_ids=ids).logits
    assert torch.equal(loss, direct)
    # HF shifts the labels itself: position t predicts t+1, the last position predicts nothing
    shifted = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    assert torch.allclose(loss, shifted, rtol=1e-5, atol=1e-6)


def test_ckpt_model_checkpoints_its_layers_with_the_defaults_values():
    model, make, loss_fn = models.build("hf_llama_sdpa_ckpt", "cpu-small")
    assert model.model.is_gradient_checkpointing
    assert all(layer.gradient_checkpointing for layer in model.model.model.layers)
    defaults, _, _ = models.build("hf_llama_sdpa_defaults", "cpu-small")
    assert not defaults.model.is_gradient_checkpointing
    batch = make(0)
    amp = steps.autocast("cpu", "fp32")
    ckpt_run = steps.result_step(model, model, batch, loss_fn, "train", amp)
    plain_run = steps.result_step(defaults, defaults, batch, loss_fn, "train", amp)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(ckpt_run, plain_run))  # same weights, same step


# ------------------------------------------------------------------ presets and the command line
def test_real_presets_and_only(capsys):
    real = cli.build_config(cli.parser().parse_args(["--preset", "real"]), [])
    assert real.device == "cuda" and real.dtypes == ["bf16"] and real.host_vs_kernel and not real.warm_compile
    variants = {v for pair in AS_LEFT.values() for v in pair}
    assert cli.NOT_IN_REAL == variants | {"tv_resnet50"}
    assert real.models == [m for m in models.names("real") if m not in cli.NOT_IN_REAL] and real.budget_s and real.budget_s <= 330
    cpu = cli.build_config(cli.parser().parse_args(["--preset", "real-cpu", "--only", "hf_bert_eager,hf_llama_eager"]), [])
    assert cpu.device == "cpu" and cpu.models == ["hf_llama_eager", "hf_bert_eager"]  # the preset's order
    with pytest.raises(SystemExit, match="not in the quick preset"):
        cli.build_config(cli.parser().parse_args(["--only", "hf_llama_eager"]), [])
    assert cli.main(["--list"]) == 0
    assert "hf_bert_sdpa" in capsys.readouterr().out


def test_real_defaults_preset_runs_each_variant_next_to_its_twin():
    real = cli.build_config(cli.parser().parse_args(["--preset", "real"]), [])
    both = cli.build_config(cli.parser().parse_args(["--preset", "real-defaults"]), [])
    assert list(AS_LEFT) == ["hf_llama_eager", "hf_llama_sdpa", "hf_gpt2_eager", "hf_bert_sdpa"]
    assert both.models[:3] == ["hf_llama_eager", "hf_llama_eager_defaults", "hf_llama_eager_ckpt"]
    assert both.models == [m for twin, (defaults, ckpt) in AS_LEFT.items() for m in (twin, defaults, ckpt)]
    assert set(AS_LEFT) <= set(real.models) and not (set(both.models) - set(AS_LEFT)) & set(real.models)
    same = ("device", "size", "dtypes", "modes", "rounds", "rep_ms", "warm_compile", "host_vs_kernel")
    assert [getattr(both, k) for k in same] == [getattr(real, k) for k in same]
    assert both.backends == ["inductor", "enn"] and both.budget_s and both.budget_s <= 330
    cpu = cli.build_config(cli.parser().parse_args(["--preset", "real-cpu", "--only", ",".join(both.models)]), [])
    assert cpu.device == "cpu" and cpu.models == both.models


# ------------------------------------------------------------------ summary and Markdown of real results
def _fake(cuda: bool) -> dict:
    def be(ms, acc=True):
        return {"ok": True, "time_ms": ms, "samples_ms": [ms * 0.9, ms, ms * 1.1],
                "accuracy": {"passed": acc, "reason": "not judged: the model drops out" if acc is None else "pass"},
                "enn": None}

    wl = {"model": "hf_gpt2_eager", "mode": "train", "dtype": "bf16", "speedup_enn_vs_inductor": 0.9,
          "backends": {"eager": be(3.0), "inductor": be(2.0, None), "enn": be(2.2, None)},
          "host_vs_kernel": {"eager": {"wall_ms": 3.0, "kernel_ms": 2.9 if cuda else None, "idle_share": 0.03 if cuda else None},
                             "inductor": {"wall_ms": 2.0, "kernel_ms": 1.8 if cuda else None, "idle_share": 0.1 if cuda else None},
                             "enn": {"wall_ms": 2.2, "host_ms": 1.9, "kernel_ms": 1.5 if cuda else None,
                                     "idle_share": 0.32 if cuda else None}},
          "speedups": {"enn-reduce-overhead / inductor-reduce-overhead": 1.04}}
    wl["backends"]["enn"]["enn"] = {"fusions": {"attention": 2}, "kernel_choice_counts": {"flash": 2}, "fallbacks": {}}
    return {"preset": "real" if cuda else "real-cpu", "device": {"device": "cuda" if cuda else "cpu"},
            "config": {"backends": ["eager", "inductor", "enn"]}, "workloads": [wl], "skipped": []}


def test_real_summary_goals_and_not_judged_accuracy():
    result = _fake(cuda=True)
    s = summary.summarize(result)
    assert s["accuracy"]["enn"] == {"pass": 0, "fail": 0, "failed": [], "not_judged": 1}
    goals = {g["goal"]: g for g in s["goals"]}
    geo = next(g for k, g in goals.items() if "geomean" in k)
    assert geo["target"] == 1.15 and not geo["met"]
    assert next(g for k, g in goals.items() if "slowest" in k)["target"] == 1.00


def test_markdown_host_kernel_table():
    md = markdown.render_markdown(_fake(cuda=True))
    assert "## Per workload: spread, enn's decisions, host and kernel time" in md
    row = next(line for line in md.splitlines() if line.startswith("| hf_gpt2_eager train bf16 |"))
    assert "2.200 ±10%" in row and "attention=2" in row and "flash=2" in row and "1.500 / 1.900 / 2.200 (32%)" in row
    assert "speed-up enn-reduce-overhead / inductor-reduce-overhead" in md and "| 1.040 |" in row
    assert "| n/a |" in md and "Accuracy not judged: hf_gpt2_eager train bf16 (not judged: the model drops out)" in md
    cpu_md = markdown.render_markdown(_fake(cuda=False))
    assert "every step is host time" in cpu_md and "kernel / wall" not in cpu_md


# ------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_real_cpu_preset_end_to_end(tmp_path, monkeypatch):
    """The real-cpu preset with an HF decoder and the padded encoder (inference, the shortest path
    through the runner with a compile), and the vision models, skipped with the reason where their
    package does not import."""
    written = []
    real_write = cli.write_outputs

    def spy(result, out, stem, plots=True):
        written.append((bool(result.get("partial")), plots, len(result["workloads"])))
        return real_write(result, out, stem, plots=plots)

    monkeypatch.setattr(cli, "write_outputs", spy)
    only = ["hf_llama_eager", "hf_bert_eager", *VISION]
    rc = cli.main(["--preset", "real-cpu", "--only", ",".join(only), "--modes", "infer", "--out", str(tmp_path)])
    assert rc == 0
    with open(tmp_path / "real-cpu.json") as f:
        data = json.load(f)
    ran = [w["model"] for w in data["workloads"]]
    assert ran[:2] == ["hf_llama_eager", "hf_bert_eager"]
    for w in data["workloads"]:
        be = w["backends"]
        for b in ("eager", "inductor", "enn"):
            assert be[b]["ok"], be[b]["error"]
            assert be[b]["accuracy"]["passed"], be[b]["accuracy"]
            assert w["host_vs_kernel"][b]["wall_ms"] == be[b]["time_ms"] and w["host_vs_kernel"][b]["kernel_ms"] is None
            assert w["host_vs_kernel"][b]["host_ms"] > 0
        enn = be["enn"]["enn"]
        assert isinstance(enn["fusions"], dict), enn
        if w["model"].startswith("hf_"):
            assert enn["kernel_choice_counts"], enn  # attention sites were decided on (a ResNet has none)
    for name in VISION:
        why = models.unavailable(name)
        if why:
            assert {(s["model"], s["why"]) for s in data["skipped"] if s["model"] == name} == {(name, why)}
        else:
            assert name in ran
    # a partial result after each workload, then the final one with plots
    assert written == [(True, False, n) for n in range(1, len(ran) + 1)] + [(False, True, len(ran))]
    md = (tmp_path / "real-cpu.md").read_text()
    for w in data["workloads"]:
        fusions = ", ".join(f"{k}={v}" for k, v in sorted(w["backends"]["enn"]["enn"]["fusions"].items())) or "none"
        row = next(line for line in md.splitlines() if line.startswith(f"| {w['model']} infer fp32 |"))
        assert f"| {fusions} |" in row
    assert "## Per workload: spread, enn's decisions, host and kernel time" in md
    assert all(f"{name} infer fp32 (" in md for name in VISION if models.unavailable(name))  # the Skipped line


def test_host_kernel_plot(tmp_path):
    pytest.importorskip("matplotlib")
    files = plots.write_outputs(_fake(cuda=True), str(tmp_path), "real")
    assert os.path.getsize(files["kernel vs wall time per step and backend"]) > 1000
    assert "kernel vs wall time per step and backend" not in plots.write_outputs(_fake(cuda=False), str(tmp_path), "cpu")


def test_the_host_bound_preset_times_each_backend_in_its_default_mode_and_under_cuda_graphs():
    hb = cli.build_config(cli.parser().parse_args(["--preset", "host-bound"]), [])
    assert hb.models == ["tv_resnet50", "timm_vit_small", "hf_t5", "hf_bert_sdpa", "hf_gpt2_eager"]
    assert hb.modes == ["train"] and hb.device == "cuda" and hb.host_vs_kernel
    assert hb.backends == ["inductor", "inductor-reduce-overhead", "enn", "enn-reduce-overhead"]
    assert ("inductor-reduce-overhead", "enn-reduce-overhead") in PAIRS
